"""bench_gpu's ``--largest_batch``: which sides train each part's model, and the search for the
largest batch that trains (doubling, then halving the gap to the first out-of-memory batch)."""

from __future__ import annotations

# --largest_batch: which sides train each part's model (s-t has no GME: its model is remote code)
LARGEST_SIDES = {"text": ("st", "mmembed", "swift"), "gme": ("mmembed", "swift"), "qwen3vl": ("st", "mmembed", "swift")}
LARGEST_LABELS = {"text": {False: "Qwen3-0.6B-sized", True: "Qwen3 2-layer"},
                  "gme": {False: "GME Qwen2-VL-2B-sized", True: "GME tiny Qwen2-VL"},
                  "qwen3vl": {False: "Qwen3-VL-Emb-2B-sized", True: "tiny Qwen3-VL-Emb"}}


def largest_batch(fits, start: int, limit: int, step: int = 8) -> dict:
    """The largest batch for which ``fits(batch)`` is True: from ``start``, doubled while it fits
    (up to ``limit``) or halved while it does not; then halved intervals between the largest
    that fitted and the smallest that did not, to a multiple of ``step``. ``fits`` returns None
    when it cannot tell (a crash, the time limit): the search stops there. Returns ``largest``
    (None: not even the smallest fitted), ``oom`` (the smallest batch that did not fit; None: none
    tried), ``limit_reached`` and every ``probes`` (batch, outcome) in order."""
    probes: list = []

    def ask(b: int):
        outcome = fits(b)
        probes.append((b, outcome))
        return outcome

    good = bad = None
    b = start
    while True:
        outcome = ask(b)
        if outcome is None:
            return dict(largest=good, oom=bad, limit_reached=False, probes=probes)
        if outcome:
            good = b
            if b >= limit or bad is not None:
                break
            b = min(2 * b, limit)
        else:
            bad = b
            if good is not None or b <= 1:
                break
            b = max(1, b // 2)
    while good is not None and bad is not None and bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        outcome = ask(mid)
        if outcome is None:
            break
        good, bad = (mid, bad) if outcome else (good, mid)
    return dict(largest=good, oom=bad, limit_reached=good is not None and good >= limit, probes=probes)
