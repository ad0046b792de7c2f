"""A task is one object (mmembed.task): the names resolve once, each task's package supplies what
the shared run asks for, and the model folder's config.json is read once per run."""

import builtins
import os

import pytest
from conftest import stsb_pairs, write_jsonl

from mmembed.errors import UsageError
from mmembed.task import TASK_NAMES, all_tasks, canonical_task, get_task, pair_scorer_task, task_of_folder


def test_every_task_is_one_object_found_by_its_name_or_alias():
    assert TASK_NAMES == ("embedding", "reranker", "generative_reranker", "late_interaction")
    for task in all_tasks():
        assert get_task(task.name) is task and type(task).__module__.startswith("mmembed.tasks.")
    for alias in ("colbert", "ColBERT", "multi_vector", "colqwen"):
        assert get_task(alias) is get_task("late_interaction")
    with pytest.raises(UsageError, match=r"--task_type must be one of embedding, reranker, generative_reranker, "
                                         r"late_interaction \(or colbert, multi_vector, multivector, colqwen\), got 'seq_cls'"):
        canonical_task("seq_cls")
    assert get_task(None) is get_task("embedding")


def test_a_folder_says_its_task(minilm_path, tmp_path):
    assert task_of_folder(minilm_path).name == "embedding"  # a plain encoder: served as an embedding model
    with pytest.raises(UsageError, match=r"an embedding model \(its mmembed.json\), not a reranker; use mmembed embed"):
        (tmp_path / "mmembed.json").write_text('{"task_type": "embedding", "pooling": "mean"}')
        pair_scorer_task(str(tmp_path))
    st = tmp_path / "st"
    st.mkdir()
    (st / "config_sentence_transformers.json").write_text('{"model_type": "MultiVectorEncoder"}')
    assert task_of_folder(str(st)).name == "late_interaction"


def test_the_model_folders_config_is_read_once_before_the_weights_load(minilm_path, tmp_path, monkeypatch):
    """config.json of --model: read by the folder check, the template, the encoding's length and
    tokenizer, and the model load; opened once (the sentence-transformers Pooling module's own
    config.json, another file, aside)."""
    from transformers import AutoConfig

    from mmembed.model.embedding import model_config
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import build_trainer

    assert model_config(minilm_path).to_dict() == AutoConfig.from_pretrained(minilm_path).to_dict()
    # a copy of the folder, so that no earlier test's read of it is remembered
    folder = tmp_path / "minilm"
    folder.mkdir()
    for name in os.listdir(minilm_path):
        source = os.path.join(minilm_path, name)
        if os.path.isfile(source):
            os.symlink(source, folder / name)
        else:
            os.symlink(source, folder / name, target_is_directory=True)
    config = str(folder / "config.json")
    opened = []
    real_open = builtins.open

    def counting(file, *args, **kwargs):
        if str(file) == config:
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(8))
    for task in ("embedding", "late_interaction"):
        opened.clear()
        os.utime(config)  # a new modification time: read afresh for this run
        build_trainer(parse_sft_args(["--model", str(folder), "--task_type", task, "--dataset", data,
                                      "--output_dir", str(tmp_path / task), "--report_to", "none"]))
        assert len(opened) == 1, task
