"""bench_gpu's sentence-transformers side (s-t 6.2): the text runs (SentenceTransformer +
MultipleNegativesRankingLoss at scale 20) and the Qwen3-VL-Embedding picture run (the folder's
AutoModel under s-t's Transformer in its message modality, a chat template made from mmembed's
template, LoRA on the language model), drawing batches in ms-swift's order (SwiftOrderTrainer) so
that its first batch is the other sides'."""

from __future__ import annotations

import json
import os

from benchmarks.gpu.specs import LORA, TEXT


def train_st(spec: dict) -> None:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

    rows = st_rows(spec)
    ds = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["response"] for r in rows]})
    model = SentenceTransformer(spec["model"], device=spec["device"], model_kwargs=st_model_kwargs(spec))
    model.max_seq_length = TEXT["max_length"]
    st_train(spec, model, ds, learning_rate=TEXT["lr"], weight_decay=TEXT["weight_decay"],
             adam_beta2=TEXT["adam_beta2"], lr_scheduler_type="linear", gradient_checkpointing=False)


def st_train(spec: dict, model, dataset, **recipe) -> None:
    """Train the s-t side's ``model`` on ``dataset`` (its columns) for ``spec``'s batch and steps, in
    ms-swift's order (SwiftOrderTrainer), with MultipleNegativesRankingLoss at scale 20 and the run's
    ``recipe`` (learning rate, optimizer, schedule, checkpointing, prompts)."""
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    extra = {} if spec.get("workers") is None else {"dataloader_num_workers": spec["workers"]}
    args = SentenceTransformerTrainingArguments(
        output_dir=spec["out"], per_device_train_batch_size=spec["batch"], warmup_steps=0, max_steps=spec["steps"],
        save_strategy="no", logging_steps=1000, seed=TEXT["seed"], report_to="none", disable_tqdm=True,
        dataloader_drop_last=True, bf16=spec["amp"], use_cpu=spec["device"] == "cpu", **recipe, **extra,
    )
    trainer = _swift_order_trainer()(model=model, args=args, train_dataset=dataset,
                                     loss=MultipleNegativesRankingLoss(model, scale=TEXT["scale"]))
    trainer.train()


def st_model_kwargs(spec: dict) -> dict:
    """The s-t side's ``model_kwargs``: the run's dtype and attention (ms-swift's flash_attn is
    transformers' flash_attention_2)."""
    import torch

    kwargs = {"dtype": getattr(torch, spec["dtype"])}
    if spec.get("attn_impl"):
        kwargs["attn_implementation"] = {"flash_attn": "flash_attention_2"}.get(spec["attn_impl"], spec["attn_impl"])
    return kwargs


def st_chat_template(model_type: str) -> str:
    """A chat template (Jinja) that renders sentence-transformers' messages as mmembed's template
    for ``model_type`` renders a row: the system turn (s-t's prompt, injected as a system message)
    and the user turn's pictures (its media placeholder) and text in ``format_with_system``, the
    assistant turn and the pooled end token included (s-t asks for no generation prompt)."""
    from mmembed.encoding.templates import get_template

    t = get_template(model_type=model_type)
    system, rest = t.format_with_system.split("{system}")
    middle, end = rest.split("{content}")
    lit = json.dumps  # a Jinja string literal: JSON's escapes are Jinja's
    text = "{% if c is string %}{{ c }}{% else %}{% for p in c %}{% if p['type'] == 'image' %}" + \
        "{{ " + lit(t.media["image"]) + " }}{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    return ("{% set ns = namespace(system='', user='') %}{% for m in messages %}{% set c = m['content'] %}"
            "{% if m['role'] == 'system' %}{% set ns.system %}" + text + "{% endset %}"
            "{% else %}{% set ns.user %}{{ ns.user }}" + text + "{% endset %}{% endif %}{% endfor %}"
            "{{ " + lit(system) + " }}{{ ns.system }}{{ " + lit(middle) + " }}{{ ns.user }}{{ " + lit(end) + " }}")


def st_vl_column(text: str, images: list) -> str | dict:
    """One query-form input (text with ``<image>`` tags, the row's pictures bound in order, taken
    from ``images``) as sentence-transformers takes it: the text, ``{"image": path}``, or both."""
    n = text.count("<image>")
    if n > 1:
        raise ValueError(f"bench_gpu's s-t side takes one picture per input, not {n}: {text!r}")
    if not n:
        return text
    picture = images.pop(0)
    rest = text.replace("<image>", "")
    return {"image": picture} if not rest else {"text": rest, "image": picture}


def st_vl_model(spec: dict):
    """sentence-transformers 6.2 training ``spec``'s picture model as mmembed and ms-swift do:
    the model folder's AutoModel under s-t's Transformer (its message modality: the processor's
    chat template, st_chat_template), last-token pooling, normalized; LoRA (rank, alpha, dropout as
    LORA) on every linear layer of the language model (mmembed's all-linear with the vision tower
    and aligner frozen), everything else frozen; the pictures' pixel budget of MAX_PIXELS /
    MIN_PIXELS, as the other sides read it. Returns (model, the template's system prompt)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from mmembed.encoding.templates import get_template

    template = get_template(model_type=spec["model_type"])
    backbone = Transformer(spec["model"], model_kwargs=st_model_kwargs(spec),
                           processor_kwargs={"chat_template": st_chat_template(spec["model_type"])})
    if os.environ.get("MAX_PIXELS"):
        backbone.processor.image_processor.size = {"shortest_edge": int(os.environ.get("MIN_PIXELS", str(56 * 56))),
                                                   "longest_edge": int(os.environ["MAX_PIXELS"])}
    llm = tuple(f"{p}." for p in template.parts["llm"])
    targets = [n for n, m in backbone.auto_model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(llm)]
    inject_adapter_in_model(LoraConfig(r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"],
                                       lora_dropout=LORA["lora_dropout"], target_modules=targets), backbone.auto_model)
    for name, p in backbone.auto_model.named_parameters():
        p.requires_grad_("lora_" in name)
    pooling = Pooling(backbone.get_embedding_dimension(), "lasttoken")
    model = SentenceTransformer(modules=[backbone, pooling, Normalize()], device=spec["device"])
    return model, template.default_system


def train_st_vl(spec: dict) -> None:
    """s-t's side of a picture run (st_vl_model): the query-form rows (caption, picture, negative
    picture) as anchor / positive / negative columns, MultipleNegativesRankingLoss at the other sides'
    InfoNCE temperature (scale 20 = 1 / INFONCE_TEMPERATURE 0.05), gradient checkpointing, and mmembed's (ms-swift's) optimizer
    and schedule defaults at the run's learning rate."""
    from datasets import Dataset

    from mmembed.training.sft_flags import SftFlags

    columns: dict = {"anchor": [], "positive": [], "negative": []}
    for r in st_rows(spec):
        images = list(r.get("images") or [])
        negatives = r.get("rejected_response") or []
        for name, text in zip(columns, [r["query"], r["response"], *negatives[:1]]):
            columns[name].append(st_vl_column(text, images))
    if len(columns["negative"]) != len(columns["anchor"]):
        columns.pop("negative")
    model, system = st_vl_model(spec)
    defaults = SftFlags.__dataclass_fields__
    st_train(spec, model, Dataset.from_dict(columns), learning_rate=spec["lr"],
             weight_decay=defaults["weight_decay"].default, adam_beta2=defaults["adam_beta2"].default,
             lr_scheduler_type=defaults["lr_scheduler_type"].default, gradient_checkpointing=spec["checkpointing"],
             prompts=system)


def st_rows(spec: dict) -> list[dict]:
    """s-t's rows: the query form of the other sides' rows (``st_data``, else ``data`` itself), in
    the order mmembed and ms-swift hold ``data`` (swift_order)."""
    with open(spec.get("st_data") or spec["data"], encoding="utf-8") as f:
        source = [json.loads(line) for line in f if line.strip()]
    return [source[i] for i in swift_order(spec["data"])]


def swift_order(data: str) -> list[int]:
    """The rows of ``data`` (its non-empty lines, from 0) in the order mmembed's and ms-swift's
    sides hold them: loaded with --dataset_shuffle under --data_seed 42 (mmembed's loader, which
    follows ms-swift's); their samplers then draw from that order (SwiftOrderTrainer)."""
    from mmembed.data.dataset import load_samples

    return list(load_samples(data, seed=42, shuffle=True).dataset["row"])


def _swift_order_trainer():
    """sentence-transformers' trainer drawing its batches in ms-swift's order (mmembed's
    SwiftOrderSampler, --data_seed 42, one process), over the rows as swift_order holds them: its
    first batch is the other sides' first batch, so the first losses can be compared."""
    from sentence_transformers import SentenceTransformerTrainer
    from torch.utils.data import BatchSampler

    from mmembed.training.samplers import SwiftOrderSampler

    class SwiftOrderTrainer(SentenceTransformerTrainer):
        def get_batch_sampler(self, dataset, batch_size, drop_last, *a, **k):
            return BatchSampler(SwiftOrderSampler(len(dataset), True, 42), batch_size, drop_last)

    return SwiftOrderTrainer
