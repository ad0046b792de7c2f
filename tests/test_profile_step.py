"""benchmarks/profile_step.py: one step's time by region (vision tower, language model, attention,
loss, other, data, idle) and the top kernels. The summariser is checked on hand-made profiler
events whose split is worked out below, then on a tiny model profiled on the CPU against what
the test itself controls (a module never called, a dominant matmul, timed sleeps)."""

import time

import pytest
import torch
from torch import nn

from benchmarks.profile_step import (
    ATTENTION,
    DATA,
    LLM,
    LOSS,
    STEP,
    VISION,
    Ev,
    ProfiledStep,
    find_regions,
    render_markdown,
    render_text,
    summarise,
)

EVAL = "autograd::engine::evaluate_function: "
TOWERS = ("vision tower", "language model", "loss", "other device work", "data (wait for the batch)",
          "idle (device waits on the host)")


def rows(summary: dict) -> dict:
    """region -> (ms, forward ms, backward ms); the "of which" rows under the tower above them."""
    out, tower = {}, None
    for r in summary["regions"]:
        name = r["region"].strip()
        if r["region"].startswith(" "):
            name = f"{tower} / {name}"
        else:
            tower = name
        out[name] = (r["ms"], r["forward_ms"], r["backward_ms"])
    return out


def test_gpu_events_split_by_the_launching_op_and_by_the_backward_nodes_sequence_number():
    """Kernels run after their launch (the device lags the host); a backward node on autograd's
    thread takes the regions of the forward op with its sequence number, and an op outside any
    region that recorded the same number earlier (aten::to, seq 0) does not take it over, nor does
    a CUDA runtime call whose id (another numbering) equals an op's.
    Busy: [120,320] + [400,780] + [850,950] = 680 us; data 100; idle 1000 - 100 - 680 = 220."""
    us = [
        Ev(STEP, "range", 0, 1000, thread=1),
        Ev(DATA, "range", 0, 100, thread=1),
        Ev("aten::to", "op", 102, 108, thread=1, id=20, seq=0),
        Ev(VISION, "range", 100, 300, thread=1),
        Ev("aten::conv3d", "op", 110, 290, thread=1, id=1, seq=0),
        Ev("conv", "device", 120, 320, link=1),
        Ev(LLM, "range", 300, 500, thread=1),
        Ev(ATTENTION, "range", 320, 400, thread=1),
        Ev("aten::scaled_dot_product_attention", "op", 330, 390, thread=1, id=2, seq=1),
        Ev("flash_fwd", "device", 400, 460, link=2),
        Ev("aten::mm", "op", 410, 490, thread=1, id=3, seq=2),
        Ev("gemm", "device", 460, 560, link=3),
        # the CUDA runtime call that launched flash_fwd: its id (CUPTI's numbering) equals aten::mm's
        Ev("cudaLaunchKernel", "op", 380, 385, thread=1, id=3, link=2),
        Ev(LOSS, "range", 500, 550, thread=1),
        Ev("aten::logsumexp", "op", 505, 545, thread=1, id=4, seq=3),
        Ev("lse", "device", 560, 580, link=4),
        Ev(EVAL + "ConvolutionBackward0", "op", 575, 600, thread=2, id=9, seq=0, fwd_thread=1),
        Ev("ConvolutionBackward0", "op", 576, 599, thread=2, id=10, seq=0, fwd_thread=1),
        Ev("conv_bwd", "device", 580, 610, link=9),
        Ev(EVAL + "MmBackward0", "op", 600, 650, thread=2, id=5, seq=2, fwd_thread=1),
        Ev("gemm", "device", 610, 700, link=5),
        Ev(EVAL + "SdpaBackward0", "op", 650, 700, thread=2, id=6, seq=1, fwd_thread=1),
        Ev("aten::_flash_attention_backward", "op", 655, 695, thread=2, id=7),
        Ev("flash_bwd", "device", 700, 780, link=7),
        Ev("aten::_foreach_add_", "op", 800, 850, thread=1, id=8),
        Ev("adam", "device", 850, 900, link=8),
        Ev("nccl_allreduce", "device", 900, 950),  # no launching op in the trace
    ]
    s = summarise(us, device="cuda")
    r = rows(s)
    assert s["wall_ms"] == pytest.approx(1.0) and s["busy_ms"] == pytest.approx(0.68)
    assert r["vision tower"] == pytest.approx((0.23, 0.2, 0.03))
    assert r["vision tower / of which attention"] == pytest.approx((0.0, 0.0, 0.0))
    assert r["language model"] == pytest.approx((0.33, 0.16, 0.17))
    assert r["language model / of which attention"] == pytest.approx((0.14, 0.06, 0.08))
    assert r["loss"] == pytest.approx((0.02, 0.02, 0.0))
    assert r["other device work"][0] == pytest.approx(0.1)
    assert r["data (wait for the batch)"][0] == pytest.approx(0.1)
    assert r["idle (device waits on the host)"][0] == pytest.approx(0.22)
    assert sum(r[k][0] for k in TOWERS) == pytest.approx(s["wall_ms"])
    top = {t["name"]: (t["calls"], t["ms"]) for t in s["top"]}
    assert top["gemm"] == (2, pytest.approx(0.19)) and top["conv"] == (1, pytest.approx(0.2))
    assert s["top"][0]["name"] == "conv" and sum(t["share"] for t in s["top"]) == pytest.approx(1.0)


def test_cpu_events_split_by_self_time_and_the_backward_node_inside_an_evaluate_function():
    """On the CPU the busy time is the host ops': each op's self time goes to its regions. The
    inner ``AddmmBackward0`` event carries the forward's sequence number as well and must not
    replace the forward op in the lookup (it runs outside every range).
    Busy outside the data wait: 140 + 20 + 100 + 50 = 310 us; idle 500 - 50 - 310 = 140."""
    us = [
        Ev(STEP, "range", 0, 500, thread=1),
        Ev(DATA, "range", 0, 50, thread=1),
        Ev("aten::stack", "op", 10, 40, thread=1, id=1),
        Ev(LLM, "range", 50, 250, thread=1),
        Ev("aten::linear", "op", 60, 200, thread=1, id=2, seq=0),
        Ev("aten::addmm", "op", 70, 190, thread=1, id=3, seq=0),
        Ev("aten::sum", "op", 260, 280, thread=1, id=4, seq=1),
        Ev(EVAL + "SumBackward0", "op", 300, 320, thread=1, id=5, seq=1, fwd_thread=1),
        Ev("SumBackward0", "op", 301, 319, thread=1, id=6, seq=1, fwd_thread=1),
        Ev(EVAL + "AddmmBackward0", "op", 320, 400, thread=1, id=7, seq=0, fwd_thread=1),
        Ev("AddmmBackward0", "op", 321, 399, thread=1, id=8, seq=0, fwd_thread=1),
        Ev("aten::mm", "op", 330, 390, thread=1, id=9),
        Ev("Optimizer.step#AdamW.step", "range", 410, 480, thread=1),
        Ev("aten::_foreach_add_", "op", 420, 470, thread=1, id=10),
    ]
    s = summarise(us, device="cpu")
    r = rows(s)
    assert s["busy_ms"] == pytest.approx(0.31)
    assert r["language model"] == pytest.approx((0.22, 0.14, 0.08))
    assert r["vision tower"][0] == 0 and r["loss"][0] == 0
    assert r["other device work"][0] == pytest.approx(0.09)
    assert r["data (wait for the batch)"][0] == pytest.approx(0.05)
    assert r["idle (device waits on the host)"][0] == pytest.approx(0.14)
    top = {t["name"]: t["ms"] for t in s["top"]}
    assert "aten::stack" not in top  # the data wait's ops are not the step's compute
    assert top["aten::addmm"] == pytest.approx(0.12) and top["aten::linear"] == pytest.approx(0.02)


class Attention(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.q = nn.Linear(width, width)

    def forward(self, x):
        for _ in range(6):  # the dominant work: six [256, 512] x [512, 512] matmuls
            x = torch.tanh(self.q(x))
        return x


class LanguageModel(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.self_attn = Attention(width)
        self.mlp = nn.Linear(width, 8)

    def forward(self, x):
        return self.mlp(self.self_attn(x))


class Tiny(nn.Module):
    """A vision tower that is never called, a language model whose attention does almost all the
    work, and a small head; names as in Qwen2-VL under PEFT (``base_model.model.``)."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = nn.Module()
        self.base_model.model.visual = nn.Sequential(nn.Linear(width, width))
        self.base_model.model.language_model = LanguageModel(width)

    def forward(self, x):
        return self.base_model.model.language_model(x)


class Loss(nn.Module):
    def forward(self, y):
        return torch.logsumexp(y, dim=-1).mean()


def test_find_regions_takes_the_outermost_module_of_each_part_through_wrappers():
    model, loss = Tiny(), Loss()
    regions = find_regions(model, {"vit": ("visual",), "llm": ("language_model",)}, loss)
    assert regions[VISION] == [model.base_model.model.visual]
    assert regions[LLM] == [model.base_model.model.language_model]
    assert regions[ATTENTION] == [model.base_model.model.language_model.self_attn]
    assert regions[LOSS] == [loss]
    text = nn.ModuleDict({"backbone": nn.Linear(2, 2)})
    found = find_regions(text)  # a text model: the language model is the whole encoder
    assert found == {LLM: [text["backbone"]]}


def test_a_profiled_cpu_step_of_a_tiny_model():
    """The real profiler on a forward, backward and optimizer step: the tower never called is 0,
    the attention's matmuls dominate (forward and backward, the backward found through the
    sequence numbers), the timed sleeps show up as data and idle, and the rows sum to the step."""
    torch.manual_seed(0)
    model, loss_fn = Tiny(), Loss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 512)
    loss_fn(model(x)).backward()  # warm up: the first call allocates
    opt.zero_grad()
    regions = find_regions(model, {"vit": ("visual",), "llm": ("language_model",)}, loss_fn)
    with ProfiledStep(regions, cuda=False) as step:
        with step.data():
            time.sleep(0.05)
            batch = x.clone()
        time.sleep(0.03)
        loss_fn(model(batch)).backward()
        opt.step()
        opt.zero_grad()
    s = step.summary()
    r = rows(s)
    assert all(v[0] >= 0 for v in r.values())
    assert sum(r[k][0] for k in TOWERS) == pytest.approx(s["wall_ms"], rel=1e-3)
    assert r["vision tower"][0] == 0
    lm, attn = r["language model"], r["language model / of which attention"]
    assert lm[0] > 0.5 * s["busy_ms"] and attn[0] > 0.8 * lm[0]
    assert attn[1] > 0 and attn[2] > 0  # forward and backward both found
    assert lm[0] > r["loss"][0] > 0 and lm[0] > r["other device work"][0]
    assert r["data (wait for the batch)"][0] >= 50 and r["idle (device waits on the host)"][0] >= 30
    assert s["top"][0]["name"] in ("aten::addmm", "aten::mm") and s["modules"]["attention"] == 1
    text, md = render_text(s, "tiny"), render_markdown(s, "tiny")
    assert "language model" in text and "| loss |" in md and "&nbsp;&nbsp;of which attention" in md
    # the hooks are gone after the step: a later forward records nothing
    assert not any(m._forward_pre_hooks for m in model.modules())
