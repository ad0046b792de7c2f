"""Speed of mmembed's batched InfoNCE against per-group Python loops, on the CPU.

A batch of B=64 groups, D=1024, each group with 0..15 negatives (uniform), float32.
Timed: forward + backward with respect to the embeddings. Two baselines, both checked to
give the same loss and gradient:

- ``reference``: the plain loop of ``tests/reference_losses.py`` (one dot product per
  candidate), the one the tests trust;
- ``per-group``: one matrix product per anchor, the way ms-swift computes batches whose
  groups differ in size.

Run: ``python benchmarks/bench_infonce.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from mmembed.losses import InfoNCELoss

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

from benchmarks.checkout import reference_losses  # noqa: E402

# the plain loop the tests trust (tests/reference_losses.py, read by its path)
_reference = reference_losses()
parse_groups, reference_infonce = _reference.parse_groups, _reference.reference_infonce


def make_batch(n_groups: int, dim: int, max_neg: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_neg + 1, (n_groups,), generator=gen).tolist()
    labels = torch.tensor([x for k in counts for x in [1.0] + [0.0] * k])
    emb = F.normalize(torch.randn(sum(2 + k for k in counts), dim, generator=gen), dim=-1)
    return emb, labels, counts


def per_group_loop(
    emb,
    labels,
    *,
    temperature,
    use_batch,
    include_qq=False,
    include_dd=False,
    mask_fake_negative=False,
    fake_neg_margin=0.1,
):
    """One matrix product per anchor against its candidates (ms-swift's unequal-size path)."""
    groups = parse_groups(emb.shape[0], labels.tolist())
    loss = emb.new_zeros(())
    if not use_batch:
        for a, p, negs in groups:
            logits = emb[a] @ emb[[p] + negs].T / temperature
            loss = loss + F.cross_entropy(logits[None], torch.zeros(1, dtype=torch.long))
        return loss / len(groups)
    doc_rows, pos_col = [], []
    for _, p, negs in groups:
        pos_col.append(len(doc_rows))
        doc_rows += [p] + negs
    docs = emb[doc_rows]
    anchors = emb[[a for a, _, _ in groups]]
    for i, (a, p, _) in enumerate(groups):
        qd = emb[a] @ docs.T
        threshold = qd[pos_col[i]].detach() + fake_neg_margin
        if mask_fake_negative:
            fake = qd > threshold
            fake[pos_col[i]] = False
            qd = qd.masked_fill(fake, float("-inf"))
        row = [qd]
        if include_qq:
            qq = torch.cat([emb[a] @ anchors[:i].T, emb[a] @ anchors[i + 1 :].T])
            if mask_fake_negative:
                qq = qq.masked_fill(qq > threshold, float("-inf"))
            row.append(qq)
        if include_dd:
            dd = emb[p] @ docs.T
            row.append(torch.cat([dd[: pos_col[i]], dd[pos_col[i] + 1 :]]))
        logits = torch.cat(row) / temperature
        loss = loss + F.cross_entropy(logits[None], torch.tensor([pos_col[i]]))
    return loss / len(groups)


def run(fn, emb):
    x = emb.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    loss = fn(x)
    loss.backward()
    return time.perf_counter() - start, loss.detach(), x.grad


def timed(fns, emb, repeats, warmup=True):
    """Best-of-``repeats`` seconds, last loss and gradient, for each function.

    The functions take turns so that load from elsewhere on the machine hits them alike;
    the best run is the least disturbed one.
    """
    for fn in fns if warmup else ():
        run(fn, emb)
    results = [[run(fn, emb) for fn in fns] for _ in range(repeats)]
    return [(min(r[i][0] for r in results), *results[-1][i][1:]) for i in range(len(fns))]


def bench_config(name: str, options: dict, emb: torch.Tensor, labels: torch.Tensor, repeats: int) -> None:
    """Time one setting against both baselines and print a row for each."""
    loss_fn = InfoNCELoss(**options)

    def ours(x):
        return loss_fn({"last_hidden_state": x}, labels)

    def loop(x):
        return per_group_loop(x, labels, **options)

    def reference(x):
        return reference_infonce(x, labels, **options)

    (t_ours, loss_ours, grad_ours), per_group = timed([ours, loop], emb, repeats)
    # the reference takes seconds per run: one run, no warm-up
    (plain,) = timed([reference], emb, 1, warmup=False)
    for base_name, (t_base, loss_base, grad_base) in (("reference", plain), ("per-group", per_group)):
        print(
            f"{name:30} {t_ours * 1e3:11.2f} {base_name:>10} {t_base * 1e3:12.1f} {t_base / t_ours:7.1f}x "
            f"{(loss_ours - loss_base).abs().item():9.1e} {(grad_ours - grad_base).abs().max().item():10.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--max-neg", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=20, help="runs of the fast functions (the reference: 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    emb, labels, counts = make_batch(args.groups, args.dim, args.max_neg)
    print(
        f"B={args.groups} D={args.dim} negatives per group 0..{args.max_neg} "
        f"(total {sum(counts)}, rows {emb.shape[0]}), float32, CPU threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}; "
        f"best of {args.repeats} forward+backward runs (reference: one run)"
    )
    configs = {
        "use_batch=True": dict(use_batch=True),
        "use_batch=True +qq +dd +mask": dict(use_batch=True, include_qq=True, include_dd=True, mask_fake_negative=True),
        "use_batch=False": dict(use_batch=False),
    }
    header = (
        f"{'config':30} {'mmembed ms':>11} {'baseline':>10} {'baseline ms':>12} {'ratio':>8} "
        f"{'|dloss|':>9} {'max|dgrad|':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, options in configs.items():
        bench_config(name, dict(temperature=0.1, **options), emb, labels, args.repeats)


if __name__ == "__main__":
    main()
