"""Which attention kernel and padding side give a NaN gradient on a GPU: a Qwen3-0.6B-sized
Qwen3Model (random weights, bfloat16) trained a few steps on short rows of varied lengths with
last-token pooling and InfoNCE, as ``bench_gpu.py``'s qwen3 text run does, but with
transformers alone (no mmembed), under each SDPA backend and each padding side.

    python benchmarks/sdpa_padding_check.py            # on a GPU
    python benchmarks/sdpa_padding_check.py --tiny     # the same code on the CPU, a 2-layer model

Prints one line per (padding side, backend): the loss and gradient norm per step, or where the
first non-finite value appeared (forward or backward).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen3Config, Qwen3Model

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def batch(n: int, vocab: int, side: str, device: str, gen: torch.Generator,
          bucket: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of 6..60 tokens (STS-B-like), padded to the longest on ``side`` (with
    ``bucket``, to mmembed's bucketed width of it, as ``--length_buckets`` does)."""
    lengths = torch.randint(6, 61, (n,), generator=gen).tolist()
    width = max(lengths)
    if bucket:
        from mmembed.encoding.buckets import bucket_width

        width = bucket_width(width)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, k in enumerate(lengths):
        row = torch.randint(100, vocab, (k,), generator=gen)
        sl = slice(width - k, width) if side == "left" else slice(0, k)
        ids[i, sl] = row
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * positions).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def attn(mask: torch.Tensor, a: argparse.Namespace) -> torch.Tensor:
    """The 2-D padding mask, or with ``--self_key`` a 4-D boolean causal mask in which every
    query may also attend to its own position (a left-padded row's pad queries get one key)."""
    if not a.self_key:
        return mask
    n = mask.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    allowed = causal[None] & mask.bool()[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool, device=mask.device)[None]
    return allowed[:, None]


def run(side: str, backend: str | None, a: argparse.Namespace) -> str:
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and not a.autocast else torch.float32
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=a.vocab, tie_word_embeddings=True, attention_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         **(TINY if a.tiny else QWEN3_06B))
    config._attn_implementation = a.attn
    with torch.device(device):
        model = Qwen3Model(config).to(dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    backends = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH],
                "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION]}
    out = []
    for step in range(a.steps):
        q_ids, q_mask = batch(a.batch, a.vocab, side, device, gen, a.bucket)
        d_ids, d_mask = batch(a.batch, a.vocab, side, device, gen, a.bucket)
        ctx = sdpa_kernel(backends[backend]) if backend else torch.autocast(device, enabled=False)
        amp = torch.autocast(device, dtype=torch.bfloat16, enabled=a.autocast)
        try:
            with ctx, amp:
                q = F.normalize(last_token(model(input_ids=q_ids, attention_mask=attn(q_mask, a)).last_hidden_state,
                                           q_mask).float(), dim=-1)
                d = F.normalize(last_token(model(input_ids=d_ids, attention_mask=attn(d_mask, a)).last_hidden_state,
                                           d_mask).float(), dim=-1)
                loss = F.cross_entropy(q @ d.T / 0.05, torch.arange(a.batch, device=device))
                if not torch.isfinite(loss):
                    return " ".join(out + [f"step {step + 1}: loss {loss.item()} (forward)"])
                loss.backward()
        except RuntimeError as e:
            return " ".join(out + [f"step {step + 1}: {str(e).splitlines()[0][:90]}"])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            return " ".join(out + [f"step {step + 1}: loss {loss.item():.3f} grad norm {norm.item()} (backward; "
                                   f"{len(bad)} tensors, first {bad[:2]})"])
        out.append(f"{loss.item():.3f}/{norm.item():.2f}")
        opt.step()
        opt.zero_grad(set_to_none=True)
    return "finite: " + " ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--autocast", action="store_true", help="float32 weights under bfloat16 autocast (a full "
                   "fine-tune's setting in mmembed and sentence-transformers), not bfloat16 weights")
    p.add_argument("--bucket", action="store_true", help="widths bucketed as mmembed's --length_buckets")
    p.add_argument("--self_key", action="store_true", help="a 4-D mask giving every query its own key")
    p.add_argument("--attn", default="sdpa", help="transformers' attn_implementation")
    p.add_argument("--backends", default="default,efficient,math,cudnn", help="SDPA backends to force")
    a = p.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() and not a.tiny else 'cpu'}, attn {a.attn}, "
          f"{'float32 weights, bf16 autocast' if a.autocast else 'bf16 weights'}{', self key' if a.self_key else ''}"
          f"{', bucketed widths' if a.bucket else ''}")
    for side in ("left", "right"):
        for backend in a.backends.split(","):
            print(f"{side:5} {backend:9} {run(side, None if backend == 'default' else backend, a)}", flush=True)


if __name__ == "__main__":
    main()
