"""Checkpoints and data order against ms-swift 4.6 itself.

The fixtures in tests/fixtures/swift/ were written by ms-swift (tests/fixtures/swift/make_fixtures.py,
run in a venv of its own): LoRA checkpoints of `swift sft --task_type embedding` on the tiny
Qwen3 and Qwen2-VL (GME) models of examples/tiny_models.py, ms-swift's embeddings with them,
and the rows of every training step of ms-swift runs with and without --dataset_shuffle,
--split_dataset_ratio and `file#N` specs. The tiny base models are rebuilt here from the same
seed; their weight digest must equal the one ms-swift trained on.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO, cached_embedder

FIXTURES = os.path.join(REPO, "tests", "fixtures", "swift")
META = json.load(open(os.path.join(FIXTURES, "meta.json")))
KIND = {"qwen3_emb": "qwen3", "qwen2_gme": "qwen2_vl"}


def weights_sha256(folder: str) -> str:
    """The digest make_fixtures.py records: tensor names, dtypes, shapes and bytes, in name order."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, f)))
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def swift_checkpoint(tiny_model, tmp_path_factory):
    """``get(name) -> (checkpoint folder, base model folder)``: ms-swift's checkpoint copied with
    its base model's placeholder replaced by the rebuilt tiny model."""

    def get(name: str):
        base = tiny_model(KIND[name])
        assert weights_sha256(base) == META["base_sha256"][KIND[name]], "the tiny base model is not the one ms-swift trained"
        src = os.path.join(FIXTURES, name, "checkpoint-4")
        dst = tmp_path_factory.mktemp(name) / "checkpoint-4"
        shutil.copytree(src, dst)
        for f in ("adapter_config.json", "args.json"):
            text = (dst / f).read_text().replace("TINY_BASE_MODEL", base)
            (dst / f).write_text(text)
        return str(dst), base

    return get


@pytest.fixture(scope="module")
def mmembed_checkpoint(tiny_model, tmp_path_factory):
    """``get(name) -> (checkpoint folder, base model folder)``: the adapter mmembed wrote (make_fixtures.py
    stage ``mmembed``), its base model's placeholder replaced by the rebuilt tiny model."""

    def get(name: str):
        base = tiny_model(KIND[name])
        assert weights_sha256(base) == META["base_sha256"][KIND[name]], "the tiny base model is not the one used"
        dst = tmp_path_factory.mktemp("mmembed_" + name) / "checkpoint-4"
        shutil.copytree(os.path.join(FIXTURES, "mmembed_" + name, "checkpoint-4"), dst)
        for f in ("adapter_config.json", "mmembed.json"):
            (dst / f).write_text((dst / f).read_text().replace("TINY_BASE_MODEL", base))
        return str(dst), base

    return get


def swift_inputs(name: str, folder: str | None = None) -> list:
    """The inputs ms-swift embedded, as mmembed takes them (image paths made absolute)."""
    rows = json.load(open(os.path.join(FIXTURES, folder or name, "inputs.json")))
    for row in rows:
        if "images" in row:
            row["images"] = [os.path.join(FIXTURES, "data", p) for p in row["images"]]
    return rows


@pytest.mark.parametrize("name", ["qwen3_emb", "qwen2_gme"])
def test_swift_adapter_embeds_and_exports_as_in_swift(name, swift_checkpoint, tmp_path):
    from mmembed import Embedder
    from mmembed.tools.export import export_checkpoint

    ckpt, base = swift_checkpoint(name)
    expected = np.load(os.path.join(FIXTURES, name, "embeddings.npy"))
    inputs = swift_inputs(name)
    got = Embedder.from_pretrained(ckpt, device="cpu").encode(inputs)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # the adapter has an effect: the base model embeds differently
    plain = cached_embedder(base).encode(inputs)
    assert np.abs(plain - expected).max() > 1e-3
    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    np.testing.assert_allclose(Embedder.from_pretrained(merged, device="cpu").encode(inputs), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_emb", "qwen2_gme"])
def test_mmembed_adapter_embeds_in_swift_as_in_mmembed(name, mmembed_checkpoint):
    """The other way: ms-swift loads an adapter mmembed wrote (PEFT on its own model class) and
    merges it with `swift export --merge_lora true`; both give mmembed's embeddings."""
    from mmembed import Embedder

    ckpt, base = mmembed_checkpoint(name)
    folder = os.path.join(FIXTURES, "mmembed_" + name)
    inputs = swift_inputs(name, "mmembed_" + name)
    got = Embedder.from_pretrained(ckpt, device="cpu").encode(inputs)
    for swift_file in ("embeddings.npy", "merged_embeddings.npy"):
        np.testing.assert_allclose(got, np.load(os.path.join(folder, swift_file)), atol=1e-5, err_msg=swift_file)
    plain = cached_embedder(base).encode(inputs)
    assert np.abs(plain - got).max() > 1e-3  # the adapter has an effect (it had none in ms-swift before)
    # PEFT's AutoPeftModel builds the class adapter_config.json's auto_mapping names: ms-swift's
    from peft import AutoPeftModel

    peft_model = AutoPeftModel.from_pretrained(ckpt)
    theirs = json.load(open(os.path.join(FIXTURES, name, "checkpoint-4", "adapter_config.json")))["auto_mapping"]
    assert type(peft_model.get_base_model()).__name__ == theirs["base_model_class"]


def swift_command() -> str:
    """ms-swift's ``swift`` command: the one beside ``MMEMBED_SWIFT_PYTHON`` (a Python with ms-swift,
    usually a venv of its own, as make_fixtures.py's, since ms-swift pins other transformers and
    PEFT versions), else the one beside this Python when ms-swift is installed here; the test
    that needs it is skipped, saying why, when there is none."""
    import importlib.util
    import sys

    python = os.environ.get("MMEMBED_SWIFT_PYTHON")
    if not python and importlib.util.find_spec("swift") is None:
        pytest.skip("ms-swift is not installed here (no `swift` module; or name a Python that has it in "
                    "MMEMBED_SWIFT_PYTHON, e.g. ../swift-venv/bin/python, the venv make_fixtures.py's docstring makes beside the repository)")
    command = os.path.join(os.path.dirname(python or sys.executable), "swift")
    if not os.access(command, os.X_OK):
        pytest.skip(f"ms-swift's `swift` command is not at {command}")
    return command


@pytest.mark.parametrize("name", ["qwen3_emb", "qwen2_gme"])
def test_swift_export_merges_an_mmembed_adapter_as_mmembed_export_does(name, mmembed_checkpoint, tmp_path):
    """The two commands of docs/checkpoints.md side by side: ``swift export --adapters CKPT --model BASE
    --model_type NAME --task_type embedding --merge_lora true`` (ms-swift's own, run here where
    ms-swift is installed) and ``mmembed export --adapters CKPT --merge_lora true`` write folders
    that transformers loads with the same weights, and that embed the same (mmembed's
    embeddings of the checkpoint, which differ from the base model's)."""
    import subprocess

    from transformers import AutoModel

    from mmembed import Embedder
    from mmembed.tools.cli import main

    swift = swift_command()
    ckpt, base = mmembed_checkpoint(name)
    ours, theirs = str(tmp_path / "mmembed-merged"), str(tmp_path / "swift-merged")
    assert main(["export", "--adapters", ckpt, "--merge_lora", "true", "--output_dir", ours]) == 0
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)  # ms-swift's venv imports its own packages
    proc = subprocess.run([swift, "export", "--adapters", ckpt, "--model", base, "--model_type", name,
                           "--task_type", "embedding", "--merge_lora", "true", "--output_dir", theirs,
                           "--torch_dtype", "float32"], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # transformers loads both as the backbone, with the same merged weights
    want, got = (AutoModel.from_pretrained(d, dtype=torch.float32).state_dict() for d in (ours, theirs))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=key)
    # and they embed as the checkpoint does
    inputs = swift_inputs(name, "mmembed_" + name)
    expected = Embedder.from_pretrained(ckpt, device="cpu").encode(inputs)
    for folder in (ours, theirs):
        np.testing.assert_allclose(Embedder.from_pretrained(folder, device="cpu").encode(inputs), expected, atol=1e-5,
                                   err_msg=folder)
    assert np.abs(cached_embedder(base).encode(inputs) - expected).max() > 1e-3


def test_adapter_for_another_model_is_an_error(swift_checkpoint, tiny_model):
    from mmembed.model.adapters import AdapterMismatchError, load_lora
    from mmembed.model.embedding import load_backbone

    ckpt, _ = swift_checkpoint("qwen2_gme")
    with pytest.raises(AdapterMismatchError, match="does not have"):
        load_lora(load_backbone(tiny_model("qwen3")), ckpt)


def test_resume_refuses_an_swift_checkpoint_saying_what_it_is(swift_checkpoint):
    from mmembed.training.checkpoints import check_complete

    ckpt, _ = swift_checkpoint("qwen3_emb")
    with pytest.raises(ValueError, match=r"an ms-swift checkpoint \(args.json: --model_type qwen3_emb, --tuner_type lora"):
        check_complete(ckpt)


ORDERS = json.load(open(os.path.join(FIXTURES, "orders.json"))) if os.path.isfile(os.path.join(FIXTURES, "orders.json")) else {}


def _row_id(sample) -> int:
    return int(sample.anchor.text.split(":", 1)[0].removeprefix("id "))


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_rows_of_every_step_and_the_split_are_ms_swifts(name, tiny_model, tmp_path, monkeypatch):
    """mmembed's trainer, given ms-swift's flags, feeds the rows of every step in ms-swift's
    order (its dataset shuffle, split, #N sampling and sampler, epoch by epoch)."""
    from mmembed.training.arguments import SftArguments
    from mmembed.training.sft import build_trainer

    run = ORDERS[name]
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    args = SftArguments(model=tiny_model("qwen3"), output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                        gradient_accumulation_steps=1, report_to=[], **_flags(run["flags"]))
    trainer = build_trainer(args)
    trainer.data_collator = lambda samples: samples  # the rows themselves
    loader = trainer.get_train_dataloader()
    steps = []
    for epoch in range(int(args.num_train_epochs)):
        # as transformers' training loop announces each epoch
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        steps += [[_row_id(s) for s in batch] for batch in loader]
    # ms-swift evaluated once at the end: the recorded rows are the training steps', then the
    # validation rows in order
    recorded = [i for step in run["steps"] for i in step]
    trained = [i for step in steps for i in step]
    assert trained == recorded[:len(trained)]
    val = trainer.eval_dataset
    val_ids = [_row_id(val[i]) for i in range(len(val))] if val is not None else []
    assert val_ids == recorded[len(trained):]
    assert val_ids == run["val"]  # the val_dataset.jsonl ms-swift wrote: the same rows in the same order
    assert ("--split_dataset_ratio" in run["flags"]) == bool(val_ids)


def _flags(flags: list[str]) -> dict:
    """ms-swift's command-line flags as SftArguments keywords."""
    out, key = {}, None
    for token in flags:
        if token.startswith("--"):
            key = token[2:]
            out[key] = []
        else:
            out[key].append(token)
    conv = {"dataset": list, "num_train_epochs": lambda v: float(v[0]), "split_dataset_ratio": lambda v: float(v[0]),
            "dataset_shuffle": lambda v: v[0] == "true", "train_dataloader_shuffle": lambda v: v[0] == "true",
            "data_seed": lambda v: int(v[0]), "seed": lambda v: int(v[0])}
    return {k: conv[k](v) for k, v in out.items()}


@pytest.mark.parametrize("name, dataset", [("qwen3_emb", "text.jsonl"), ("qwen2_gme", "gme.jsonl")])
def test_resume_only_model_goes_on_from_an_swift_checkpoint(name, dataset, swift_checkpoint, tmp_path, monkeypatch):
    """--resume_only_model takes ms-swift's LoRA checkpoint: its adapter weights (with learning
    rate 0 the run ends with ms-swift's embeddings) and its step count (trainer_state.json)."""
    from mmembed import Embedder
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    ckpt, base = swift_checkpoint(name)
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    result = run_sft(parse_sft_args([
        "--model", base, "--model_type", name, "--dataset", dataset, "--tuner_type", "lora",
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--per_device_train_batch_size", "2",
        "--max_steps", "5", "--learning_rate", "0", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
        "--resume_from_checkpoint", ckpt, "--resume_only_model", "true"]))
    assert result["last_checkpoint"].endswith("checkpoint-5")
    state = json.load(open(os.path.join(result["last_checkpoint"], "trainer_state.json")))
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4, 5]
    got = Embedder.from_pretrained(result["last_checkpoint"], device="cpu").encode(swift_inputs(name))
    np.testing.assert_allclose(got, np.load(os.path.join(FIXTURES, name, "embeddings.npy")), atol=1e-5)
    # the adapter mmembed wrote has ms-swift's key layout and the adapter_config.json fields
    # ms-swift and PEFT read, as ms-swift wrote them for the same model and LoRA settings
    from safetensors import safe_open

    def keys(folder):
        with safe_open(os.path.join(folder, "adapter_model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert keys(result["last_checkpoint"]) == keys(ckpt)
    ours, theirs = (json.load(open(os.path.join(d, "adapter_config.json"))) for d in (result["last_checkpoint"], ckpt))
    for field in ("peft_type", "task_type", "r", "lora_alpha", "base_model_name_or_path", "use_dora", "use_rslora",
                  "bias", "auto_mapping"):
        assert ours.get(field) == theirs.get(field), field
    assert not ours.get("modules_to_save") and not theirs.get("modules_to_save")
    if isinstance(theirs["target_modules"], list):  # (GME's is a regex over the language model: the keys say it)
        assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


ORDERS_2PROC = (json.load(open(os.path.join(FIXTURES, "orders_2proc.json")))
                if os.path.isfile(os.path.join(FIXTURES, "orders_2proc.json")) else {})


@pytest.mark.parametrize("name", sorted(ORDERS_2PROC))
def test_each_process_reads_the_rows_ms_swift_gives_it(name, tiny_model, tmp_path, monkeypatch):
    """Under two processes ms-swift hands process r every second row of each epoch's order from
    r (the odd row out sits the epoch out); mmembed's trainer, told it is process r of 2, gives
    the same rows in the same batches. The recorded rows are ms-swift's own (torchrun, gloo)."""
    import mmembed.training.samplers as samplers_module
    from mmembed.training.arguments import SftArguments
    from mmembed.training.sft import build_trainer

    run = ORDERS_2PROC[name]
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    args = SftArguments(model=tiny_model("qwen3"), output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                        gradient_accumulation_steps=1, report_to=[], **_flags(run["flags"]))
    trainer = build_trainer(args)
    dataset = trainer.train_dataset
    for rank, recorded in enumerate(run["steps_per_process"]):
        monkeypatch.setattr(samplers_module, "world", lambda rank=rank: (rank, 2))
        sampler = trainer._get_train_sampler()
        steps = []
        for epoch in range(int(args.num_train_epochs)):
            sampler.set_epoch(epoch)
            rows = [_row_id(dataset[i]) for i in sampler]
            steps += [rows[i:i + 2] for i in range(0, len(rows), 2)]
        assert steps == recorded, f"process {rank}"



def test_two_real_processes_read_the_rows_ms_swift_gives_them(tiny_model, tmp_path):
    """The same under torchrun: each process's training dataloader (accelerate's wrapping
    passing the sampler's share through) gives ms-swift's recorded rows."""
    from conftest import launch

    run = ORDERS_2PROC["two_processes"]
    out = tmp_path / "rows"
    launch([os.path.join(REPO, "tests", "order_worker.py"), "--model", tiny_model("qwen3"), "--out", str(out),
            "--flags", json.dumps(_flags(run["flags"]))], nproc=2, cwd=os.path.join(FIXTURES, "data"))
    for rank, recorded in enumerate(run["steps_per_process"]):
        assert json.load(open(f"{out}.{rank}")) == recorded, f"process {rank}"


def test_two_processes_share_a_stream_batch_by_batch(tiny_model, tmp_path, monkeypatch):
    """--streaming under torchrun: each process reads the stream and keeps its part of every
    global batch (accelerate's IterableDatasetShard: process r takes rows [2r, 2r + 2) of each
    4; the last global batch is completed from the stream's start), so together they train
    each row once and never the same row in one step."""
    from conftest import launch

    from mmembed.data.streaming import stream_samples

    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    flags = {"dataset": ["text.jsonl", "more.jsonl"], "streaming": True, "max_steps": 10}
    order = [_row_id(s) for s in stream_samples(flags["dataset"], strict=True, seed=42, shuffle=True, buffer_size=1000)]
    out = tmp_path / "rows"
    launch([os.path.join(REPO, "tests", "order_worker.py"), "--model", tiny_model("qwen3"), "--out", str(out),
            "--flags", json.dumps(flags)], nproc=2, cwd=os.path.join(FIXTURES, "data"))
    padded = order + order[:(-len(order)) % 4]
    for rank in range(2):
        expected = [padded[i + 2 * rank:i + 2 * rank + 2] for i in range(0, len(padded), 4)]
        assert json.load(open(f"{out}.{rank}")) == expected, f"process {rank}"


def _full_class_folder(name: str, base: str, out: str) -> str:
    """A plain model folder as ms-swift's full training saves one: the family's full class
    (``Qwen3ForCausalLM`` with its own ``lm_head``, GME's ``Qwen2VLForConditionalGeneration``)
    with other weights than ``base``, and ``base``'s tokenizer / processor files."""
    import transformers
    from transformers import AutoConfig

    os.makedirs(out)
    for f in os.listdir(base):
        if not f.endswith(".safetensors") and f != "config.json":
            shutil.copy(os.path.join(base, f), out)
    config = AutoConfig.from_pretrained(base)
    torch.manual_seed(7)
    if name == "qwen3_emb":
        config.tie_word_embeddings = False  # an lm_head of its own, which the embedding model leaves out
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = transformers.Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("name, dataset", [("qwen3_emb", "text.jsonl"), ("qwen2_gme", "gme.jsonl")])
def test_resume_only_model_takes_a_full_class_folder(name, dataset, tiny_model, tmp_path, monkeypatch):
    """--resume_only_model from an ms-swift full checkpoint, or any folder saved as the
    causal-LM / conditional-generation class: its backbone's weights are mapped as
    ``AutoModel.from_pretrained`` maps them (the full class's ``model.`` prefix taken off, its
    head left out). With learning rate 0 the run ends with that model's weights and embeddings,
    those transformers loads from the folder."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from mmembed import Embedder
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    base = tiny_model(KIND[name])
    full = _full_class_folder(name, base, str(tmp_path / "full"))
    if name == "qwen3_emb":
        assert "lm_head.weight" in load_file(os.path.join(full, "model.safetensors"))
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    result = run_sft(parse_sft_args([
        "--model", base, "--model_type", name, "--dataset", dataset, "--tuner_type", "full",
        "--per_device_train_batch_size", "2", "--max_steps", "1", "--learning_rate", "0", "--report_to", "none",
        "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--output_dir", str(tmp_path / "out"),
        "--resume_from_checkpoint", full, "--resume_only_model", "true"]))
    expected = AutoModel.from_pretrained(full).state_dict()
    saved = AutoModel.from_pretrained(result["last_checkpoint"]).state_dict()
    assert saved.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(saved[k], expected[k], rtol=0, atol=0, msg=k)
    inputs = swift_inputs(name)
    got = Embedder.from_pretrained(result["last_checkpoint"], device="cpu").encode(inputs)
    want = Embedder.from_pretrained(full, device="cpu").encode(inputs)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(want - cached_embedder(base).encode(inputs)).max() > 1e-3


def test_logged_learning_rate_is_the_steps_own_where_ms_swift_logs_the_next_steps(tiny_model, tmp_path, monkeypatch):
    """The schedule is ms-swift's (cosine from --learning_rate, no warmup): the rates ms-swift
    logged for steps 1-3 are the ones mmembed logs for steps 2-4. ms-swift's
    ``_maybe_log_save_evaluate`` reads the rate after the scheduler has stepped (the next
    step's); transformers, which mmembed's trainer uses, logs the rate the step trained with.
    Same flags as make_fixtures.py's run."""
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    common = dict(zip(META["common_flags"][::2], META["common_flags"][1::2]))
    common.pop("--save_only_model")  # (mmembed's checkpoints hold the weights anyway)
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    result = run_sft(parse_sft_args([
        "--model", tiny_model("qwen3"), "--model_type", "qwen3_emb", "--dataset", "text.jsonl", "--max_steps", "4",
        "--learning_rate", "5e-3", "--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true",
        *[x for kv in common.items() for x in kv]]))
    ours = [h["learning_rate"] for h in json.load(open(os.path.join(result["last_checkpoint"], "trainer_state.json")))
            ["log_history"] if "loss" in h]
    theirs = [h["learning_rate"] for h in json.load(open(os.path.join(FIXTURES, "qwen3_emb", "checkpoint-4",
                                                                      "trainer_state.json")))["log_history"] if "loss" in h]
    assert len(ours) == len(theirs) == 4
    assert ours[0] == pytest.approx(5e-3)
    assert ours[1:] == pytest.approx(theirs[:-1], rel=1e-9)
    assert theirs[-1] == 0.0  # the schedule's end, after the last step
