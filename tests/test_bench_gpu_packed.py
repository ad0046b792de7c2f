"""benchmarks/bench_gpu.py's packed GME run (``packed-varlen``: ``--attn_impl varlen --padding_free
true``) on the CPU: the dry run trains the tiny Qwen2-VL on its picture rows padded and packed,
and checks (check_same_work) that both take the same first batch and give the same first loss."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_packed_gme_gives_the_padded_first_loss(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_gpu.py"), "--dry_run", "--parts", "gme",
                           "--gme_batches", "4", "--work_dir", str(tmp_path)],
                          capture_output=True, text=True, env=dict(os.environ, MMEMBED_SWIFT_PYTHON=""), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [x for x in proc.stdout.splitlines() if x.startswith("GME tiny Qwen2-VL")]
    assert [r.split()[3] for r in rows] == ["mmembed", "mmembed"] and "packed-varlen" in rows[1], rows
    agree = [x for x in proc.stdout.splitlines() if "packed-varlen: the same first batch as padded" in x]
    assert agree and "agree" in agree[0], proc.stdout[-3000:]


def test_saved_for_backward_counts_what_autograd_keeps_once_per_storage():
    """The bench's activation measure, against a step whose saved tensors are known: a matmul keeps
    its input (for the weight's gradient) and the weight (a parameter: left out), relu keeps its
    output, and a view of the input saved again is the same storage (counted once)."""
    import torch

    from benchmarks.gpu.measure import saved_for_backward

    model = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(4, 8)
    with saved_for_backward(model) as saved:
        h = x @ model.weight.t()
        y = h.relu() * x[:, :1].expand(4, 16)  # mul keeps both factors: relu's output again, and a view of x
        y.sum().backward()
    assert saved["activations_mb"] * 2 ** 20 == x.numel() * 4 + 4 * 16 * 4
    assert saved["params_mb"] * 2 ** 20 == 8 * 16 * 4 == saved["trainable_mb"] * 2 ** 20


def test_saved_for_backward_is_the_most_held_at_once():
    """Two graphs one after the other, the first's saved tensors freed by its backward before the
    second saves its own: the most held at once is one graph's, whatever addresses the allocator
    hands out; both storages are counted as saved."""
    import torch

    from benchmarks.gpu.measure import saved_for_backward

    model = torch.nn.Linear(256, 256, bias=False)
    with saved_for_backward(model) as saved:
        for _ in range(2):
            h = torch.randn(64, 256) @ model.weight.t()  # keeps its input (64 x 256 floats), not the weight
            h.sum().backward()
            del h
    assert saved["activations_mb"] * 2 ** 20 == 64 * 256 * 4
    assert saved["tensors"] == 2
