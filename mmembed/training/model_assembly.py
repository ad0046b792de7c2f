"""Model assembly for ``mmembed sft``: the student's encoding (template, tokenizer or
processor, pooling, length), the student model (backbone, liger-kernel, LoRA or frozen
parts, padding-free batches, per-part learning rates), the loss, and the frozen side models
the loss takes (guide, teacher).

Each piece is built from :class:`~mmembed.training.arguments.SftArguments`;
:func:`mmembed.training.sft.build_trainer` puts them together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from torch import nn

from ..data.dataset_config import ConfigError, DatasetEntry
from ..data.teacher import SIGNALS
from ..encoding.inputs import InputBuilder
from ..encoding.templates import Template, get_template
from ..errors import one_line
from ..losses import EmbeddingLoss, Setup, build_loss
from ..losses.config import infonce_values
from ..model.embedding import (
    EmbeddingModel,
    default_max_length,
    frozen_parts,
    hidden_size,
    load_backbone,
    model_config,
)
from ..model.packing import PACKABLE_MODEL_TYPES, VARLEN_ATTENTION
from ..task import get_task
from .arguments import SftArguments, UsageError
from .quant_flags import quantization

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from ..encoding.media import MediaSettings

logger = logging.getLogger("mmembed")


# ----------------------------------------------------------------------------- encoding


def read_model_config(model_dir: str):
    """The model's transformers config; one that cannot be read is a usage error naming --model."""
    try:
        return model_config(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {model_dir}: its config.json cannot be read as a transformers model "
                         f"({one_line(e)})") from None


def resolve_template(model_dir: str, name: str | None, model_type: str | None, system: str | None,
                     config=None, task: str | None = None) -> Template:
    """The template of ``--template`` / ``--model_type`` or, by default, of the model's
    ``model_type`` (``config``: the model's config, read from ``model_dir`` when not given),
    among the templates of ``task`` (``--task_type``; None: embedding), with ``--system`` as
    its default system prompt."""
    if config is None:
        config = read_model_config(model_dir)
    try:
        template = get_template(name, model_type, getattr(config, "model_type", None), task=get_task(task).template_task,
                                architectures=getattr(config, "architectures", None) or ())
        template = template.for_model(model_dir)  # e.g. UEmbed's sparse_info.json
        template.check_installed()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if system is not None:
        template = dataclasses.replace(template, default_system=system)
    return template


def load_processing(path: str, template: Template):
    """The tokenizer, or for a template that takes media the model's processor (which holds
    the tokenizer and the image/video processors or audio feature extractor)."""
    from transformers import AutoProcessor, AutoTokenizer

    if template.media:
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, config=model_config(path))  # config.json as read once


@dataclasses.dataclass
class Encoding:
    """How rows become the student's inputs: template, tokenizer or processor, pooling, length."""

    template: Template
    processing: Any
    pooling: str
    max_length: int

    @classmethod
    def resolve(cls, args: SftArguments, template: Template | None = None) -> Encoding:
        """``template``: the model's template as :func:`resolve_template` gives it (resolved
        from the flags when not given); the side flags are applied to it here."""
        if template is None:
            template = resolve_template(args.model, args.template, args.model_type, args.system, task=args.task_type)
        if args.padding_side:
            template = dataclasses.replace(template, padding_side=args.padding_side)
        for side in ("query", "document"):  # --query_system, --document_system: over --system and the template's
            if getattr(args, side + "_system") is not None:
                template = dataclasses.replace(template, **{side + "_system": getattr(args, side + "_system")})
        processing = load_processing(args.model, template)
        tokenizer = getattr(processing, "tokenizer", None) or processing
        pooling = get_task(args.task_type).pooling(args, template)
        return cls(template, processing, pooling, args.max_length or default_max_length(args.model, tokenizer))


# ----------------------------------------------------------------------------- the student model


def parts_to_freeze(args: SftArguments) -> set[str]:
    """The parts of a multimodal model that ``--freeze_vit``, ``--freeze_aligner`` and
    ``--freeze_llm`` keep frozen."""
    return frozen_parts(args.freeze_vit, args.freeze_aligner, args.freeze_llm)


def lora_target_modules(model: nn.Module, target_modules: list[str], template: Template,
                        frozen: set[str] = frozenset()) -> str | list[str]:
    """``all-linear`` as ms-swift means it: every linear layer of the transformer, but not
    heads or the (unused) BERT pooler; in a multimodal model only the parts not frozen
    (by default the LLM: ``--freeze_vit`` and ``--freeze_aligner`` are on). Other names
    pass to PEFT unchanged."""
    if target_modules != ["all-linear"]:
        return target_modules
    skip = ("lm_head", "pooler", "score", "classifier")
    linear = [
        name for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not any(s in name.split(".") for s in skip)
    ]
    if template.parts:
        # full names: a suffix such as "qkv" or "fc1" would also match inside frozen parts
        names = sorted(n for n in linear if template.module_part(n) not in frozen and template.module_part(n))
    else:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if not names:
        raise ValueError("no linear layers found for --target_modules all-linear (are all parts frozen?)")
    return names


def lora_flags(args: SftArguments) -> str:
    """The flags that chose the LoRA targets, as the user gave them (for an error about them)."""
    if args.target_regex:
        return f"--target_regex {args.target_regex!r}"
    flags = f"--target_modules {' '.join(args.target_modules)}"
    return flags + (f" --modules_to_save {' '.join(args.modules_to_save)}" if args.modules_to_save else "")


def apply_lora(backbone: nn.Module, args: SftArguments, template: Template, peft_task: str = "FEATURE_EXTRACTION",
               modules_to_save: list[str] | None = None) -> nn.Module:
    """A new LoRA adapter as the flags say, or (``--adapters``) an existing one trained on.
    ``peft_task``: PEFT's task type (a reranker's ``SEQ_CLS``, whose new head PEFT trains and
    saves whole, or ``CAUSAL_LM``). ``modules_to_save``: the backbone's modules trained whole
    (default ``--modules_to_save``; less the sentence-transformers modules it names)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if args.adapters:
        from ..model.adapters import load_lora  # mmembed's adapters and ms-swift's alike

        logger.info("training on the adapter in %s (its own rank, alpha and target modules)", args.adapters[0])
        return load_lora(backbone, args.adapters[0], is_trainable=True)
    init = {"true": True, "false": False}.get(args.init_weights.lower(), args.init_weights)
    config = LoraConfig(
        task_type=TaskType[peft_task],
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_regex or lora_target_modules(backbone, list(args.target_modules), template,
                                                                parts_to_freeze(args)),
        use_dora=args.use_dora,
        use_rslora=args.use_rslora,
        bias=args.lora_bias,
        init_lora_weights=init,
        modules_to_save=list(args.modules_to_save if modules_to_save is None else modules_to_save) or None,
    )
    return get_peft_model(backbone, config)


def freeze_parts(backbone: nn.Module, template: Template, frozen: set[str]) -> int:
    """Full training of a multimodal model: parameters of the frozen parts keep their
    values. Returns how many parameter tensors were frozen."""
    count = 0
    for name, p in backbone.named_parameters():
        if template.module_part(name) in frozen:
            p.requires_grad_(False)
            count += 1
    return count


def part_learning_rates(model: EmbeddingModel, template: Template, args: SftArguments) -> dict[int, float]:
    """``--vit_lr`` / ``--aligner_lr``: the learning rate of each trainable parameter of those
    parts (by ``id``), as optimizer parameter groups take them; the rest keep --learning_rate."""
    wanted = {part: lr for part, lr in (("vit", args.vit_lr), ("aligner", args.aligner_lr)) if lr is not None}
    if not wanted:
        return {}
    if not template.parts:
        raise UsageError(f"--vit_lr / --aligner_lr: template '{template.name}' has no vision or audio parts")
    lrs, found = {}, set()
    for name, p in model.backbone.named_parameters():
        for prefix in ("base_model.model.",):  # PEFT's wrapping; parts are named on the bare backbone
            name = name[len(prefix):] if name.startswith(prefix) else name
        part = template.module_part(name)
        if part in wanted and p.requires_grad:
            lrs[id(p)] = wanted[part]
            found.add(part)
    for part in sorted(set(wanted) - found):
        logger.warning("--%s_lr has no effect: no trainable parameter in the %s part (--freeze_%s true, or LoRA puts "
                       "no adapter there)", part, part, part)
    return lrs


def use_padding_free(args: SftArguments, config, template: Template) -> bool:
    """Whether batches are packed (``--padding_free``; see mmembed.model.packing).

    By default they are where packing saves work: a model of a family whose positions restart
    per row (bert, qwen2, qwen3; the Qwen vision-language families with their 3D rotary
    positions per row) under FlashAttention or FlexAttention. SDPA and eager would compute the
    packed attention as a dense mask, slower than the padded batch, so ``--padding_free true``
    with them (as ms-swift's example scripts pass it) keeps padded batches and says so. An
    audio model's batches stay padded (its encoder's features are merged per padded row)."""
    implementation = config._attn_implementation
    reasons = []
    if template.tower == "audio":
        reasons.append(f"the {template.name} template's audio rows")
    if config.model_type not in PACKABLE_MODEL_TYPES:
        reasons.append(f"model type {config.model_type} (packed: {', '.join(sorted(PACKABLE_MODEL_TYPES))})")
    if implementation not in VARLEN_ATTENTION:
        reasons.append(f"--attn_impl {implementation}, whose packed attention is a dense mask "
                       "(use flash_attn or flex_attention)")
    if args.padding_free is None:
        return not reasons
    if args.padding_free and reasons:
        logger.warning("--padding_free true: batches stay padded because of %s", "; ".join(reasons))
        return False
    return bool(args.padding_free)


ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attention_dropout")  # BERT; Qwen, ModernBERT


def check_attention_dropout(config) -> None:
    """FlexAttention in transformers, and the variable-length kernel of ``--attn_impl varlen``,
    have no attention dropout (transformers refuses a training forward under FlexAttention
    whose module has one), which would stop the run at its first step: say so before the run,
    naming the config field."""
    if config._attn_implementation not in ("flex_attention", "varlen"):
        return
    name = {"flex_attention": "FlexAttention", "varlen": "the varlen kernel"}[config._attn_implementation]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config, text) if text is not config else (config,):
        for field in ATTENTION_DROPOUT_FIELDS:
            p = getattr(cfg, field, 0.0) or 0.0
            if p > 0:
                raise UsageError(
                    f"--attn_impl {config._attn_implementation}: the model's config.json sets {field} = {p:g}, and "
                    f"{name} trains without attention dropout; use --attn_impl sdpa (or flash_attn), or a copy of the model "
                    f"whose config.json sets {field} to 0")


def init_deepspeed_comm() -> None:
    """DeepSpeed keeps its own view of the process group; ZeRO-3 builds the model under
    ``zero.Init``, which reads the world size from it, so it must wrap the group that
    accelerate started (gloo on CPU) before the model is loaded."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized() and not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def build_model(args: SftArguments, template: Template, pooling: str, head: Any = None) -> EmbeddingModel:
    """The student: the backbone of ``--model`` with liger-kernel (``--use_liger_kernel``),
    then a LoRA adapter (``--tuner_type lora``) or, trained in full, its frozen parts frozen,
    wrapped as an :class:`EmbeddingModel` that pools with ``pooling`` (or in the task's
    ``head``: :meth:`~mmembed.task.Task.model_head`)."""
    quant = quantization(args)
    if quant is None:
        backbone = load_backbone(args.model, args.torch_dtype, args.attn_impl)
    else:  # QLoRA: quantized as it loads, onto this process's device (as ms-swift's device_map)
        backbone = load_backbone(args.model, args.torch_dtype, args.attn_impl,
                                 **quant.loading(template.parts, args.device))
        logger.info("%s: the frozen base in %d bits (%s), LoRA in full precision", quant.describe(), quant.bits,
                    f"{quant.quant_type}, computing in {quant.compute_dtype}" if quant.bits == 4 else "int8")
    check_attention_dropout(backbone.config)
    if args.use_liger_kernel:
        # the Trainer would try this on the EmbeddingModel wrapper, which is no PreTrainedModel
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(backbone, args.liger_kernel_config)
        logger.info("--use_liger_kernel: liger-kernel's fused kernels applied to the %s backbone",
                    backbone.config.model_type)
    if args.tuner_type == "lora":
        peft_names = getattr(head, "peft_modules_to_save", None)
        try:
            backbone = apply_lora(backbone, args, template,
                                  modules_to_save=peft_names(args.modules_to_save) if peft_names else None)
        except ValueError as e:  # PEFT's refusal of a target the skeleton check could not see
            if args.adapters:
                raise
            raise UsageError(f"{lora_flags(args)}: {one_line(e)}") from None
    elif freeze_parts(backbone, template, parts_to_freeze(args)):
        logger.info("full training with frozen parts: %s", ", ".join(sorted(parts_to_freeze(args))))
    padding_free = use_padding_free(args, backbone.config, template)
    logger.info("on %s: %s", args.device.type, ", ".join(
        [*getattr(args, "device_defaults", []), f"--padding_free {str(padding_free).lower()}",
         f"--attn_impl {backbone.config._attn_implementation}"]))
    model = (head or EmbeddingModel)(backbone, pooling=pooling, length_chunks=args.length_chunks, tower=template.tower,
                                     padding_free=padding_free, bucket=bool(args.length_buckets))
    if template.pool_skip:  # UEmbed's num_eos_tokens: pooled before the trailing <|endoftext|>
        if not isinstance(model, EmbeddingModel) or pooling != "last":
            raise UsageError(f"template {template.name}: its pooling {template.pool_skip} positions before the last "
                             f"token is for one vector per input with last-token pooling (--task_type embedding)")
        model.pool_skip = template.pool_skip
    return model


class SentenceTransformersHead:
    """The embedding model of a ``--model`` folder whose sentence-transformers modules mmembed
    keeps (:mod:`mmembed.model.st_modules`: Dense layers, LayerNorm, token weights...): an
    :class:`EmbeddingModel` around the backbone with those modules, trained in full training,
    frozen under LoRA but for the ones ``--modules_to_save`` names (which PEFT then does not
    see: they are outside the backbone)."""

    def __init__(self, args: SftArguments, pooling: str):
        from ..model.st_modules import SentenceTransformersModules, modules_of_folder

        self.modules = SentenceTransformersModules(modules_of_folder(args.model), args.model)
        if args.pooling:
            self.modules.use_pooling(pooling)
        mine = self.modules.modules_named(list(args.modules_to_save))[0]
        trained = self.modules.set_trainable(args.tuner_type == "full", mine)
        kinds = " -> ".join(e.kind for e in self.modules.entries)
        logger.info("%s: sentence-transformers modules %s kept; trained: %s", args.model, kinds,
                    ", ".join(trained) or "none (LoRA: name them in --modules_to_save to train them)")

    def peft_modules_to_save(self, names: list[str]) -> list[str]:
        """The ``--modules_to_save`` names left for PEFT (the backbone's)."""
        return self.modules.modules_named(list(names))[1]

    def __call__(self, backbone: nn.Module, **options: Any) -> EmbeddingModel:
        return EmbeddingModel(backbone, modules=self.modules, **options)


def embedding_head(args: SftArguments, pooling: str) -> Any:
    """What :func:`build_model` wraps an embedding backbone in: an :class:`EmbeddingModel`, or
    for a sentence-transformers folder with modules of its own a :class:`SentenceTransformersHead`."""
    from ..model.st_modules import modules_of_folder

    return SentenceTransformersHead(args, pooling) if modules_of_folder(args.model) else EmbeddingModel


# ----------------------------------------------------------------------------- the loss and its side models


def make_loss(args: SftArguments, dataset: DatasetEntry | None = None) -> EmbeddingLoss:
    """The loss named by ``--loss_type`` with ``--loss_kwargs``, wrapped in Matryoshka when
    ``--mrl_dims`` is given. For a ``--dataset_config`` dataset with loss settings of its own
    (``dataset``): its ``loss_kwargs`` over ``--loss_kwargs`` and its ``infonce`` settings
    (:func:`~mmembed.losses.config.infonce_values`, parsed from their values) over both; the
    ``INFONCE_*`` variables give the settings none of them gives. A bad value is a usage error
    naming the flag, or the file, the dataset and the key."""
    options = json.loads(args.loss_kwargs) if args.loss_kwargs else {}
    infonce: dict[str, Any] = {}
    if dataset is not None:
        file = os.path.abspath(args.dataset_config)
        try:
            infonce = infonce_values(dataset.infonce, file, dataset.name)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        options = {**options, **dataset.loss_kwargs, **infonce}
    try:
        if args.mrl_dims:
            return build_loss("matryoshka", dims=args.mrl_dims, inner=args.loss_type, **options)
        return build_loss(args.loss_type, **options)
    except ValueError as e:  # an unknown key or a bad value (the INFONCE_* variables are checked before)
        text = one_line(e)
        if dataset is None:
            flag = f"--loss_kwargs {args.loss_kwargs!r}" if options else f"--loss_type {args.loss_type}"
            raise UsageError(f"{flag}: {text}") from None
        key = next((f"infonce.{k}" for k in infonce if repr(k) in text), None)
        key = key or next((f"loss_kwargs.{k}" for k in dataset.loss_kwargs if repr(k) in text), "loss_kwargs")
        raise UsageError(str(ConfigError(file, dataset.name, key, f"--loss_type {args.loss_type}: {text}"))) from None


@dataclasses.dataclass
class SideModels:
    """The frozen embedders behind the loss's side inputs: the guide (``--guide_model``,
    GIST) and the teacher (``--teacher_model``, distillation), each with its own template
    and tokenizer or processor, embedding the same items as the student (rendered from the
    items, not decoded from the student's ids)."""

    models: dict[str, EmbeddingModel]
    builders: dict[str, InputBuilder]

    @classmethod
    def load(cls, args: SftArguments, media: MediaSettings | None = None) -> SideModels:
        """The side models the flags name; their builders load media with ``media`` (the run's
        settings; None: the environment's, parsed at the first row with media)."""
        from ..model.embedder import load_embedding_model

        models, builders = {}, {}
        for name, path in (("guide", args.guide_model), ("teacher", args.teacher_model)):
            if not path:
                continue
            model, processing, template, info = load_embedding_model(path, args.torch_dtype)
            model.requires_grad_(False)
            models[name] = model.eval()
            builders[name] = InputBuilder(template, processing, info["max_length"], truncate=True, media=media)
        return cls(models, builders)

    def width(self, name: str) -> int | None:
        return hidden_size(self.models[name].config) if name in self.models else None


def check_loss_setup(args: SftArguments, loss: EmbeddingLoss, width: int, side_models: SideModels,
                     teacher_key: str | None, teacher_width: int | None) -> None:
    """The loss's start-up checks (widths, side inputs), as usage errors before training."""
    if "teacher" in side_models.models:
        signal, teacher_width = "embeddings", side_models.width("teacher")
    else:
        signal = SIGNALS.get(teacher_key) if teacher_key else None
    setup = Setup(width=width, guide="guide" in side_models.models, teacher_signal=signal, teacher_width=teacher_width)
    try:
        loss.check_setup(setup)
    except ValueError as e:
        flag = "--mrl_dims" if args.mrl_dims and "mrl_dims" in str(e) else f"--loss_type {args.loss_type}"
        raise UsageError(f"{flag}: {e}") from None
