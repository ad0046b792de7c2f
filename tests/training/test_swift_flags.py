"""Every flag of ms-swift 4.6.0's `swift sft` (tests/fixtures/swift_sft_flags.json, made by
tests/fixtures/make_swift_sft_flags.py from its argument dataclasses) lands in exactly one
of: implemented (a field of SftArguments), accepted with no effect (one logged line naming
it and why), or refused (exit status 2, saying what to use instead)."""

import dataclasses
import json
import logging
import os
import shutil

import pytest
import torch
from conftest import DATA, REPO

from mmembed.tools.cli import main as cli_main
from mmembed.training.arguments import SftArguments, UsageError, parse_sft_args
from mmembed.training.swift_flags import NO_EFFECT, REFUSED

BASE = ["--model", "/m", "--dataset", "d.jsonl", "--output_dir", "/tmp/mmembed-flags-test"]
SWIFT_FLAGS = json.load(open(os.path.join(REPO, "tests", "fixtures", "swift_sft_flags.json")))["flags"]
FIELDS = {f.name: f for f in dataclasses.fields(SftArguments) if f.init}
MM = os.path.join(DATA, "mm")


def category(flag: str) -> list[str]:
    return [name for name, member in (("implemented", flag in FIELDS), ("no_effect", flag in NO_EFFECT),
                                      ("refused", flag in REFUSED)) if member]


def test_the_fixture_is_ms_swifts_whole_sft_flag_list():
    assert len(SWIFT_FLAGS) > 300
    for flag in ("streaming", "columns", "adapters", "resume_only_model", "dataset_shuffle", "max_pixels", "vit_lr",
                 "aligner_lr", "use_dora", "check_model", "use_hf", "sequence_parallel_size", "loss_type", "mrl_dims",
                 "tuner_type", "freeze_vit", "learning_rate", "deepspeed"):
        assert flag in SWIFT_FLAGS, flag


def test_every_ms_swift_flag_lands_in_exactly_one_category():
    bad = {flag: category(flag) for flag in SWIFT_FLAGS if len(category(flag)) != 1}
    assert not bad
    # the tables hold ms-swift flags only, and nothing twice
    assert not (set(NO_EFFECT) | set(REFUSED)) - set(SWIFT_FLAGS)


def _default_as_text(f: dataclasses.Field) -> str | None:
    value = f.default
    if value is dataclasses.MISSING or value is None:
        return None
    value = getattr(value, "value", value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, (int, float, str)) and str(value) else None


@pytest.mark.parametrize("flag", sorted(f for f in SWIFT_FLAGS if f in FIELDS))
def test_implemented_flags_parse(flag):
    """An implemented flag is a field: the parser takes it (here with its own default) and
    the swift tables never swallow it."""
    assert flag not in NO_EFFECT and flag not in REFUSED
    text = _default_as_text(FIELDS[flag])
    if text is None or flag in ("model", "dataset", "output_dir", "task_type"):
        return  # no scalar default to pass back; the specific tests below exercise the mmembed ones
    if flag == "deepspeed" or flag.startswith(("fsdp", "torch_compile", "use_cpu", "hub_", "push_to_hub")):
        return  # meaningful only with their companions; TrainingArguments checks those itself
    parse_sft_args(BASE + [f"--{flag}", text])


@pytest.mark.parametrize("flag, other", [("lazy_tokenize", "false"), ("use_chat_template", "false")])
def test_no_effect_fields_log_a_line_saying_why_when_set_otherwise(flag, other, caplog):
    """--lazy_tokenize and --use_chat_template are fields (ms-swift scripts set them); given
    another value than what mmembed does, one line says they change nothing and why; given
    that value (train_gme.sh's --lazy_tokenize true), nothing is logged."""
    from mmembed.training.swift_flags import NO_EFFECT_FIELDS

    assert flag in FIELDS and flag not in NO_EFFECT
    with caplog.at_level(logging.INFO, logger="mmembed"):
        args = parse_sft_args(BASE + [f"--{flag}", other])
    assert getattr(args, flag) is False
    lines = [r.getMessage() for r in caplog.records if f"--{flag} " in r.getMessage()]
    assert lines == [f"--{flag} {other} has no effect here: {NO_EFFECT_FIELDS[flag][1]}"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmembed"):
        parse_sft_args(BASE + [f"--{flag}", "true"])
        SftArguments(model="/m", dataset=["d.jsonl"], output_dir="/tmp/mmembed-flags-test")
    assert not [r for r in caplog.records if f"--{flag} " in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="mmembed"):  # mmembed.train(...)'s keywords too
        SftArguments(model="/m", dataset=["d.jsonl"], output_dir="/tmp/mmembed-flags-test", **{flag: False})
    assert len([r for r in caplog.records if f"--{flag} " in r.getMessage()]) == 1


@pytest.mark.parametrize("flag", sorted(NO_EFFECT))
def test_no_effect_flags_are_accepted_with_a_line_saying_why(flag, caplog):
    with caplog.at_level(logging.INFO, logger="mmembed"):
        args = parse_sft_args(BASE + [f"--{flag}", "something", "--lora_rank", "4"])
    assert args.lora_rank == 4  # the flags after it still parse
    lines = [r.getMessage() for r in caplog.records if f"--{flag} " in r.getMessage()]
    assert len(lines) == 1 and "no effect" in lines[0] and NO_EFFECT[flag] in lines[0]
    # --flag=value spelling too
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmembed"):
        parse_sft_args(BASE + [f"--{flag}=1"])
    assert any(f"--{flag} " in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_exit_2_saying_what_to_use_instead(flag, capsys, caplog):
    code = cli_main(["sft", *BASE, f"--{flag}", "some-value"])
    err = capsys.readouterr().err
    assert code == 2, err
    instead, harmless = REFUSED[flag]
    assert f"--{flag} some-value is not supported" in err and instead in err
    # ms-swift's default spelled out in a copied script is accepted, and said so
    with caplog.at_level(logging.INFO, logger="mmembed"):
        parse_sft_args(BASE + [f"--{flag}", harmless[0] or "none"])
    assert any(f"--{flag} " in r.getMessage() for r in caplog.records)


def test_unknown_flags_are_still_errors_naming_them():
    with pytest.raises(UsageError, match="--not_a_flag"):
        parse_sft_args(BASE + ["--not_a_flag", "1"])


# ---- the implemented ms-swift flags, one by one -------------------------------------------------

def test_sequence_parallel_size_above_one_is_refused_with_what_to_do():
    assert parse_sft_args(BASE + ["--sequence_parallel_size", "1"]).sequence_parallel_size == 1
    with pytest.raises(ValueError, match="sequence parallelism is not offered.*gradcache_mini_batch_size"):
        parse_sft_args(BASE + ["--sequence_parallel_size", "2"])


def test_max_pixels_is_the_max_pixels_variable(monkeypatch, caplog):
    """--max_pixels takes the place of MAX_PIXELS in the run's media settings (parsed once, with
    a warning when the variable says otherwise); the environment is left as it is."""
    from mmembed.training.preflight import media_settings

    monkeypatch.setenv("MAX_PIXELS", "9999")  # restored afterwards by monkeypatch
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        args = parse_sft_args(BASE + ["--max_pixels", "50176"])
    assert "--max_pixels 50176 wins over MAX_PIXELS=9999" in caplog.text
    assert media_settings(args).budget.max_pixels == 50176
    assert os.environ["MAX_PIXELS"] == "9999"
    assert media_settings(parse_sft_args(BASE)).budget.max_pixels == 9999  # without the flag: the variable
    with pytest.raises(ValueError, match="--max_pixels must be > 0"):
        parse_sft_args(BASE + ["--max_pixels", "0"])


def test_max_pixels_and_offline_reach_data_loader_workers(tiny_model, tmp_path, monkeypatch):
    """--max_pixels and --offline true are parsed once into the run's media settings, held by
    every builder of the run (the collator's included), so data-loader workers
    (--dataloader_num_workers 2) size images by --max_pixels and refuse an uncached URL
    offline while the environment says otherwise (a larger MAX_PIXELS, no offline switch).
    The settings survive pickling, which is how a spawned worker receives the collator."""
    import pickle

    from torch.utils.data import DataLoader

    from mmembed.data.sample import Item, Sample
    from mmembed.encoding.collator import DATA_ERROR
    from mmembed.encoding.inputs import InputBuilder
    from mmembed.training.sft import build_trainer

    monkeypatch.setenv("MAX_PIXELS", str(16 * 784))  # 64 x 64 images stay 56 x 56: 2 x 2 merged tokens
    monkeypatch.setenv("MIN_PIXELS", "784")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("MMEMBED_OFFLINE", raising=False)
    monkeypatch.setenv("MMEMBED_MEDIA_CACHE", str(tmp_path / "media-cache"))
    names = ["red_circle.png", "blue_square.png", "green_triangle.png", "yellow_square.png"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"query": "<image>", "response": f"shape {i}", "images": [os.path.join(MM, n)]})
                            + "\n" for i, n in enumerate(names)))
    args = parse_sft_args(["--model", tiny_model("qwen2_vl"), "--dataset", str(rows), "--output_dir",
                           str(tmp_path / "out"), "--max_pixels", "784", "--offline", "true",
                           "--dataloader_num_workers", "2", "--per_device_train_batch_size", "2", "--report_to", "none"])
    trainer = build_trainer(args)
    media = trainer.data_collator.builder.media
    assert (media.budget.max_pixels, media.downloads.offline) == (784, "MMEMBED_OFFLINE=1")
    assert pickle.loads(pickle.dumps(trainer.data_collator)).builder.media == media
    assert os.environ["MAX_PIXELS"] == str(16 * 784) and "MMEMBED_OFFLINE" not in os.environ

    image = Item("<image>", images=[os.path.join(MM, names[0])])
    by_env = InputBuilder(trainer.data_collator.template, trainer.data_collator.tokenizer)([image])
    assert by_env["image_grid_thw"].tolist() == [[1, 4, 4]]  # what the environment's budget would give
    batches = list(trainer.get_train_dataloader())
    assert torch.cat([b["image_grid_thw"] for b in batches]).tolist() == [[1, 2, 2]] * 4  # 28 x 28: --max_pixels 784

    url = "http://127.0.0.1:9/never-fetched.png"  # online, a worker would try it and be refused the connection
    uncached = [Sample(Item("<image>", images=[url]), [Item("a shape")], [], source="urls.jsonl", line=n) for n in (1, 2)]
    loader = DataLoader(uncached, batch_size=1, collate_fn=trainer.data_collator, num_workers=2,
                        multiprocessing_context="fork")
    errors = [str(batch[DATA_ERROR]) for batch in loader]
    assert len(errors) == 2 and all("offline (MMEMBED_OFFLINE=1) and the URL is not in the media cache" in e
                                    for e in errors), errors


def test_columns_renames_fields_before_rows_are_read(tmp_path):
    from mmembed.data import load_samples
    from mmembed.data.sample import Sample
    from mmembed.training.data_assembly import TrainingData

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"text1": "a cat", "text2": "a kitten", "hard": ["a dog"]}) + "\n")
    mapping = {"text1": "query", "text2": "response", "hard": "rejected_response"}
    ds = load_samples([str(path)], columns=mapping, cache_dir=str(tmp_path / "cache")).dataset
    s = Sample.from_json(ds[0]["sample"])
    assert (s.anchor.text, s.positives[0].text, [n.text for n in s.negatives]) == ("a cat", "a kitten", ["a dog"])
    args = parse_sft_args(BASE + ["--columns", json.dumps(mapping)])
    assert json.loads(args.columns) == mapping and "columns=json.loads(args.columns)" in _source(TrainingData.load)
    for bad in ("[1]", "{not json", '{"a": 1}'):
        with pytest.raises(ValueError, match="--columns"):
            parse_sft_args(BASE + ["--columns", bad])


def _source(fn) -> str:
    import inspect

    return inspect.getsource(fn)


def test_vit_lr_and_aligner_lr_become_optimizer_groups_by_template_part(tiny_model, tmp_path):
    from mmembed.training.sft import build_trainer

    model = tiny_model("qwen2_vl")
    args = parse_sft_args(["--model", model, "--dataset", os.path.join(MM, "gme_train.jsonl"), "--tuner_type", "full",
                           "--freeze_vit", "false", "--freeze_aligner", "false", "--learning_rate", "1e-4",
                           "--vit_lr", "1e-3", "--aligner_lr", "2e-3", "--output_dir", str(tmp_path),
                           "--report_to", "none"])
    trainer = build_trainer(args)
    optimizer = trainer.create_optimizer()
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    from mmembed.encoding.templates import get_template

    parts = get_template("qwen2_gme").parts  # what the tiny Qwen2-VL resolves to
    aligner, vit = tuple(p + "." for p in parts["aligner"]), tuple(p + "." for p in parts["vit"])
    seen = set()
    for name, p in trainer.model.backbone.named_parameters():
        if not p.requires_grad:
            continue
        want = 2e-3 if name.startswith(aligner) else 1e-3 if name.startswith(vit) else 1e-4
        assert lr_of[id(p)] == want, name
        seen.add(want)
    assert seen == {1e-4, 1e-3, 2e-3}
    # weight decay is still split as the Trainer splits it (no decay on biases and norms)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.1}


def test_a_final_model_or_an_export_is_named_and_resumes_with_resume_only_model(minilm_path, tmp_path):
    """A folder mmembed saved as a model, not a checkpoint (the final model of --save_strategy
    no, an `mmembed export` folder) is named as what it is, with what to do, where a killed
    save is named as such; --resume_only_model true trains on from its weights."""
    from safetensors.torch import load_file

    from mmembed.errors import UsageError
    from mmembed.tools.export import export_checkpoint
    from mmembed.training.checkpoints import COMPLETE_MARKER, IncompleteCheckpointError, check_complete
    from mmembed.training.sft import run_sft

    rows = tmp_path / "train.jsonl"
    with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
        rows.write_text("".join(f.readline() for _ in range(8)))
    common = ["--model", minilm_path, "--dataset", str(rows), "--tuner_type", "full", "--per_device_train_batch_size", "4",
              "--gradient_accumulation_steps", "1", "--max_length", "32", "--report_to", "none", "--disable_tqdm", "true",
              "--dataloader_num_workers", "0", "--logging_steps", "1"]
    final = run_sft(parse_sft_args(common + ["--max_steps", "2", "--learning_rate", "1e-3", "--save_strategy", "no",
                                             "--output_dir", str(tmp_path / "a")]))["last_checkpoint"]
    exported = export_checkpoint(final, str(tmp_path / "exported"))
    with pytest.raises(UsageError) as e:  # marked whole (the save is atomic), but it holds the model alone
        run_sft(parse_sft_args(common + ["--max_steps", "3", "--output_dir", str(tmp_path / "b"),
                                         "--resume_from_checkpoint", final]))
    assert "a final model saved without training state (as `--save_strategy no` saves it" in str(e.value)
    assert "--resume_only_model true" in str(e.value) and f"--model {final}" in str(e.value)
    assert "killed" not in str(e.value)
    with pytest.raises(IncompleteCheckpointError, match=r"is an `mmembed export` folder \(merged from .*--resume_only_model "
                                                        r"true.*--model "):
        check_complete(exported)
    # a final model of an older mmembed (saved without the marker) is named the same way
    unmarked = tmp_path / "unmarked" / "checkpoint-2"
    shutil.copytree(final, unmarked)
    os.remove(unmarked / COMPLETE_MARKER)
    with pytest.raises(IncompleteCheckpointError, match=r"a final model saved without training state"):
        check_complete(str(unmarked))
    # a checkpoint with its training state but no marker is still what a killed save leaves
    killed = tmp_path / "killed" / "checkpoint-2"
    shutil.copytree(unmarked, killed)
    (killed / "trainer_state.json").write_text("{}")
    with pytest.raises(IncompleteCheckpointError, match="probably killed while saving"):
        check_complete(str(killed))

    trained = load_file(os.path.join(final, "model.safetensors"))
    for source, out in ((final, "c"), (exported, "d")):
        # learning rate 0: the run ends with the folder's weights; no trainer_state.json, so from step 0
        result = run_sft(parse_sft_args(common + ["--max_steps", "1", "--learning_rate", "0", "--output_dir",
                                                  str(tmp_path / out), "--resume_from_checkpoint", source,
                                                  "--resume_only_model", "true"]))
        assert result["last_checkpoint"].endswith("checkpoint-1")
        got = load_file(os.path.join(result["last_checkpoint"], "model.safetensors"))
        assert got.keys() == trained.keys()
        for k in trained:
            torch.testing.assert_close(got[k], trained[k], rtol=0, atol=0)
    base = load_file(os.path.join(minilm_path, "model.safetensors"))
    key = next(k for k in trained if "query.weight" in k)
    assert (trained[key] - base[key]).abs().max() > 1e-5  # the first run moved the weights


def test_resume_only_model_loads_weights_and_goes_on_from_the_step(minilm_path, tmp_path):
    """ms-swift's rule: the weights, and the step count and data position of trainer_state.json;
    the optimizer, schedule and RNG afresh. --ignore_data_skip true starts at step 0."""
    from safetensors.torch import load_file

    from mmembed.training.sft import run_sft

    rows = tmp_path / "train.jsonl"
    with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
        rows.write_text("".join(f.readline() for _ in range(16)))
    common = ["--model", minilm_path, "--dataset", str(rows), "--tuner_type", "full", "--per_device_train_batch_size", "4",
              "--gradient_accumulation_steps", "1", "--max_length", "32", "--report_to", "none", "--disable_tqdm", "true",
              "--dataloader_num_workers", "0", "--learning_rate", "1e-3", "--logging_steps", "1"]
    first = run_sft(parse_sft_args(common + ["--max_steps", "2", "--output_dir", str(tmp_path / "a")]))
    # lr 0: the weights stay what was loaded, so the saved model equals the checkpoint's
    second = run_sft(parse_sft_args(common + ["--max_steps", "3", "--learning_rate", "0", "--output_dir", str(tmp_path / "b"),
                                             "--resume_from_checkpoint", first["last_checkpoint"],
                                             "--resume_only_model", "true"]))
    assert second["last_checkpoint"].endswith("checkpoint-3")  # steps 1-2 were the checkpoint's: one step trained
    state = json.load(open(os.path.join(second["last_checkpoint"], "trainer_state.json")))
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    w1 = load_file(os.path.join(first["last_checkpoint"], "model.safetensors"))
    w2 = load_file(os.path.join(second["last_checkpoint"], "model.safetensors"))
    base = load_file(os.path.join(minilm_path, "model.safetensors"))
    key = next(k for k in w1 if "query.weight" in k)
    assert (w1[key] - base[key]).abs().max() > 1e-5  # the first run moved the weights
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k])
    # the optimizer starts afresh: AdamW's first update moves every weight with a gradient by
    # lr (its normalized step is +-1), where a resumed optimizer's moments would give less
    third = run_sft(parse_sft_args(common + ["--max_steps", "3", "--output_dir", str(tmp_path / "c"),
                                            "--lr_scheduler_type", "constant", "--weight_decay", "0",
                                            "--resume_from_checkpoint", first["last_checkpoint"],
                                            "--resume_only_model", "true"]))
    w3 = load_file(os.path.join(third["last_checkpoint"], "model.safetensors"))
    step = (w3[key] - w1[key]).abs()
    assert step.max() <= 1.0001e-3 and step.median() > 0.99e-3
    # --ignore_data_skip true: the step count starts at 0
    fourth = run_sft(parse_sft_args(common + ["--max_steps", "1", "--output_dir", str(tmp_path / "d"),
                                             "--resume_from_checkpoint", first["last_checkpoint"],
                                             "--resume_only_model", "true", "--ignore_data_skip", "true"]))
    assert fourth["last_checkpoint"].endswith("checkpoint-1")
    with pytest.raises(ValueError, match="--resume_only_model true needs --resume_from_checkpoint"):
        parse_sft_args(BASE + ["--resume_only_model", "true"])
