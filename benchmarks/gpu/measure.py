"""bench_gpu's measures of one run: the model FLOPs of a step from a model's config and a batch's
real lengths (Shape, model_shape, step_flops: the formula in bench_gpu.py's docstring), what a
collated batch holds (batch_stats, batch_digest: the same-work check's first batch), what a step
keeps for backward (saved_for_backward) and whether it draws dropout masks. The step's time by
region and its memory by kind are benchmarks/profile_step.py's and benchmarks/memory_step.py's.
Nothing here imports mmembed: the ms-swift side's child (another python) measures with it too."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

from benchmarks.gpu.specs import LORA_RANK


@dataclass
class Shape:
    """The matmul sizes the FLOPs formula needs (module docstring), from a model's config."""

    text_linear: int  # N
    lora: int  # N_lora at LORA_RANK over the same linears
    text_width: int  # W: heads x head_dim
    text_layers: int
    causal: bool
    vit_linear: int = 0  # per patch: blocks + patch embedding
    merger_linear: int = 0  # per merged token
    vit_width: int = 0
    vit_layers: int = 0
    merge: int = 1  # patches per merged token


def model_shape(model_dir: str) -> Shape:
    """Count the linear weights of a saved model's config on the meta device (no memory)."""
    import torch
    import transformers
    from torch import nn
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = (getattr(config, "architectures", None) or [None])[0]
    with torch.device("meta"):
        if arch and hasattr(transformers, arch):
            model = getattr(transformers, arch)(config)
        else:
            model = transformers.AutoModel.from_config(config)
    text = lora = vit = merger = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Conv2d, nn.Conv3d)):
            continue
        parts = name.split(".")
        if "lm_head" in parts or "pooler" in parts:
            continue
        if "visual" in parts:
            if "merger" in parts or "deepstack_merger_list" in parts:  # Qwen3-VL's deepstack mergers too
                merger += mod.weight.numel()
            else:
                vit += mod.weight.numel()
        elif isinstance(mod, nn.Linear):
            text += mod.weight.numel()
            lora += LORA_RANK * (mod.in_features + mod.out_features)
    tc = config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    shape = Shape(text_linear=text, lora=lora, text_width=tc.num_attention_heads * head_dim,
                  text_layers=tc.num_hidden_layers, causal=tc.model_type.startswith("qwen"),
                  vit_linear=vit, merger_linear=merger)
    vc = getattr(config, "vision_config", None)
    if vc is not None and vit:
        shape.vit_width = getattr(vc, "embed_dim", None) or vc.hidden_size
        shape.vit_layers = vc.depth
        shape.merge = vc.spatial_merge_size ** 2
    return shape


def step_flops(shape: Shape, stats: dict, tuner: str, checkpointing: bool) -> tuple[float, float]:
    """(model FLOPs, FLOPs recomputed by gradient checkpointing) of the timed steps together;
    ``stats`` sums the batches' tokens (T), squared row lengths (S2), patches and squared
    patches per picture."""
    n, t = shape.text_linear, stats["tokens"]
    attention = 4 * shape.text_width * shape.text_layers * stats["sq"] * (0.5 if shape.causal else 1.0)
    if tuner == "full":
        text = 6 * n * t + 3 * attention
        recompute = 2 * n * t + attention
    else:
        text = 4 * n * t + 6 * shape.lora * t + 3 * attention
        recompute = 2 * n * t + 2 * shape.lora * t + attention
    p = stats["patches"]
    vision = (2 * shape.vit_linear * p + 4 * shape.vit_width * shape.vit_layers * stats["patches_sq"]
              + 2 * shape.merger_linear * p / shape.merge)
    return text + vision, (recompute if checkpointing else 0.0)


# ----------------------------------------------------------------------------- one run (child process)


def batch_stats(batch) -> dict:
    """Rows, real and padded tokens, sum of squared row lengths, pictures and their patches of
    one collated batch (either side's layout: mmembed's flat ``attention_mask``, s-t's
    ``anchor_attention_mask`` ...; packed batches through ``cu_seq_lens_q`` / ``position_ids``)."""
    import torch

    s = dict(rows=0, tokens=0, padded=0, sq=0, images=0, patches=0, patches_sq=0)
    found = []

    def walk(obj, key=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, str(k))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key)
        elif isinstance(obj, torch.Tensor):
            found.append((key, obj))

    walk(batch)
    masks = [t for k, t in found if k.endswith("attention_mask") and t.dim() == 2]
    if masks:
        for m in masks:
            lengths = m.sum(dim=1).tolist()
            s["rows"] += len(lengths)
            s["tokens"] += int(sum(lengths))
            s["sq"] += int(sum(x * x for x in lengths))
            s["padded"] += m.numel()
    else:
        cu = [t for k, t in found if k in ("cu_seq_lens_q", "cu_seqlens")]
        pos = [t for k, t in found if k == "position_ids"]
        if cu:
            lengths = (cu[0][1:] - cu[0][:-1]).tolist()
        elif pos:  # packed rows restart their positions at 0
            p = pos[0].reshape(-1, pos[0].shape[-1])[0]
            starts = (p == 0).nonzero().flatten().tolist() + [p.numel()]
            lengths = [b - a for a, b in zip(starts, starts[1:])]
        else:
            lengths = [t.numel() for k, t in found if k.endswith("input_ids")]
        s["rows"] += len(lengths)
        s["tokens"] += int(sum(lengths))
        s["sq"] += int(sum(x * x for x in lengths))
        s["padded"] += int(sum(lengths))
    for k, t in found:
        if k.endswith("grid_thw"):  # Qwen-VL: (t, h, w) patches per picture / clip
            per = t.prod(dim=-1).tolist()
            s["images"] += len(per)
            s["patches"] += int(sum(per))
            s["patches_sq"] += int(sum(x * x for x in per))
    return s


def batch_digest(batch) -> dict:
    """What the first batch holds, side-independent: its rows' real token ids (each side pads and
    orders rows its own way: rows sorted, padding dropped), digested, and the pictures' patch grids."""
    import hashlib

    import torch

    rows, grids = [], []
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and k.endswith("input_ids") and v.dim() == 2:
                mask = batch.get(k[:-len("input_ids")] + "attention_mask")
                for i in range(v.shape[0]):
                    ids = v[i][mask[i].bool()] if isinstance(mask, torch.Tensor) else v[i]
                    rows.append(tuple(ids.tolist()))
            elif isinstance(v, torch.Tensor) and k.endswith("grid_thw"):
                grids += [tuple(x) for x in v.tolist()]
    rows.sort()
    return {"rows": len(rows), "tokens": sum(map(len, rows)), "images": len(grids),
            "digest": hashlib.sha1(repr((rows, sorted(grids))).encode()).hexdigest()[:12]}


@contextlib.contextmanager
def saved_for_backward(model):
    """What one step keeps for its backward pass, measured on any device: the most bytes that
    tensors saved by autograd (torch.autograd.graph.saved_tensors_hooks) held at once during the
    step, a storage counted once however many of its views are saved, the model's parameters
    left out; and the parameters, trainable and all, in MiB. Tensors saved inside gradient
    checkpointing's regions go to its own hooks (it keeps only the region's inputs), so what is
    counted is what is held. The activations' share of the peak, the same on a CPU and a GPU for
    the same batch: ``dict`` filled when the step ends."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, list[int]] = {}  # storage address -> [saved tensors alive on it, its bytes]
    held = {"now": 0, "peak": 0, "storages": 0}
    refs: list[weakref.ref] = []

    def released(ptr: int) -> None:
        entry = live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            held["now"] -= entry[1]
            del live[ptr]

    def pack(t):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, meta)
            return t
        ptr = storage.data_ptr()
        if ptr in params:
            return t
        entry = live.get(ptr)
        if entry is None:
            entry = live[ptr] = [0, storage.nbytes()]
            held["now"] += entry[1]
            held["storages"] += 1
            held["peak"] = max(held["peak"], held["now"])
        entry[0] += 1
        refs.append(weakref.ref(t, lambda _, ptr=ptr: released(ptr)))
        return t

    out: dict = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    mib = 2 ** 20
    out.update(activations_mb=held["peak"] / mib, tensors=held["storages"],
               params_mb=sum(p.numel() * p.element_size() for p in model.parameters()) / mib,
               trainable_mb=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / mib)


def draws_dropout(model) -> bool:
    """Whether a training step of ``model`` draws dropout masks that change its first loss (two
    sides' first losses on the same batch then differ by chance): a dropout module with p > 0,
    LoRA's own left out (its adapters start at zero: the first step's output does not see them)."""
    import torch

    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and "lora_dropout" not in name
               for name, m in model.named_modules())
