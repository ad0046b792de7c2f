"""Peak memory and time of MaxSim forward + backward: chunked (mmembed.losses.maxsim) against
the unchunked product, in one run.

Three ways to score ``b`` queries x ``Lq`` tokens against ``c`` documents x ``Ld`` tokens
(``D`` wide, float32, some tokens absent), each followed by a backward of the scores' sum:

- ``unchunked``: the baseline, one ``einsum`` into ``[b, c, Lq, Ld]``, absent document tokens
  set to -inf, ``amax``, sum (the product is built whole and saved for backward);
- ``maxsim one step``: :func:`~mmembed.losses.maxsim.maxsim` with a chunk larger than the product
  (built whole once, but only the argmax indices are saved);
- ``maxsim chunked``: :func:`~mmembed.losses.maxsim.maxsim` with ``--chunk`` elements per step
  (default an eighth of the product: on the CPU many small steps cost time in fresh
  allocations, so the chunk is best as large as memory allows; mmembed's default is 2**25).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU each variant runs in a
fresh process and reports the growth of its peak resident set (``ru_maxrss``) over the inputs
(tracemalloc does not see torch's allocations). The chunk arithmetic's bound (the docstring of
``maxsim``) is printed beside it. Ratios are against the unchunked baseline of the same run.

Run: ``python benchmarks/bench_maxsim.py`` (``--small``, the default: 16 x 32 against 128 x 128,
D 128, a few seconds on 2 cores) or ``--full`` (64 x 32 against 256 x 256, D 128: the brief's
batch, about 2 GB for the baseline; under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import torch
import torch.nn.functional as F

from mmembed.losses.maxsim import maxsim, present_tokens


def make(b: int, lq: int, c: int, ld: int, dim: int, device: str):
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(b, lq, dim, generator=g), dim=-1)
    d = F.normalize(torch.randn(c, ld, dim, generator=g), dim=-1)
    q[:, lq * 3 // 4 :] = 0  # padding
    d[::2, ld // 2 :] = 0
    return q.to(device).requires_grad_(), d.to(device).requires_grad_()


def unchunked(q, d):
    sim = torch.einsum("qid,cjd->qcij", q, d)
    sim = sim.masked_fill(~present_tokens(d.detach())[None, :, None, :], float("-inf"))
    return (sim.amax(-1) * present_tokens(q.detach())[:, None, :]).sum(-1)


def run(variant: str, shape: tuple, chunk: int, device: str, repeats: int, queue=None):
    q, d = make(*shape, device)
    small_q, small_d = make(2, 4, 3, 5, shape[-1], device)
    maxsim(small_q, small_d).sum().backward()  # warm up (kernels, allocator) before the baseline
    unchunked(small_q, small_d).sum().backward()
    fns = {"unchunked": unchunked,
           "maxsim one step": lambda q, d: maxsim(q, d, chunk=2**62),
           "maxsim chunked": lambda q, d: maxsim(q, d, chunk=chunk)}
    fn = fns[variant]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats):
        q.grad = d.grad = None
        start = time.perf_counter()
        fn(q, d).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    result = (min(times), peak, float(q.grad.abs().sum() + d.grad.abs().sum()))
    if queue is not None:
        queue.put(result)
    return result


def measure(variant, shape, chunk, device, repeats):
    if device == "cuda":
        return run(variant, shape, chunk, device, repeats)
    ctx = mp.get_context("spawn")  # a fresh process: its peak RSS is this variant's alone
    queue = ctx.Queue()
    proc = ctx.Process(target=run, args=(variant, shape, chunk, device, repeats, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="16 x 32 queries against 128 x 128 documents (default)")
    size.add_argument("--full", action="store_true", help="64 x 32 queries against 256 x 256 documents")
    p.add_argument("--chunk", type=int, default=None,
                   help="maxsim's chunk, in elements of the product (default: an eighth of the product)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    shape = (64, 32, 256, 256, 128) if a.full else (16, 32, 128, 128, 128)
    b, lq, c, ld, dim = shape
    product = b * c * lq * ld
    a.chunk = a.chunk or product // 8
    step = max(a.chunk, lq * ld)
    print(f"{b} queries x {lq} tokens against {c} documents x {ld} tokens, D={dim}, float32, {a.device}; "
          f"product {product:,} elements ({product * 4 / 2**20:.0f} MiB); chunk {a.chunk:,}")
    print(f"bound of one chunked step (maxsim's docstring): {step * (4 + 12 / ld) / 2**20:.1f} MiB transient, "
          f"{b * c * lq * 8 / 2**20:.1f} MiB of indices saved")
    rows = [(v, *measure(v, shape, a.chunk, a.device, a.repeats))
            for v in ("unchunked", "maxsim one step", "maxsim chunked")]
    base_time, base_peak, base_check = rows[0][1:]
    print(f"{'variant':<18}{'time (s)':>10}{'peak (MiB)':>12}{'time ratio':>12}{'peak ratio':>12}")
    for name, t, peak, check in rows:
        assert abs(check - base_check) <= 1e-3 * abs(base_check), (name, check, base_check)  # same gradients
        print(f"{name:<18}{t:>10.3f}{peak / 2**20:>12.1f}{t / base_time:>12.2f}{peak / max(base_peak, 1):>12.3f}")


if __name__ == "__main__":
    main()
