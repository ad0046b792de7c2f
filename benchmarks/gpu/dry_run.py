"""bench_gpu's checks that the sides do the same work, and ``--dry_run``'s checks of the full-size
models: each side's first batch (the same rows' real token ids) and first loss beside mmembed's
(compare_first_losses, printed after the table), the dry run failing where they differ
(check_same_work), and the Qwen3-0.6B- and Qwen2-VL-2B-sized configs checked on the meta device
(meta_checks)."""

from __future__ import annotations

import tempfile

from benchmarks.checkout import tiny_models
from benchmarks.gpu.measure import model_shape, step_flops
from benchmarks.gpu.specs import (
    FIRST_LOSS_TOL,
    QWEN3_06B,
    QWEN3_06B_PARAMS,
    first_loss_tol,
    is_plain_mmembed,
    run_key,
    side_name,
)


def first_loss_pairs(runs: list) -> list:
    """(mmembed's run, the other side's run) at the same model, batch and part, for every other side."""
    mm = {run_key(r): r for r in runs if is_plain_mmembed(r)}
    return [(mm[run_key(r)], r) for r in runs if r["side"] != "mmembed" and run_key(r) in mm]


def compare_first_losses(m: dict, o: dict) -> tuple[str, str]:
    """mmembed's run ``m`` against another side's ``o`` of the same work: ``("missing" | "other batch"
    | "agree" | "dropout" | "differ", the verdict in words)``. The same batch is the same digest of
    the rows' real token ids; the losses agree to first_loss_tol, and are not compared where a side
    draws dropout masks."""
    if m.get("first_loss") is None or o.get("first_loss") is None:
        return "missing", "not measured"
    mb, ob = m.get("first_batch") or {}, o.get("first_batch") or {}
    if mb.get("digest") is None or mb.get("digest") != ob.get("digest"):
        return "other batch", "different first batches"
    diff, tol = abs(m["first_loss"] - o["first_loss"]), first_loss_tol(o["side"])
    if diff <= tol:
        return "agree", f"same batch, agree (|diff| {diff:.1e} <= {tol:g})"
    if m.get("dropout") or o.get("dropout"):
        return "dropout", f"same batch, |diff| {diff:.1e}: dropout masks, not compared"
    return "differ", f"same batch, DIFFER (|diff| {diff:.1e})"


def print_first_losses(runs: list) -> None:
    """Same work: each side's first loss and first batch (its rows' real token ids, digested) beside
    mmembed's, and compare_first_losses' verdict. Every side draws its batches in ms-swift's order
    (s-t through SwiftOrderTrainer), so the first batches are the same rows."""
    pairs = first_loss_pairs(runs)
    if not pairs:
        return
    print("\nfirst loss on the first batch (same batch: the same rows' real token ids, whatever the padding and order):")
    for m, o in pairs:
        kind, verdict = compare_first_losses(m, o)
        if kind == "missing":
            print(f"  {m['label']} batch {m['batch']}: mmembed {m.get('first_loss')}, {side_name(o)} {o.get('first_loss')}"
                  f" (not measured)")
            continue
        mb, ob = m.get("first_batch") or {}, o.get("first_batch") or {}
        print(f"  {m['label']} batch {m['batch']}: mmembed {m['first_loss']:.6f} [{mb.get('rows')} rows, "
              f"{mb.get('tokens')} tokens, {mb.get('images')} pictures, {mb.get('digest')}]; {side_name(o)} "
              f"{o['first_loss']:.6f} [{ob.get('rows')} rows, {ob.get('tokens')} tokens, {ob.get('images')} pictures, "
              f"{ob.get('digest')}]: {verdict}")


def check_same_work(runs: list) -> None:
    """--dry_run: mmembed's, s-t's and ms-swift's first batches must be the same rows and their first
    losses agree (compare_first_losses: to first_loss_tol, float32 on the CPU; not where a side draws
    dropout masks): the benchmark compares the same work."""
    problems = []
    for m, o in first_loss_pairs(runs):
        if o["side"] not in ("swift", "st") or o.get("error") or m.get("error"):
            continue
        kind, verdict = compare_first_losses(m, o)
        if kind not in ("agree", "dropout"):
            problems.append(f"{m['label']} batch {m['batch']}: {side_name(o)}: {verdict} (first losses mmembed "
                            f"{m.get('first_loss')}, {side_name(o)} {o.get('first_loss')}; first batches "
                            f"{m.get('first_batch')} vs {o.get('first_batch')})")
    plain = {run_key(r): r for r in runs if is_plain_mmembed(r) and not r.get("error")}
    for r in runs:  # packed batches: the same batch and, to float rounding, the same loss as padded ones
        m = plain.get(run_key(r))
        if r["side"] != "mmembed" or not r.get("variant", "").startswith("packed") or m is None:
            continue
        if r.get("error"):
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: {r['error']}")
        elif (r.get("first_batch") or {}).get("digest") != (m.get("first_batch") or {}).get("digest"):
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: another first batch than mmembed's")
        elif abs(r["first_loss"] - m["first_loss"]) > FIRST_LOSS_TOL:
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: first loss {r['first_loss']} vs "
                            f"mmembed's padded {m['first_loss']}")
        else:
            print(f"  {r['label']} batch {r['batch']} {r['variant']}: the same first batch as padded, first loss "
                  f"{r['first_loss']:.6f} vs {m['first_loss']:.6f}: agree (|diff| "
                  f"{abs(r['first_loss'] - m['first_loss']):.1e} <= {FIRST_LOSS_TOL:g})")
    if problems:
        raise SystemExit("mmembed and s-t or ms-swift (or mmembed's packed and padded batches) do not do the same "
                         "work:\n  "
                         + "\n  ".join(problems))


def meta_checks() -> None:
    """The full-size models the GPU run builds, checked on the meta device (no memory)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from benchmarks.bench_multimodal import QWEN2_VL_2B_PARAMS, count_params_meta, qwen2_vl_2b_config

    tiny = tiny_models()
    ids, vocab = tiny.TOKENIZER_SPECS["qwen3"].added_ids(), tiny.VOCAB_SIZE
    with torch.device("meta"):
        q = Qwen3Model(Qwen3Config(vocab_size=vocab, eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **QWEN3_06B))
    n_q = sum(p.numel() for p in q.parameters())
    n_vl = count_params_meta()
    print(f"meta device: Qwen3-0.6B-sized {n_q:,} parameters (Qwen3-0.6B: {QWEN3_06B_PARAMS:,}); "
          f"Qwen2-VL-2B-sized {n_vl:,} (Qwen2-VL-2B: {QWEN2_VL_2B_PARAMS:,})")
    if n_q != QWEN3_06B_PARAMS or n_vl != QWEN2_VL_2B_PARAMS:
        raise SystemExit("a full-size config does not match its model")
    with tempfile.TemporaryDirectory() as d:
        Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, architectures=["Qwen3Model"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **QWEN3_06B).save_pretrained(d)
        qs = model_shape(d)
        cfg = qwen2_vl_2b_config()
        cfg.architectures = ["Qwen2VLForConditionalGeneration"]
        cfg.save_pretrained(d)
        vs = model_shape(d)
    # one GME sample: a caption (~20 tokens) and two 448x448 pictures (1024 patches, 256 tokens, ~15 more tokens)
    caption, picture = 20, 256 + 15
    sample = dict(tokens=caption + 2 * picture, sq=caption ** 2 + 2 * picture ** 2, patches=2 * 1024,
                  patches_sq=2 * 1024 ** 2)
    vl, vl_re = step_flops(vs, sample, "lora", True)
    q_tok = dict(tokens=1, sq=0, patches=0, patches_sq=0)
    print(f"model FLOPs: Qwen3-0.6B-sized full tuning {step_flops(qs, q_tok, 'full', False)[0] / 1e9:.2f} GFLOP per "
          f"token before attention (N {qs.text_linear:,}); Qwen2-VL-2B-sized LoRA {vl / 1e12:.2f} TFLOP per sample "
          f"(+{vl_re / 1e12:.2f} recomputed) of {sample['tokens']} tokens and 2 pictures (N {vs.text_linear:,}, "
          f"N_vit {vs.vit_linear:,}, N_merger {vs.merger_linear:,}): at 989 TFLOP/s, 25% MFU is "
          f"{0.25 * 989e12 / vl:.0f} samples/s")


# ----------------------------------------------------------------------------- main
