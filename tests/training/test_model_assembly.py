"""Model assembly for ``mmembed sft`` (mmembed/training/model_assembly.py), piece by piece
and without a run: the template a model folder gets, LoRA's targets and options, the frozen
parts and the learning rates of the parts, whether text batches are packed, and the loss the
flags name."""

from __future__ import annotations

import types

import pytest
import torch

from mmembed.encoding.templates import get_template
from mmembed.errors import UsageError
from mmembed.model.embedding import EmbeddingModel, frozen_parts, load_backbone
from mmembed.training.arguments import parse_sft_args
from mmembed.training.model_assembly import (
    apply_lora,
    check_attention_dropout,
    freeze_parts,
    lora_target_modules,
    make_loss,
    part_learning_rates,
    parts_to_freeze,
    read_model_config,
    resolve_template,
    use_padding_free,
)

BASE = ["--model", "/m", "--dataset", "d.jsonl", "--output_dir", "/tmp/mmembed-assembly-test"]


def model_config(model_type: str, implementation: str):
    return types.SimpleNamespace(model_type=model_type, _attn_implementation=implementation)


# ---- the template ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl_emb"),
                                       ("qwen2", "gte_qwen2"), ("qwen3", "qwen3_emb"), ("qwen2_audio", "qwen2_audio")])
def test_template_is_detected_from_the_model_config(tiny_model, kind, name):
    assert resolve_template(tiny_model(kind), None, None, None).name == name


def test_a_folder_whose_config_cannot_be_read_is_a_usage_error_naming_model(tmp_path):
    with pytest.raises(UsageError, match=f"^--model {tmp_path}: its config.json cannot be read as a transformers model"):
        read_model_config(str(tmp_path))
    with pytest.raises(UsageError, match="^--model"):
        resolve_template(str(tmp_path), None, None, None)


# ---- LoRA, frozen parts and the parts' learning rates ---------------------------------------


@pytest.mark.parametrize("freeze_vit,freeze_aligner,expect", [
    (True, True, {"llm"}), (False, True, {"llm", "vit"}), (True, False, {"llm", "aligner"}), (False, False, {"llm", "vit", "aligner"}),
])
def test_lora_all_linear_covers_only_the_parts_not_frozen(tiny_model, freeze_vit, freeze_aligner, expect):
    backbone = load_backbone(tiny_model("qwen2_vl"))
    template = get_template("qwen2_gme")
    names = lora_target_modules(backbone, ["all-linear"], template, frozen_parts(freeze_vit, freeze_aligner, False))
    assert {template.module_part(n) for n in names} == expect
    linear = {n for n, m in backbone.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(names) == {n for n in linear if template.module_part(n) in expect}
    assert any(n.startswith("visual.merger.") for n in names) == ("aligner" in expect)


def test_lora_flags_reach_peft(minilm_path):
    template = get_template(None, None, "bert")
    args = parse_sft_args(["--model", minilm_path, "--dataset", "d.jsonl", "--use_dora", "true", "--use_rslora", "true",
                           "--lora_bias", "lora_only", "--init_weights", "gaussian", "--target_regex", r".*\.(query|value)$",
                           "--modules_to_save", "pooler"])
    model = apply_lora(load_backbone(minilm_path), args, template)
    config = model.peft_config["default"]
    assert config.use_dora and config.use_rslora and config.bias == "lora_only" and config.init_lora_weights == "gaussian"
    assert config.target_modules == r".*\.(query|value)$" and set(config.modules_to_save) == {"pooler"}
    names = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]  # DoRA's extra vector
    assert names and all(".query." in n or ".value." in n for n in names)


@pytest.mark.parametrize("given, alpha", [("16.0", 16), ("16", 16), ("8.5", 8.5)])
def test_lora_alpha_takes_a_float_as_ms_swift_and_scales_the_update_by_alpha_over_rank(minilm_path, tmp_path,
                                                                                      given, alpha):
    """ms-swift 4.6 takes --lora_alpha as a float (its adapter_config.json says 8.0 for 8): so
    does mmembed. An integral value stays an int, so the saved adapter_config.json says 16 as
    before; a LoRA layer adds (alpha / rank) * B A x to its base output (checked by hand)."""
    import json

    rank = 4
    args = parse_sft_args(["--model", minilm_path, "--dataset", "d.jsonl", "--lora_rank", str(rank), "--lora_alpha",
                           given, "--lora_dropout", "0", "--init_weights", "false"])  # init false: B is not 0
    assert args.lora_alpha == alpha and type(args.lora_alpha) is type(alpha)
    model = apply_lora(load_backbone(minilm_path), args, get_template(None, None, "bert")).eval()
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers
    torch.manual_seed(0)
    for layer in layers[:3]:
        x = torch.randn(2, layer.base_layer.in_features)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            torch.testing.assert_close(layer(x) - layer.base_layer(x), (x @ a.T @ b.T) * (alpha / rank))
    model.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "adapter_config.json").read_text())["lora_alpha"]
    assert saved == alpha and type(saved) is type(alpha)


@pytest.mark.parametrize("given", ["x", "0", "-2", "inf", "nan"])
def test_lora_alpha_that_is_no_positive_number_is_refused_naming_it(given):
    with pytest.raises(UsageError, match=f"--lora_alpha.*{given}"):
        parse_sft_args(BASE + ["--lora_alpha", given])


def test_adapters_start_lora_training_from_an_existing_adapter(minilm_path, tmp_path):
    template = get_template(None, None, "bert")
    first = apply_lora(load_backbone(minilm_path), parse_sft_args(["--model", minilm_path, "--dataset", "d.jsonl",
                                                                   "--lora_rank", "4", "--init_weights", "false"]),
                       template)  # init false: B is random too, so the adapter changes the output
    first.save_pretrained(str(tmp_path / "adapter"))
    saved = {n: p.detach().clone() for n, p in first.named_parameters() if "lora_" in n}
    args = parse_sft_args(["--model", minilm_path, "--dataset", "d.jsonl", "--adapters", str(tmp_path / "adapter")])
    again = apply_lora(load_backbone(minilm_path), args, template)
    loaded = {n: p for n, p in again.named_parameters() if "lora_" in n}
    assert loaded.keys() == saved.keys() and all(p.requires_grad for p in loaded.values())
    for n in saved:
        torch.testing.assert_close(loaded[n], saved[n])
    with pytest.raises(ValueError, match="--adapters continues a LoRA adapter"):
        parse_sft_args(["--model", minilm_path, "--dataset", "d.jsonl", "--adapters", "x", "--tuner_type", "full"])


def test_freeze_parts_stops_the_gradient_of_the_frozen_parts_only(tiny_model):
    template = get_template("qwen2_gme")
    backbone = load_backbone(tiny_model("qwen2_vl"))
    part = {n: template.module_part(n) for n, _ in backbone.named_parameters()}
    frozen = {"vit", "aligner"}
    assert freeze_parts(backbone, template, frozen) == sum(p in frozen for p in part.values())
    assert {part[n] for n, p in backbone.named_parameters() if not p.requires_grad} == frozen
    assert all(p.requires_grad for n, p in backbone.named_parameters() if part[n] not in frozen)
    assert freeze_parts(load_backbone(tiny_model("qwen2_vl")), template, set()) == 0


def test_vit_and_aligner_learning_rates_go_to_the_trainable_parameters_of_their_parts(tiny_model, caplog):
    """--vit_lr reaches every trainable parameter of the vision tower, under LoRA (PEFT's
    names) or trained in full; --aligner_lr on a frozen aligner changes nothing and says so;
    a template without parts refuses both."""
    folder = tiny_model("qwen2_vl")
    template = get_template("qwen2_gme")
    flags = ["--model", folder, "--dataset", "d.jsonl", "--freeze_vit", "false", "--vit_lr", "1e-5",
             "--aligner_lr", "2e-5"]  # --freeze_aligner true (the default)

    def vit_params(model):
        return {id(p) for n, p in model.backbone.named_parameters()
                if p.requires_grad and template.module_part(n.removeprefix("base_model.model.")) == "vit"}

    args = parse_sft_args(flags + ["--tuner_type", "full"])
    backbone = load_backbone(folder)
    freeze_parts(backbone, template, parts_to_freeze(args))
    full = EmbeddingModel(backbone, "last", tower=template.tower)
    with caplog.at_level("WARNING", logger="mmembed"):
        lrs = part_learning_rates(full, template, args)
    assert lrs and lrs == dict.fromkeys(vit_params(full), 1e-5)
    assert "--aligner_lr has no effect: no trainable parameter in the aligner part" in caplog.text
    assert "--vit_lr has no effect" not in caplog.text

    args = parse_sft_args(flags)  # LoRA: the adapters' parameters, named under PEFT's base_model.model.
    lora = EmbeddingModel(apply_lora(load_backbone(folder), args, template), "last", tower=template.tower)
    lrs = part_learning_rates(lora, template, args)
    assert lrs and lrs == dict.fromkeys(vit_params(lora), 1e-5)
    assert part_learning_rates(lora, template, parse_sft_args(["--model", folder, "--dataset", "d.jsonl"])) == {}
    with pytest.raises(UsageError, match="--vit_lr / --aligner_lr: template 'bert' has no vision or audio parts"):
        part_learning_rates(full, get_template(None, None, "bert"), args)


# ---- packed batches -------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,implementation,tower,want", [
    ("qwen3", "flash_attention_2", None, True),
    ("bert", "flex_attention", None, True),
    ("qwen2", "flash_attention_3", None, True),
    ("qwen3", "sdpa", None, False),           # a dense mask would be slower than padding
    ("xlm-roberta", "flash_attention_2", None, False),  # positions start past the padding index
    ("qwen2_vl", "flash_attention_2", "vision", True),  # GME: 3D rotary positions per row
    ("qwen2_5_vl", "flash_attention_3", "vision", True),
    ("qwen3_vl", "flash_attention_2", "vision", True),
    ("qwen3_vl", "sdpa", "vision", False),
    ("qwen2_audio", "flash_attention_2", "audio", False),  # audio features merged per padded row
])
def test_padding_free_by_default_where_it_saves_work(model_type, implementation, tower, want):
    template = types.SimpleNamespace(tower=tower, name="t")
    args = types.SimpleNamespace(padding_free=None)
    assert use_padding_free(args, model_config(model_type, implementation), template) is want
    args.padding_free = False
    assert use_padding_free(args, model_config(model_type, implementation), template) is False


def test_padding_free_true_without_a_varlen_attention_keeps_padded_batches(caplog):
    template = types.SimpleNamespace(tower=None, name="qwen3_emb")
    args = types.SimpleNamespace(padding_free=True)
    with caplog.at_level("WARNING", logger="mmembed"):
        assert use_padding_free(args, model_config("qwen3", "sdpa"), template) is False
    assert "--padding_free true: batches stay padded" in caplog.text and "sdpa" in caplog.text
    assert use_padding_free(args, model_config("qwen3", "flex_attention"), template) is True


# ---- the loss -------------------------------------------------------------------------------


def test_the_loss_is_the_one_the_flags_name_with_its_options():
    assert type(make_loss(parse_sft_args(BASE))).__name__ == "InfoNCELoss"
    loss = make_loss(parse_sft_args(BASE + ["--loss_type", "gist", "--loss_kwargs", '{"margin": 0.1}',
                                            "--mrl_dims", '{"64": 1.0, "128": 0.5}']))
    assert type(loss).__name__ == "MatryoshkaLoss" and loss.dims == {64: 1.0, 128: 0.5}
    assert type(loss.inner).__name__ == "GISTLoss" and loss.inner.margin == 0.1
    with pytest.raises(UsageError, match="""^--loss_kwargs '{"nope": 1}': loss 'infonce' takes no option 'nope'"""):
        make_loss(parse_sft_args(BASE + ["--loss_kwargs", '{"nope": 1}']))


# ---- FlexAttention and attention dropout ----------------------------------------------------


@pytest.mark.parametrize("make,field", [
    (lambda p: __import__("transformers").BertConfig(attention_probs_dropout_prob=p), "attention_probs_dropout_prob"),
    (lambda p: __import__("transformers").Qwen3Config(attention_dropout=p), "attention_dropout"),
    (lambda p: __import__("transformers").Qwen2VLConfig(text_config={"attention_dropout": p}), "attention_dropout"),
])
@pytest.mark.parametrize("implementation", ["flex_attention", "varlen"])
def test_attention_without_dropout_refuses_a_model_with_it_before_the_run(make, field, implementation):
    config = make(0.1)
    config._attn_implementation = implementation
    with pytest.raises(UsageError, match=f"{implementation}: the model's config.json sets {field} = 0.1"):
        check_attention_dropout(config)
    config = make(0.0)
    config._attn_implementation = implementation
    check_attention_dropout(config)  # no dropout: it trains
    config = make(0.1)
    config._attn_implementation = "sdpa"
    check_attention_dropout(config)  # other attention implementations apply the dropout
