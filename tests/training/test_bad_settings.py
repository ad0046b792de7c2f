"""Bad settings: every flag, option and variable of `mmembed sft` (and the other commands'
flags) with a value that cannot work ends the command with one line naming it and its value,
exit status 2 (1 for the user's data or disk), no traceback, and the model never loaded.

Table-driven and in-process: ``mmembed.tools.cli.main`` runs each row with the model loaders
replaced by one that raises :class:`ModelLoaded`, so a check that comes too late fails the
row. Two rows run as real processes, end to end; ``--debug true`` / ``MMEMBED_DEBUG=1`` show
the traceback instead. A last test keeps the table honest: every flag mmembed declares (and
the training flags users commonly set) has a row here, or is listed as taking no bad value.
"""

import dataclasses
import os
import re

import pytest
from conftest import DATA, stsb_pairs, write_jsonl

from mmembed.errors import UsageError
from mmembed.tools.cli import main
from mmembed.training.arguments import SftArguments


class ModelLoaded(BaseException):
    """Raised by the patched loaders: a BaseException, so no handler of the command catches it."""


def row(*flags, env=None, code=2, names=None, id=None):
    """One bad setting: the flags (the first one is the flag under test) and/or variables, the
    exit status, and the words the error line must hold (default: the first flag or variable
    and its value)."""
    if names is None:
        if flags:
            names = (flags[0], flags[1]) if len(flags) > 1 else (flags[0],)
        else:
            var, value = next(iter(env.items()))
            names = (var, value)
    return pytest.param(list(flags), env or {}, code, names, id=id or " ".join([*flags, *(env or {})])[:60])


SFT_ROWS = [
    # batch and steps: settings that would divide by zero or train nothing
    row("--per_device_train_batch_size", "0"),
    row("--per_device_train_batch_size", "x"),  # argparse's own error, in one line
    row("--per_device_eval_batch_size", "0"),
    row("--gradient_accumulation_steps", "0"),
    row("--eval_accumulation_steps", "0"),
    row("--max_steps", "0"),
    row("--max_steps", "-5"),
    row("--num_train_epochs", "-1", "--max_steps", "-1"),
    row("--num_train_epochs", "nan", "--max_steps", "-1", id="--num_train_epochs nan"),
    row("--save_steps", "0"),
    row("--eval_steps", "0"),
    row("--logging_steps", "0"),
    row("--save_total_limit", "0"),
    row("--dataset_num_proc", "0"),
    row("--dataloader_num_workers", "-1"),
    row("--dataloader_prefetch_factor", "0", "--dataloader_num_workers", "1"),
    row("--dataloader_prefetch_factor", "2", names=("--dataloader_prefetch_factor", "2", "--dataloader_num_workers")),
    # 8 rows, fewer than one batch of 16: read, then refused before the model loads
    row("--dataloader_drop_last", "true", "--per_device_train_batch_size", "16",
        names=("--dataloader_drop_last", "8 training row(s)", "16")),
    row("--dataloader_drop_last", "true", "--packing", "true", "--packing_length", "64", "--per_device_train_batch_size",
        "16", names=("--dataloader_drop_last", "pack(s) of training rows (--packing)", "16")),
    row("--seed", "-1"),
    row("--data_seed", "-1"),
    # optimizer and schedule
    row("--learning_rate", "-1"),
    row("--learning_rate", "nan", id="--learning_rate nan"),
    row("--learning_rate", "inf"),
    row("--vit_lr", "-1"),
    row("--aligner_lr", "nan"),
    row("--weight_decay", "nan"),
    row("--adam_beta1", "2"),
    row("--adam_beta2", "1"),
    row("--adam_epsilon", "-1"),
    row("--max_grad_norm", "-1"),
    row("--warmup_ratio", "1.5"),
    row("--warmup_steps", "-1"),
    row("--lr_scheduler_type", "bogus"),
    row("--lr_scheduler_kwargs", "{bad"),
    row("--lr_scheduler_kwargs", "[1]"),
    row("--lr_scheduler_kwargs", '{"min_lr": 1e-6}', "--lr_scheduler_type", "cosine",
        names=("--lr_scheduler_kwargs", "'min_lr'", "cosine schedule", "num_cycles")),
    row("--metric_for_best_model", "bogus", "--split_dataset_ratio", "0.25"),
    row("--metric_for_best_model", "eval_bogus", "--split_dataset_ratio", "0.25"),
    row("--metric_for_best_model", "loss", "--eval_sts", "{sts}", names=("--metric_for_best_model", "loss",
                                                                          "eval_sts_spearman_cosine")),
    row("--optim", "bogus"),
    row("--eval_strategy", "bogus"),
    row("--save_strategy", "bogus"),
    row("--logging_strategy", "bogus"),
    row("--report_to", "bogus"),
    # model, template, tuning
    row("--model", "/nonexistent/model"),
    row("--model", "{empty}", names=("--model", "config.json")),
    row("--model", "{adapter}", names=("--model", "LoRA adapter")),
    row("--model_type", "bogus"),
    row("--template", "bogus"),
    row("--template", "/nonexistent/template.toml"),
    row("--task_type", "causal_lm"),
    row("--tuner_type", "qlora"),
    row("--train_type", "qlora"),
    row("--torch_dtype", "float64x"),
    row("--attn_impl", "bogus"),
    row("--padding_side", "middle"),
    row("--pooling", "median"),
    row("--truncation_strategy", "middle"),
    row("--max_length", "0"),
    row("--max_length", "100000"),  # beyond all-MiniLM's 512 position embeddings
    row("--length_chunks", "0"),
    row("--gradcache_mini_batch_size", "-1"),
    row("--zero_loss_patience", "-1"),
    row("--lora_rank", "0"),
    row("--lora_alpha", "0"),
    row("--lora_dropout", "2"),
    row("--lora_bias", "bogus"),
    row("--init_weights", "bogus"),
    row("--target_modules", "bogus"),
    row("--target_regex", "("),
    row("--target_regex", "bogus"),
    row("--modules_to_save", "bogus"),
    row("--adapters", "/nonexistent/adapter"),
    # QLoRA (--quant_method bnb --quant_bits 4): what bitsandbytes or the run cannot do
    row("--quant_method", "hqq", "--quant_bits", "4"),
    row("--quant_method", "gptq"),
    row("--quant_method", "bnb", names=("--quant_method bnb", "--quant_bits")),
    row("--quant_bits", "3", "--quant_method", "bnb"),
    row("--quant_bits", "4", names=("--quant_bits 4", "--quant_method bnb")),
    row("--quant_method", "bnb", "--quant_bits", "4", "--tuner_type", "full", names=("--quant_method bnb", "--tuner_type full")),
    row("--quant_method", "bnb", "--quant_bits", "4", "--deepspeed", "zero3", names=("--quant_method bnb", "zero3", "zero2")),
    row("--quant_method", "bnb", "--quant_bits", "4", "--task_type", "reranker", names=("--quant_method bnb", "reranker")),
    row("--bnb_4bit_quant_type", "int4", "--quant_method", "bnb", "--quant_bits", "4"),
    row("--bnb_4bit_compute_dtype", "float64", "--quant_method", "bnb", "--quant_bits", "4"),
    row("--bnb_4bit_quant_storage", "int3", "--quant_method", "bnb", "--quant_bits", "4"),
    row("--resume_only_model", "true"),
    row("--streaming", "true", "--max_steps", "-1", "--num_train_epochs", "1", names=("--streaming", "--max_steps")),
    row("--streaming", "true", "--loss_type", "distill_kl", "--teacher_scores_file", "t.npy",
        names=("--teacher_scores_file", "--streaming")),
    row("--shuffle_buffer_size", "0"),
    row("--streaming", "true", "--max_steps", "2", "--batch_sampler", "no_duplicates",
        names=("--streaming", "--batch_sampler no_duplicates")),
    row("--streaming", "true", "--max_steps", "2", "--multi_dataset_sampler", "proportional",
        names=("--multi_dataset_sampler proportional", "--streaming", "--dataset_config")),
    row("--streaming", "true", "--max_steps", "2", "--interleave_prob", "1", "1",
        names=("--interleave_prob", "2 probabilities for 1 dataset")),
    # the samplers (8 rows, one dataset): checked against the rows before the model loads
    row("--multi_dataset_sampler", "by_size"),
    row("--multi_dataset_sampler", "proportional", "--per_device_train_batch_size", "16",
        names=("--multi_dataset_sampler proportional", "8 training row(s)", "global batch of 16 rows")),
    row("--batch_sampler", "unique"),
    # --packing (ms-swift's packs of rows)
    row("--packing", "true", "--streaming", "true", "--max_steps", "2", names=("--packing true", "--streaming true")),
    row("--packing_length", "0"),
    row("--packing_strategy", "best"),
    row("--packing_num_proc", "0"),
    row("--check_media", "pixels"),
    row("--download_mode", "sometimes"),
    row("--interleave_prob", "1", "1", names=("--interleave_prob", "2 probabilities for 1 dataset")),
    row("--interleave_prob", "1", "--multi_dataset_sampler", "weighted",
        names=("--interleave_prob", "--multi_dataset_sampler weighted")),
    row("--stopping_strategy", "never"),
    row("--max_pixels", "0"),
    row("--sequence_parallel_size", "2"),
    row("--strict", "maybe"),  # a boolean that does not parse: argparse's error
    # loss
    row("--loss_type", "bogus"),
    row("--loss_kwargs", "x"),
    row("--loss_kwargs", '{"bogus": 1}'),
    row("--loss_kwargs", '{"temperature": -1}'),
    row("--loss_kwargs", '{"margin": 0.1}', "--loss_type", "cosine_similarity"),
    row("--mrl_dims", "x"),
    # late interaction: a value the task refuses, or a flag without --task_type late_interaction
    row("--late_interaction_dim", "0", "--task_type", "late_interaction"),
    row("--late_interaction_dim", "64", names=("--late_interaction_dim", "--task_type late_interaction")),
    row("--late_interaction_query_expansion", "pad", "--task_type", "late_interaction"),
    row("--late_interaction_query_length", "0", "--task_type", "late_interaction"),
    row("--late_interaction_attend_expansion", "true", "--late_interaction_query_expansion", "none",
        "--task_type", "late_interaction", names=("--late_interaction_attend_expansion", "none")),
    row("--late_interaction_skiplist", "commas", "--task_type", "late_interaction"),
    row("--late_interaction_normalize_scores", "true", names=("--late_interaction_normalize_scores", "late_interaction")),
    row("--mrl_dims", '{"4096": 1.0}', names=("--mrl_dims", "4096")),
    row("--guide_model", "/nonexistent/guide", "--loss_type", "gist"),
    row("--guide_model", "{minilm}", names=("--guide_model", "infonce")),  # a guide for a loss that takes none
    row("--teacher_model", "/nonexistent/teacher", "--loss_type", "distill_cosine"),
    # data, output, resuming
    row("--columns", "x"),
    row("--columns", "[1]"),
    row("--split_dataset_ratio", "1.0"),
    row("--deepspeed", "{bad_json}"),
    row("--deepspeed", "{bad"),
    row("--deepspeed", "zero9"),
    row("--resume_from_checkpoint", "/nonexistent/checkpoint-3"),
    row("--dataset", "/nonexistent/train.jsonl", code=1),
    row("--val_dataset", "/nonexistent/val.jsonl", code=1),
    row("--eval_sts", "/nonexistent/sts.jsonl", code=1),
    row("--eval_beir", "/nonexistent/beir", code=1),
    row("--eval_beir_first_stage", "/nonexistent/embedder", names=("--eval_beir_first_stage", "a reranker's")),
    # beside the rows' --dataset (the file's own checks: tests/data/test_dataset_config.py)
    row("--dataset_config", "{file}", names=("--dataset and --dataset_config {file}", "use one")),
    row("--teacher_embeddings_file", "/nonexistent/t.npy", "--loss_type", "distill_cosine", code=1),
    row("--teacher_scores_file", "/nonexistent/t.npy", "--loss_type", "distill_kl", "--loss_kwargs",
        '{"use_batch": false}', code=1),
    row("--output_dir", "{file}/out", code=1, names=("cannot write", "{file}/out")),  # not a folder: as read-only
    # the INFONCE_* variables
    row(env={"INFONCE_TEMPERATURE": "abc"}),
    row(env={"INFONCE_TEMPERATURE": "0"}),
    row(env={"INFONCE_TEMPERATURE": "-1"}),
    row(env={"INFONCE_TEMPERATURE": "nan"}),
    row(env={"INFONCE_USE_BATCH": "maybe"}),
    row(env={"INFONCE_HARD_NEGATIVES": "-1"}),
    row(env={"INFONCE_HARD_NEGATIVES": "0"}),
    row(env={"INFONCE_HARD_NEGATIVES": "x"}),
    row(env={"INFONCE_MASK_FAKE_NEGATIVE": "maybe"}),
    row(env={"INFONCE_FAKE_NEG_MARGIN": "x"}),
    row(env={"INFONCE_FAKE_NEG_MARGIN": "nan"}),
    row(env={"INFONCE_INCLUDE_QQ": "maybe"}),
    row(env={"INFONCE_INCLUDE_DD": "2"}),
    # settings under which the rows (stsb pairs: no negatives) cannot train, or no row can
    row(env={"INFONCE_TEMPERATURE": "1e-30"}, names=("INFONCE_TEMPERATURE", "1e-30", "smallest usable value is 9.3133e-10")),
    row(env={"INFONCE_USE_BATCH": "false"}, names=("INFONCE_USE_BATCH=false", "no training row can train", "train.jsonl:1")),
    row(env={"INFONCE_HARD_NEGATIVES": "2"}, names=("INFONCE_HARD_NEGATIVES", "no training row can train", "train.jsonl:1")),
    row("--loss_kwargs", '{"temperature": 1e-12}', names=("--loss_kwargs", "1e-12", "9.3133e-10")),
    row("--loss_type", "cosine_similarity", env={"INFONCE_TEMPERATURE": "abc"},  # refused whatever the loss
        names=("INFONCE_TEMPERATURE", "abc")),
    # the media variables (MediaBudget.from_env), checked for text models too
    row(env={"MAX_PIXELS": "abc"}),
    row(env={"MAX_PIXELS": "0"}),
    row(env={"MAX_PIXELS": "inf"}),
    row(env={"MIN_PIXELS": "-1"}),
    row(env={"MIN_PIXELS": "5000", "MAX_PIXELS": "4000"}, names=("MIN_PIXELS", "5000", "MAX_PIXELS", "4000")),
    row(env={"VIDEO_MAX_PIXELS": "0"}),
    row(env={"VIDEO_MIN_PIXELS": "x"}),
    row(env={"VIDEO_TOTAL_PIXELS": "0"}),
    row(env={"FPS": "0"}),
    row(env={"FPS": "nan"}),
    row(env={"FPS_MIN_FRAMES": "x"}),
    row(env={"FPS_MAX_FRAMES": "1"}),
    row(env={"FPS_MIN_FRAMES": "10", "FPS_MAX_FRAMES": "8"}, names=("FPS_MIN_FRAMES", "10", "FPS_MAX_FRAMES", "8")),
    row(env={"FORCE_QWENVL_VIDEO_READER": "opencv"}),
    # the launch variables (ms-swift's torchrun habit)
    row(env={"NPROC_PER_NODE": "abc"}),
    row(env={"NNODES": "0"}),
    row(env={"NNODES": "2", "NODE_RANK": "5"}, names=("NODE_RANK", "5")),
    row(env={"NPROC_PER_NODE": "2", "MASTER_PORT": "70000"}, names=("MASTER_PORT", "70000")),
    # the download variables (mmembed.encoding.remote), checked whether or not the data has URLs
    row(env={"MMEMBED_HTTP_TIMEOUT": "abc"}),
    row(env={"MMEMBED_HTTP_TIMEOUT": "0"}),
    row(env={"MMEMBED_MEDIA_MAX_BYTES": "-5"}),
    row(env={"MMEMBED_MEDIA_MAX_BYTES": "lots"}),
    row(env={"MMEMBED_OFFLINE": "maybe"}),
    row(env={"HF_HUB_OFFLINE": "sometimes"}),
    row(env={"USE_HF": "maybe"}),  # ms-swift's hub switch for hub dataset ids
    row(env={"MMEMBED_DEBUG": "maybe"}),
]

# mmembed's fields for which no value is bad (or a bad one is argparse's error, as --strict's row
# shows), each with the reason
NO_BAD_VALUE = {
    "system": "free text: any system prompt",
    "query_system": "free text: any instruction (an empty one means none on that side)",
    "document_system": "free text: any instruction (an empty one means none on that side)",
    "offline": "a boolean (see the --strict row); with it, a URL outside the media cache is a data error (exit 1)",
    "eval_beir_split": "a split name; its qrels file is read as data with --eval_beir (exit status 1)",
    "model_revision": "a revision name; one the hub does not have is the hub's one-line error (tests/test_hub.py)",
    **{flag: "a boolean: a value that does not parse is argparse's error (the --strict row)" for flag in (
        "freeze_vit", "freeze_aligner", "freeze_llm", "use_dora", "use_rslora", "use_chat_template", "padding_free", "length_buckets",
        "dataset_shuffle", "train_dataloader_shuffle", "val_dataset_shuffle", "lazy_tokenize", "load_from_cache_file",
        "overwrite_output_dir", "gradient_checkpointing", "logging_first_step", "remove_unused_columns", "use_hf",
        "bnb_4bit_use_double_quant")},
}

# transformers' training flags users commonly set, which the table must cover too
COMMON_TRAINING_FLAGS = (
    "num_train_epochs", "max_steps", "save_steps", "eval_steps", "logging_steps", "save_total_limit", "warmup_steps",
    "max_grad_norm", "adam_beta1", "adam_epsilon", "seed", "data_seed", "dataloader_num_workers",
    "eval_accumulation_steps", "save_strategy", "logging_strategy", "optim", "report_to", "deepspeed",
    "resume_from_checkpoint", "metric_for_best_model", "lr_scheduler_kwargs", "dataloader_prefetch_factor",
    "dataloader_drop_last",
)


@pytest.fixture(scope="module")
def places(tmp_path_factory, minilm_path):
    """The paths the rows name: data, a folder without config.json, an adapter-only folder,
    a plain file (an --output_dir under it cannot be created), a DeepSpeed file that is not JSON."""
    d = tmp_path_factory.mktemp("bad-settings")
    (d / "empty").mkdir()
    (d / "adapter").mkdir()
    (d / "adapter" / "adapter_config.json").write_text("{}")
    (d / "file").write_text("x")
    (d / "ds.json").write_text('{"zero_optimization": {"stage": 2},\n')
    with open(os.path.join(DATA, "stsb_test_scored.jsonl"), encoding="utf-8") as f:
        (d / "sts.jsonl").write_text("".join(next(f) for _ in range(8)))
    return {"{data}": write_jsonl(d / "train.jsonl", stsb_pairs(8)), "{empty}": str(d / "empty"),
            "{adapter}": str(d / "adapter"), "{file}": str(d / "file"), "{bad_json}": str(d / "ds.json"),
            "{minilm}": minilm_path, "{sts}": str(d / "sts.jsonl")}


@pytest.fixture
def run_sft_cli(places, minilm_path, tmp_path, monkeypatch, capsys):
    """``run(flags, env) -> (exit status, stderr lines)``: ``mmembed sft`` in this process, on
    all-MiniLM and 8 rows, with every model loader replaced by one that raises ModelLoaded."""
    import mmembed.model.embedder
    import mmembed.tools.export  # imported now: importing it under the patch would keep the fake for good
    import mmembed.training.model_assembly

    def loaded(*args, **kwargs):
        raise ModelLoaded("a model loaded before the bad setting was reported")

    monkeypatch.setattr(mmembed.training.model_assembly, "load_backbone", loaded)
    monkeypatch.setattr(mmembed.model.embedder, "load_embedding_model", loaded)
    monkeypatch.setattr(mmembed.tools.export, "load_embedding_model", loaded)
    saved = dict(os.environ)  # parsing may set variables (--max_pixels, DeepSpeed's rank 0 of 1, --debug)

    def run(flags, env, command="sft"):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        flags = [_fill(f, places) for f in flags]
        base = ["--model", minilm_path, "--dataset", places["{data}"], "--output_dir", str(tmp_path / "out"),
                "--max_steps", "1", "--report_to", "none"] if command == "sft" else []
        code = main([command, *base, *flags])
        err = capsys.readouterr().err
        return code, [line for line in err.splitlines() if line.strip()]

    yield run
    os.environ.clear()
    os.environ.update(saved)


def _fill(text: str, places: dict) -> str:
    for key, value in places.items():
        text = text.replace(key, value)
    return text


@pytest.mark.parametrize("flags, env, code, names", SFT_ROWS)
def test_a_bad_setting_is_one_line_before_the_model_loads(run_sft_cli, places, flags, env, code, names):
    try:
        status, lines = run_sft_cli(flags, env)
    except ModelLoaded:
        pytest.fail(f"{flags or env}: the model loaded before the error")
    assert status == code, lines
    # a check that needs the rows (--dataloader_drop_last) comes after reading them: their progress bars
    lines = [line for line in lines if not line.rstrip().endswith(("examples/s]", "it/s]"))]
    assert len(lines) == 1 and lines[0].startswith("mmembed sft: error: "), lines
    assert "Traceback" not in lines[0]
    for name in names:
        assert _fill(name, places) in lines[0], (name, lines[0])


OTHER_ROWS = [
    row("embed", "--model", "/nonexistent/model", "--input", "x.txt", "--output", "y.npy", names=("--model",)),
    row("embed", "--model", "{minilm}", "--input", "x.txt", "--output", "y.npy", "--batch_size", "0",
        names=("--batch_size", "0")),
    row("embed", "--model", "{minilm}", "--input", "x.txt", "--output", "y.npy", "--torch_dtype", "half",
        names=("--torch_dtype", "half")),
    row("embed", "--model", "{minilm}", "--input", "x.txt", names=("--output",)),  # argparse: one line
    row("embed", "--model", "{minilm}", "--input", "x.txt", "--output", "y.npy", env={"MAX_PIXELS": "abc"},
        names=("MAX_PIXELS", "abc")),
    row("embed", "--model", "{minilm}", "--input", "x.txt", "--output", "y.npy", env={"MMEMBED_HTTP_TIMEOUT": "soon"},
        names=("MMEMBED_HTTP_TIMEOUT", "soon")),  # the download variables too, parsed at the start with the budget
    row("eval", "--model", "{minilm}", names=("--sts", "--beir")),
    row("eval", "--model", "{minilm}", "--sts", "s.jsonl", "--batch_size", "0", names=("--batch_size", "0")),
    row("eval", "--model", "{empty}", "--sts", "s.jsonl", names=("--model", "config.json")),
    row("eval", "--model", "{minilm}", "--beir", "b", "--split", "bogus", names=("--split", "bogus")),
    row("embed", "--model", "{minilm}", "--input", "/nonexistent/x.txt", "--output", "y.npy", code=1,
        names=("--input", "/nonexistent/x.txt")),
    row("eval", "--model", "{minilm}", "--sts", "/nonexistent/s.jsonl", code=1, names=("--sts", "/nonexistent/s.jsonl")),
    row("mine", "--dataset", "/nonexistent/d.jsonl", "--output", "o.jsonl", code=1,
        names=("--dataset", "/nonexistent/d.jsonl")),
    row("mine", "--dataset", "{data}", "--output", "o.jsonl", "--num_negatives", "0", names=("--num_negatives", "0")),
    row("mine", "--dataset", "{data}", "--output", "o.jsonl", "--range_min", "5", "--range_max", "5",
        names=("--range_min", "5")),
    row("mine", "--dataset", "{data}", "--output", "o.jsonl", "--margin", "nan", names=("--margin", "nan")),
    row("mine", "--dataset", "{data}", "--output", "o.csv", names=("--output", "o.csv")),
    row("mine", "--dataset", "{data}", "--output", "o.jsonl", "--model", "/nonexistent/model",
        names=("--model", "/nonexistent/model")),
    row("export", "--adapters", "/nonexistent/ckpt", names=("--adapters", "/nonexistent/ckpt")),
    row("export", "--adapters", "{adapter}", "--merge_lora", "false", names=("--merge_lora", "false")),
    row("serve", "--model", "{minilm}", "--max_batch_size", "0", names=("--max_batch_size", "0")),
    row("serve", "--model", "{minilm}", "--port", "70000", names=("--port", "70000")),
    row("serve", "--model", "/nonexistent/model", names=("--model", "/nonexistent/model")),
]


@pytest.mark.parametrize("flags, env, code, names", OTHER_ROWS)
def test_the_other_commands_report_bad_flags_the_same_way(run_sft_cli, places, monkeypatch, flags, env, code, names):
    import mmembed.tools.export
    import mmembed.tools.mining
    import mmembed.tools.serve

    def loaded(*args, **kwargs):
        raise ModelLoaded("the command went to work before the bad flag was reported")

    for module, name in ((mmembed.tools.serve, "serve"), (mmembed.tools.mining, "mine_file"),
                         (mmembed.tools.export, "export_checkpoint")):
        monkeypatch.setattr(module, name, loaded)
    command, flags = flags[0], flags[1:]
    try:
        status, lines = run_sft_cli(flags, env, command)
    except ModelLoaded:
        pytest.fail(f"{command} {flags}: started work before the error")
    assert status == code, lines
    assert len(lines) == 1 and lines[0].startswith(f"mmembed {command}: error: "), lines
    for name in names:
        assert _fill(name, places) in lines[0], (name, lines[0])


# ---- end to end, and --debug ------------------------------------------------------------------


def _cli(args, env=None):
    """``mmembed ARGS`` in a process of its own (forked from the tests' server, tests/forked_cli.py)."""
    from forked_cli import run_cli

    return run_cli(list(args), env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=300)


@pytest.mark.parametrize("flags, env", [(["--gradient_accumulation_steps", "0"], {}),
                                        ([], {"INFONCE_TEMPERATURE": "abc"})], ids=["flag", "variable"])
def test_a_real_process_exits_2_with_one_line(places, minilm_path, tmp_path, flags, env):
    r = _cli(["sft", "--model", minilm_path, "--dataset", places["{data}"], "--output_dir", str(tmp_path / "out"),
              *flags], env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("mmembed sft: error: "), r.stderr
    assert (flags[0] if flags else "INFONCE_TEMPERATURE='abc'") in r.stderr
    assert not (tmp_path / "out").exists()  # nothing touched


def test_debug_shows_the_traceback(places, minilm_path, tmp_path, monkeypatch):
    r = _cli(["sft", "--model", minilm_path, "--dataset", places["{data}"], "--lora_rank", "0", "--debug", "true",
              "--output_dir", str(tmp_path / "out")])
    assert r.returncode != 0 and "Traceback" in r.stderr
    assert "UsageError: --lora_rank must be an integer >= 1, got 0" in r.stderr
    # transformers' own --debug takes other values; those are left to it
    from mmembed.tools.cli import take_debug

    monkeypatch.delenv("MMEMBED_DEBUG", raising=False)
    assert take_debug(["--debug", "underflow_overflow"]) == (["--debug", "underflow_overflow"], False)
    assert take_debug(["--x", "1", "--debug"]) == (["--x", "1"], True)
    # MMEMBED_DEBUG=1, any command: the error propagates (Python prints its traceback)
    monkeypatch.setenv("MMEMBED_DEBUG", "1")
    with pytest.raises(UsageError, match="--batch_size must be an integer >= 1, got 0"):
        main(["embed", "--model", minilm_path, "--input", "x.txt", "--output", "y.npy", "--batch_size", "0"])


def test_ctrl_c_is_one_line_and_exit_130(run_sft_cli, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) wherever the command is: one line, exit status 130 (the
    shell's code for SIGINT), no traceback."""
    import mmembed.training.model_assembly

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmembed.training.model_assembly, "load_backbone", interrupted)
    status, lines = run_sft_cli([], {})
    # the data phases' progress bars come before the model loads (shown or not, as `datasets`' switch was left)
    lines = [line for line in lines if not re.search(r"\d+%\|", line)]
    assert status == 130 and lines == ["mmembed sft: interrupted (Ctrl-C)"], lines


def test_learning_rate_0_stays_allowed(places, minilm_path, tmp_path):
    """--learning_rate 0 trains nothing on purpose (a run that loads weights and saves them
    unchanged); it is not refused as a setting that trains nothing."""
    from mmembed.training.arguments import parse_sft_args

    args = parse_sft_args(["--model", minilm_path, "--dataset", places["{data}"], "--output_dir",
                           str(tmp_path / "out"), "--learning_rate", "0"])
    assert args.learning_rate == 0.0


# ---- the table covers every flag -----------------------------------------------------------------


def test_every_flag_has_a_bad_value_row_or_is_listed_as_having_none():
    """mmembed's own fields of SftArguments (and its overrides of transformers' defaults),
    and the training flags users commonly set: a new flag fails here until it gets a row or a
    reason in NO_BAD_VALUE."""
    tested = {p.values[0][0].lstrip("-") for p in SFT_ROWS if p.values[0]}
    own = {name for cls in SftArguments.__mro__ if cls.__module__.startswith("mmembed.")
           for name in vars(cls).get("__annotations__", {})}  # SftFlags' fields and SftArguments' own
    declared = own & {f.name for f in dataclasses.fields(SftArguments)}
    missing = sorted((declared | set(COMMON_TRAINING_FLAGS)) - tested - set(NO_BAD_VALUE))
    assert not missing, f"no bad-value row and no reason in NO_BAD_VALUE: {missing}"
    assert not set(NO_BAD_VALUE) & tested, "a flag with a row is not one without bad values"
    stale = sorted(set(NO_BAD_VALUE) - declared)
    assert not stale, f"NO_BAD_VALUE names flags SftArguments no longer has: {stale}"
    # every variable ms-swift's scripts set for the loss and the media has a row too
    from mmembed.losses.config import ENV_VARS

    variables = {var for p in SFT_ROWS for var in p.values[1]}
    media = {"MAX_PIXELS", "MIN_PIXELS", "VIDEO_MAX_PIXELS", "VIDEO_MIN_PIXELS", "VIDEO_TOTAL_PIXELS", "FPS",
             "FPS_MIN_FRAMES", "FPS_MAX_FRAMES", "FORCE_QWENVL_VIDEO_READER"}
    downloads = {"MMEMBED_HTTP_TIMEOUT", "MMEMBED_MEDIA_MAX_BYTES", "MMEMBED_OFFLINE", "HF_HUB_OFFLINE"}
    assert set(ENV_VARS.values()) | media | downloads <= variables, sorted(
        set(ENV_VARS.values()) | media | downloads - variables)
