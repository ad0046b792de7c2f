"""``--gradient_checkpointing`` checkpoints the media tower too (ms-swift once shipped a release
whose vision tower silently stopped checkpointing): for every shipped template with a vision or
audio tower, one training step on its own example rows (examples/data/mm), built as ``mmembed
sft`` builds it from the flags, with checkpointing switched on the way the Trainer switches it on.

What "checkpointed" means here, measured rather than read off a flag: during ``loss.backward()``
the first block of the tower runs its forward again (and so does the language model's first
block, for comparison); without checkpointing neither does. The loss and every trainable
parameter's gradient (LoRA adapters, or in full training the tower's own weights) are the same
with and without. A frozen tower (``--freeze_vit``, ``--freeze_aligner``) needs no gradient, so
it is not recomputed at all (tests/encoding/test_multimodal.py checks it stays out of autograd).

The recomputation is counted with a forward pre-hook on the block's first child module, not a
hook on the block: transformers' ``GradientCheckpointingLayer`` checkpoints the block's
``forward`` (its own module hooks stay outside and run once), and torch stops the recomputation
as soon as the last saved tensor is rebuilt, so a hook at the end of the block may never see it.
"""

import dataclasses
import os

import pytest
import torch
from conftest import DATA

MM = os.path.join(DATA, "mm")


@dataclasses.dataclass(frozen=True)
class Tower:
    template: str
    kind: str  # tiny model (examples/tiny_models.py)
    rows: str  # file under examples/data/mm
    block: str  # the tower's first block, as a module-name suffix
    task: str = "embedding"


TOWERS = [
    Tower("qwen2_gme", "qwen2_vl", "gme_train.jsonl", "visual.blocks.0"),
    Tower("qwen2_5_vl", "qwen2_5_vl", "gme_train.jsonl", "visual.blocks.0"),
    Tower("qwen3_vl_emb", "qwen3_vl", "qwen3_vl_train.jsonl", "visual.blocks.0"),
    Tower("qwen2_audio", "qwen2_audio", "audio_train.jsonl", "audio_tower.layers.0"),
    Tower("qwen3_vl_reranker", "qwen3_vl", "qwen3_vl_train.jsonl", "visual.blocks.0", "generative_reranker"),
]
LANGUAGE_BLOCK = "language_model.layers.0"

# training -> the flags that make it (ms-swift's); the tower trains in the first two
TRAINING = {
    "lora": ["--tuner_type", "lora", "--freeze_vit", "false", "--freeze_aligner", "false"],
    "full": ["--tuner_type", "full", "--freeze_vit", "false", "--freeze_aligner", "false"],
    "lora_frozen_tower": ["--tuner_type", "lora", "--freeze_vit", "true", "--freeze_aligner", "true"],
}


def build_step(tower: Tower, folder: str, training: str, out: str):
    """The parsed flags, the model (as ``mmembed sft`` assembles it from them), and ``step() ->
    loss`` (forward and loss, no backward) on a batch of two rows of the template's example file."""
    from mmembed.data import read_file
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import Encoding, build_model, make_loss

    rows = os.path.join(MM, tower.rows)
    # random LoRA weights (--init_weights false): every adapter, A and B, gets a gradient
    args = parse_sft_args(["--model", folder, "--task_type", tower.task, "--template", tower.template,
                           "--dataset", rows, "--output_dir", out, "--lora_rank", "4", "--init_weights", "false",
                           *TRAINING[training]])
    samples = read_file(rows)[1:3]  # two rows: images (or audio) and texts, 3-4 inputs in all
    encoding = Encoding.resolve(args)
    torch.manual_seed(0)
    if tower.task == "embedding":
        from mmembed.encoding.collator import EmbeddingCollator
        from mmembed.encoding.layout import Layout

        batch = EmbeddingCollator(encoding.template, encoding.processing, Layout.GROUP)(samples)
        labels = batch.pop("labels")
        model, loss = build_model(args, encoding.template, encoding.pooling), make_loss(args)
        return args, model.train(), lambda: loss(model(**batch), labels)
    from mmembed.tasks.reranker.inputs import RerankCollator
    from mmembed.tasks.reranker.losses import build_rerank_loss
    from mmembed.tasks.reranker.trainer import build_reranker, model_inputs

    batch = RerankCollator(encoding.template, encoding.processing, max_positive=1, max_negative=1)(samples)
    model, loss = build_reranker(args, encoding), build_rerank_loss(args.loss_type)
    return args, model.train(), lambda: loss(model(**model_inputs(batch))["scores"], batch["labels"])


class BlockRuns:
    """Which pass each run of the blocks named ``...suffix`` came in: ``runs[suffix]`` gets
    ``phase`` (``forward``, then ``backward`` once the test says so) each time such a block starts
    its work (its first child module's forward)."""

    def __init__(self, model: torch.nn.Module, **suffixes: str):
        self.phase = "forward"
        self.runs: dict[str, list[str]] = {}
        self.handles = []
        for label, suffix in suffixes.items():
            (block,) = [m for name, m in model.named_modules() if name.endswith(suffix)]
            self.runs[label] = []
            self.handles.append(next(block.children()).register_forward_pre_hook(
                lambda *_, label=label: self.runs[label].append(self.phase)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def one_step(model: torch.nn.Module, step, tower: Tower) -> tuple[float, dict[str, torch.Tensor], dict[str, list[str]]]:
    """The loss, every trainable parameter's gradient, and the passes the tower's and the
    language model's first blocks ran in, of one forward and backward. The same seed each time:
    LoRA's dropout draws the same masks (and the recomputation replays them, as torch's
    checkpoint restores the random state)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    blocks = BlockRuns(model, tower=tower.block, language_model=LANGUAGE_BLOCK)
    loss = step()
    blocks.phase = "backward"
    loss.backward()
    blocks.remove()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, blocks.runs


def enable_checkpointing(model: torch.nn.Module, args) -> None:
    """As transformers' Trainer does at the start of ``train()`` with ``--gradient_checkpointing``
    (mmembed's default: ``use_reentrant`` false)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=args.activation_checkpointing_kwargs,
                                          every_n_layers=1, offload=False)
    assert model.is_activation_checkpointing


@pytest.mark.parametrize("training", list(TRAINING))
@pytest.mark.parametrize("tower", TOWERS, ids=[t.template for t in TOWERS])
def test_checkpointing_recomputes_the_tower_in_backward_with_the_same_gradients(tiny_model, tmp_path, tower, training):
    """A training tower's first block runs again in backward, as the language model's does;
    a frozen one does not run again. Loss and gradients equal those without checkpointing."""
    args, model, step = build_step(tower, tiny_model(tower.kind), training, str(tmp_path))
    plain_loss, plain, plain_runs = one_step(model, step, tower)
    enable_checkpointing(model, args)
    loss, checkpointed, runs = one_step(model, step, tower)

    tower_trains = training != "lora_frozen_tower"
    assert plain_runs == {"tower": ["forward"], "language_model": ["forward"]}
    assert runs["language_model"] == ["forward", "backward"]
    assert runs["tower"] == (["forward", "backward"] if tower_trains else ["forward"])
    assert all(("lora_" in n) == (training != "full") for n in plain)  # the adapters, or all of the model
    assert any(".visual." in n or ".audio_tower." in n for n in plain) == tower_trains
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert checkpointed.keys() == plain.keys()
    for name in plain:
        scale = plain[name].abs().max().item()
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-6, atol=1e-7 * scale, msg=name)


def test_a_tower_left_out_of_checkpointing_is_seen(tiny_model, tmp_path):
    """The measure tells the regression apart: with the tower's blocks switched off after
    checkpointing is enabled (what ms-swift's regression did), the tower runs once, in forward
    only, while the language model still runs again in backward."""
    tower = TOWERS[0]
    args, model, step = build_step(tower, tiny_model(tower.kind), "lora", str(tmp_path))
    enable_checkpointing(model, args)
    for name, module in model.named_modules():
        if ".visual.blocks." in name and hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = False
    _, _, runs = one_step(model, step, tower)
    assert runs == {"tower": ["forward"], "language_model": ["forward", "backward"]}
