"""benchmarks/memory_step.py (``bench_gpu.py --profile_memory``): a training step's memory at its peak
by kind, read from PyTorch's memory profiler, against a step whose tensors are known by their shapes."""


import torch

from benchmarks.memory_step import MIB, memory_at_peak, memory_profile, render


def test_a_steps_kinds_are_its_tensors_bytes():
    """Linear(256, 1024) -> ReLU -> Linear(1024, 256), AdamW, a batch of 512: the parameters'
    bytes, twice that in Adam's moments (plus a 4-byte step count per parameter), gradients as
    large as the parameters, the input's bytes; at the peak (the optimizer's step) all of them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(512, 256)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # Adam's state exists from the first step on: the profiled one finds it
    with memory_profile() as prof:
        step()
    got = memory_at_peak(prof, "cpu")
    params = sum(p.numel() * 4 for p in model.parameters())
    n = len(list(model.parameters()))
    assert got["most"]["parameter"] * MIB == params
    assert got["most"]["optimizer_state"] * MIB == 2 * params + 4 * n
    assert got["most"]["gradient"] * MIB == params
    assert 0 <= got["most"]["input"] * MIB - x.numel() * 4 <= 16  # and backward's scalar seeds
    # the hidden ReLU output [512, 1024] is kept for backward
    assert got["most"]["activation"] * MIB >= 512 * 1024 * 4
    assert got["peak_mb"] * MIB >= params + (2 * params + 4 * n) + params
    assert got["peak_mb"] == sum(got["at_peak"].values())


def test_the_table_sets_each_run_beside_the_others_at_the_same_work():
    figures = {"peak_mb": 100.0, "at_peak": {"parameter": 60.0, "activation": 40.0}, "most": {"activation": 45.0}}
    runs = [dict(label="X", batch=8, side="st", memory=figures),
            dict(label="X", batch=8, side="mmembed", memory=dict(figures, peak_mb=80.0)),
            dict(label="X", batch=16, side="mmembed", memory=dict(figures, peak_mb=50.0))]
    lines = render(runs, lambda r: r["batch"], lambda r: r["side"])
    assert "parameter" in lines[0] and "activation" in lines[0] and "gradient" not in lines[0]
    assert lines[2].endswith("1.25x mmembed") and lines[3].endswith("0.80x st")
    assert lines[4].split() == ["X", "b16", "mmembed", "50.0", "60.0", "40.0", "45.0"]  # alone at its batch: no ratio
