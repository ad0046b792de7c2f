"""bench_gpu's printed results: the one-line record of each run as it ends, the table (samples/s,
tokens/s, data wait, padding, peak memory, TFLOP/s, MFU / HFU, speed and memory beside s-t and
ms-swift), the issue's targets, and after it what each step kept for backward, its memory by kind,
the largest batches and the profiled steps."""

from __future__ import annotations

import os

from benchmarks.gpu.dry_run import print_first_losses
from benchmarks.gpu.measure import Shape, step_flops
from benchmarks.gpu.specs import (
    GME_LR,
    LORA_RANK,
    PEAK_BF16,
    TARGET_DATA,
    TARGET_MEMORY,
    TARGET_MFU,
    TARGET_SPEED,
    TEXT,
    is_plain_mmembed,
    run_key,
    side_name,
)


def one_line(r: dict) -> str:
    if r["error"]:
        return f"{r['label']} batch {r['batch']} {side_name(r)}: {r['error']}"
    sps = r["steps"] * r["batch"] / r["step_s"] if r["step_s"] else 0.0
    return (f"{r['label']} batch {r['batch']} {side_name(r)}"
            f": {sps:.1f} samples/s, {r['step_s'] / max(r['steps'], 1) * 1000:.0f} ms/step, {r.get('workers')} workers, "
            f"first loss {r.get('first_loss')} ({r['wall_s']:.0f} s in all)")


# ----------------------------------------------------------------------------- the table


def peak_flops(env: dict, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if not env["cuda"]:
        return None
    return next((v for k, v in PEAK_BF16.items() if k in env["device"]), None)


def derived(r: dict, shapes: dict, peak: float | None) -> dict:
    d: dict = {"error": r["error"]}
    if r["error"] or not r["steps"]:
        return d
    st = r["stats"]
    d["sps"] = r["steps"] * r["batch"] / r["step_s"]
    d["tps"] = st["tokens"] / r["step_s"]
    d["ms"] = r["step_s"] / r["steps"] * 1000
    d["data"] = r["wait_s"] / r["step_s"]
    d["pad"] = 1 - st["tokens"] / st["padded"] if st["padded"] else 0.0
    shape = Shape(**shapes[r["model"]])
    flops, recompute = step_flops(shape, st, r["tuner"], r["checkpointing"])
    d["tflops"] = flops / r["step_s"] / 1e12
    if peak:
        d["mfu"] = flops / r["step_s"] / peak
        d["hfu"] = (flops + recompute) / r["step_s"] / peak
    return d


def memory(r: dict) -> tuple[float | None, float | None]:
    return r.get("alloc_mb"), r.get("reserved_mb")


def print_table(res: dict, peak_given: float | None) -> None:
    meta, runs = res["meta"], res["runs"]
    env, s, dry = meta["env"], meta["sizes"], meta["dry"]
    peak = peak_flops(env, peak_given)
    print(f"\nbench_gpu{' --dry_run (CPU, float32, tiny models: proves the code paths; the figures are not the issue targets)' if dry else ''}")
    gpu_mb = f", {env['gpu_mb']:.0f} MiB" if env.get("gpu_mb") else ""
    print(f"device: {env['device']}{gpu_mb}, {env['cpus']} CPU cores; python {env['python']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, sentence-transformers {env['sentence_transformers']}, peft {env['peft']}, "
          f"accelerate {env['accelerate']}, flash-attn {env['flash_attn'] or '-'}, liger-kernel {env['liger_kernel'] or '-'}")
    if env.get("swift"):
        sw = env["swift"]
        print(f"ms-swift side: ms-swift {sw['ms_swift']}, transformers {sw['transformers']}, peft {sw['peft']}, "
              f"torch {sw['torch']}, deepspeed {sw.get('deepspeed') or '-'} ({sw['python']})")
    optims = sorted({r["optim"] for r in runs if r.get("optim")})
    print(f"precision: {meta['precision']} on both sides; optimizer {', '.join(optims) or '-'}; attention "
          f"{meta['attn_impl'] or 'each side default (gme: sdpa)'}; data-loader workers "
          f"{meta['workers'] if meta['workers'] is not None else 'each side default'}"
          f"{'; mmembed text flags: ' + meta['mmembed_args'] if meta.get('mmembed_args') else ''}"
          f"{'; gme flags: ' + meta['gme_args'] if meta.get('gme_args') else ''}")
    kinds = {r["kind"] for r in runs}
    if "text" in kinds:
        print(f"text: STS-B train pairs, max length {TEXT['max_length']}, lr {TEXT['lr']} linear, weight decay "
              f"{TEXT['weight_decay']}, full tuning, no gradient checkpointing, {s['steps']} steps of which {s['warmup']} "
              f"untimed (batch {s['oom_batch']}: {s['oom_steps']} steps); s-t: MultipleNegativesRankingLoss scale "
              f"{TEXT['scale']:g}; mmembed: infonce, temperature {TEXT['temperature']}; all-MiniLM-L6-v2 "
              f"{'real weights' if meta['minilm_real'] else 'random weights from its config'}")
    if "gme" in kinds:
        print(f"gme: LoRA rank {LORA_RANK} on the language model, vision tower + aligner frozen, gradient checkpointing, "
              f"caption -> {s['image_size']}x{s['image_size']} picture + 1 negative picture, lr {GME_LR}, "
              f"{s['gme_steps']} steps of which {s['gme_warmup']} untimed")
    mem_unit = "MiB" if env["cuda"] else "MiB (CPU: peak RSS)"
    head = (f"{'run':<22}{'side':<16}{'batch':>6}{'samples/s':>11}{'tokens/s':>11}{'step ms':>9}{'data %':>8}"
            f"{'pad %':>7}{'max pos':>9}{'alloc':>9}{'reserved':>10}{'TFLOP/s':>9}{'MFU':>7}{'HFU':>7}{'speed':>8}"
            f"{'memory':>8}{'vs swift':>10}{'sw mem':>8}")
    print(f"\n(alloc / reserved: peak GPU memory, {mem_unit}; speed / memory: this side / s-t at the same run and batch; "
          f"vs swift / sw mem: mmembed / ms-swift, speed and memory, at the same run and batch)")
    print(head)
    print("-" * len(head))
    base: dict = {}
    swift: dict = {}
    for r in runs:  # ms-swift's runs come after mmembed's: find them first
        if r["side"] == "swift":
            swift[run_key(r)] = (derived(r, meta["shapes"], peak), r)
    rows = []
    for r in runs:
        d = derived(r, meta["shapes"], peak)
        key = run_key(r)
        side = side_name(r)
        if r["side"] == "st":
            base[key] = (d, r)
        alloc, reserved = memory(r)
        if not env["cuda"]:
            alloc, reserved = r["peak_rss_mb"], None
        speed = mem = "-"
        if r["side"] != "st" and key in base and not d["error"]:
            bd, br = base[key]
            if bd["error"]:
                speed, mem = "s-t OOM", ""
            else:
                speed = f"{d['sps'] / bd['sps']:.2f}x"
                balloc = br.get("alloc_mb") if env["cuda"] else br["peak_rss_mb"]
                mem = f"{alloc / balloc:.2f}x" if alloc and balloc else "-"
        vs = vs_mem = "-"
        if r["side"] == "mmembed" and key in swift and not d["error"]:
            sd, sr = swift[key]
            if sd["error"]:
                vs, vs_mem = ("swift OOM", "") if "out of memory" in sd["error"] else ("swift -", "")
            else:
                vs = f"{d['sps'] / sd['sps']:.2f}x"
                salloc = sr.get("alloc_mb") if env["cuda"] else sr["peak_rss_mb"]
                vs_mem = f"{alloc / salloc:.2f}x" if alloc and salloc else "-"
        rows.append((r, d, side, speed, mem))
        label = r["label"]
        if d["error"]:
            print(f"{label:<22}{side:<16}{r['batch']:>6}  {'OOM' if 'out of memory' in d['error'] else d['error']}"
                  f"{'':>4}(peak alloc {alloc or 0:.0f}, reserved {reserved or 0:.0f})")
            continue

        def f(x, spec):
            return format(x, spec) if x is not None else "-"

        print(f"{label:<22}{side:<16}{r['batch']:>6}{d['sps']:>11.1f}{d['tps']:>11.0f}{d['ms']:>9.1f}"
              f"{d['data'] * 100:>8.1f}{d['pad'] * 100:>7.1f}{f(r.get('max_padded'), ',d'):>9}"
              f"{f(alloc, '.0f'):>9}{f(reserved, '.0f'):>10}"
              f"{d['tflops']:>9.3g}{f(d.get('mfu') and d['mfu'] * 100, '.1f'):>7}"
              f"{f(d.get('hfu') and d['hfu'] * 100, '.1f'):>7}{speed:>8}{mem:>8}{vs:>10}{vs_mem:>8}")
    print("(samples/s, tokens/s (real tokens), step ms, data % (wait for the batch / step), pad % (padding in the collated "
          "batch, before any chunking or packing inside the model) over the timed steps; max pos: positions (rows x "
          "width) of the largest collated batch of the whole run, what the activations' peak grows with; MFU / HFU in % of "
          + (f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "a peak not known here (CPU or unknown GPU)") + ")")
    print("model FLOPs per step (real tokens; padding, recomputation and the non-matmul work not counted): full tuning "
          "6 N T + 3 A; LoRA 4 N T + 6 N_lora T + 3 A (frozen weights: no weight gradients); A = attention forward = "
          "4 W L sum(s^2), halved for causal (Qwen); frozen vision tower, forward only: 2 N_vit P + 4 W_vit L_vit "
          "sum(P_i^2) + 2 N_merger P / 4; HFU adds gradient checkpointing's recomputed forward (2 N T + 2 N_lora T + A)")
    for k, v in meta["shapes"].items():
        extra = (f", N_vit {v['vit_linear']:,} (per patch), N_merger {v['merger_linear']:,}, W_vit {v['vit_width']}, "
                 f"L_vit {v['vit_layers']}" if v["vit_linear"] else "")
        print(f"  {k}: N {v['text_linear']:,}, N_lora (rank {LORA_RANK}) {v['lora']:,}, W {v['text_width']}, "
              f"L {v['text_layers']}, {'causal' if v['causal'] else 'bidirectional'}{extra}")
    print_targets(rows, s, dry)
    print_first_losses(runs)
    print_saved(runs)
    print_memory(runs)


def measured(d: dict) -> bool:
    """A run that gave figures or ran out of memory (both results); not one that crashed or was not run."""
    return not d["error"] or d["error"].startswith("out of memory")


def print_targets(rows: list, s: dict, dry: bool) -> None:
    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    print("\ntargets" + (" (dry run: CPU timings of tiny models, not the issue's conditions)" if dry else "") + ":")
    for r, d, side, speed, mem in rows:
        if r["kind"] != "text" or r["side"] != "mmembed" or r["gradcache"] or r["batch"] == s["oom_batch"]:
            continue
        if not measured(d):
            print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x, memory <= {TARGET_MEMORY}x: "
                  f"not measured ({d['error']})")
            continue
        if d["error"] or speed == "s-t OOM" or speed == "-":
            print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x, memory <= {TARGET_MEMORY}x: "
                  f"NOT met ({d['error'] or 'no s-t figure'})")
            continue
        ok = float(speed[:-1]) >= TARGET_SPEED and (mem == "-" or float(mem[:-1]) <= TARGET_MEMORY)
        print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x s-t at memory <= {TARGET_MEMORY}x: "
              f"{verdict(ok)} ({speed}, {mem})")
    oom = [x for x in rows if x[0]["kind"] == "text" and x[0]["batch"] == s["oom_batch"]]
    unmeasured = [f"{side}: {d['error']}" for r, d, side, *_ in oom if not measured(d)]
    if oom and unmeasured:
        print(f"  batch {s['oom_batch']}: s-t out of memory, mmembed trains: not measured ({'; '.join(unmeasured)})")
    elif oom:
        st_oom = any(r["side"] == "st" and d["error"] for r, d, *_ in oom)
        trains = [side for r, d, side, *_ in oom if r["side"] == "mmembed" and not d["error"]]
        if not st_oom:
            print(f"  batch {s['oom_batch']} where s-t runs out of memory: not shown (s-t fits at batch "
                  f"{s['oom_batch']} here; raise --oom_batch); mmembed trains: {', '.join(trains) or 'none'}")
        else:
            print(f"  batch {s['oom_batch']}: s-t out of memory, mmembed trains: {verdict(bool(trains))} "
                  f"({', '.join(trains) or 'every mmembed variant ran out of memory too'})")
    gme = [x for x in rows if x[0]["kind"] == "gme" and x[0]["model"] == "gme" and x[0]["side"] == "mmembed"]
    if gme:
        first = min(gme, key=lambda x: x[0]["batch"])
        mfu = first[1].get("mfu")
        print(f"  GME batch {first[0]['batch']}: MFU >= {TARGET_MFU:.0%}: "
              f"{verdict(None if mfu is None else mfu >= TARGET_MFU)}"
              f"{f' ({mfu:.1%})' if mfu is not None else ' (no peak FLOP/s on this device)'}")
        big = [x for x in gme if x is not first and measured(x[1])]
        if big:
            fits = [not d["error"] for r, d, *_ in big]
            print(f"  GME batches {', '.join(str(r['batch']) for r, *_ in big)} fit: {verdict(all(fits))}")
        for r, d, *_ in gme:
            if not measured(d):
                print(f"  GME batch {r['batch']}: not measured ({d['error']})")
    data = [(r, d) for r, d, *_ in rows if r["side"] == "mmembed" and not d["error"]]
    if data:
        worst = max(data, key=lambda x: x[1]["data"])
        print(f"  data wait < {TARGET_DATA:.0%} of a step in every mmembed run: "
              f"{verdict(all(d['data'] < TARGET_DATA for _, d in data))} (largest: {worst[1]['data']:.1%}, "
              f"{worst[0]['label']} batch {worst[0]['batch']})")


# ----------------------------------------------------------------------------- dry-run config checks


def print_saved(runs: list) -> None:
    """Each run's activations at its first step (:func:`saved_for_backward`), beside the same run
    and batch of s-t, ms-swift and mmembed's plain (padded) run."""
    measured = [r for r in runs if r.get("saved")]
    if not measured:
        return
    print("\nkept for backward at the first step (activations; parameters left out), MiB:")
    for r in measured:
        others = {side_name(o): o["saved"]["activations_mb"] for o in measured
                  if run_key(o) == run_key(r) and o is not r and (o["side"] != "mmembed" or is_plain_mmembed(o))}
        s = r["saved"]
        ratios = ", ".join(f"{s['activations_mb'] / v:.2f}x {name}" for name, v in others.items() if v)
        print(f"  {r['label']} batch {r['batch']} {side_name(r)}: {s['activations_mb']:.1f} at most, {s['tensors']} storages saved "
              f"(parameters {s['params_mb']:.0f}, trainable {s['trainable_mb']:.1f})" + (f"; {ratios}" if ratios else ""))


def print_memory(runs: list) -> None:
    """--profile_memory: each run's profiled step at its memory peak, by kind, beside the other sides."""
    from benchmarks.memory_step import render

    lines = render(runs, run_key, side_name)
    if lines:
        print("\nmemory at the profiled step's peak, MiB, by kind (tensors' bytes; --profile_memory):")
        print("\n".join(lines))


def print_largest(res: dict) -> None:
    """--largest_batch: each side's largest batch under the memory cap."""
    found = res.get("largest") or []
    if not found:
        return
    meta = res["meta"]
    cap = meta.get("memory_cap_gb")
    where = ("on the CPU (no device memory to run out of: the search stops at --largest_limit)" if not meta["env"]["cuda"]
             else f"with the GPU capped at {cap:g} GiB" if cap else "on the whole GPU")
    print(f"\nlargest batch that trains (two steps), {where}:")
    for f in found:
        largest = f["largest"] if f["largest"] is not None else "none"
        until = (f" (the limit, {f['largest']}, fits)" if f["limit_reached"] else
                 f" (out of memory at {f['oom']})" if f["oom"] is not None else " (the search stopped: see the probes)")
        tried = ", ".join(f"{b} {'fits' if o else 'OOM' if o is False else 'failed'}" for b, o in f["probes"])
        print(f"  {f['label']} {side_name(dict(side=f['side'], gradcache=0))}: {largest}{until}; tried {tried}")


def print_profiles(res: dict, save_to: str | None = None) -> None:
    """``--profile``: each profiled step's time by region and its top kernels (profile_step.py);
    with ``--save X.json`` the same as markdown in ``X.profile.md`` (for docs/benchmarks.md)."""
    from benchmarks.profile_step import render_markdown, render_text

    profiled = [r for r in res["runs"] if r.get("profile")]
    if not profiled:
        return
    print()
    md = []
    for r in profiled:
        title = f"{r['label']} batch {r['batch']} {side_name(r)}"
        print(render_text(r["profile"], title))
        if r.get("steps"):
            print(f"  (the run's timed steps, without the profiler: {r['step_s'] / r['steps'] * 1000:.1f} ms each)")
        print()
        md.append(render_markdown(r["profile"], title))
    if save_to:
        path = os.path.splitext(save_to)[0] + ".profile.md"
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(md) + "\n")
        print(f"(the profiles as markdown: {path})")
