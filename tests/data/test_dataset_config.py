"""--dataset_config: the file's checks, the rows each dataset gives (sample: N, instructions,
dataset ids), per-dataset loss settings against the same settings as global variables, and a
short real run's loss_<name> logs and eval_<name>_* metrics."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import stsb_pairs, write_jsonl

from mmembed.data.dataset_config import ConfigError, read_dataset_config
from mmembed.data.specs import sample_indices
from mmembed.errors import UsageError
from mmembed.training.arguments import parse_sft_args

PAIRS = stsb_pairs(60)


def hardneg_rows(start: int, n: int, negatives: int = 3) -> list[dict]:
    """Query-form rows with ``negatives`` hard negatives each (other rows' responses)."""
    rows = []
    for i in range(start, start + n):
        p = PAIRS[i]
        negs = [PAIRS[(i + 11 + 7 * k) % len(PAIRS)]["response"] for k in range(negatives)]
        rows.append({"query": p["query"], "response": p["response"], "rejected_response": negs})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsconf")
    write_jsonl(d / "hn.jsonl", hardneg_rows(0, 8))
    write_jsonl(d / "hn_val.jsonl", hardneg_rows(40, 4))
    write_jsonl(d / "pairs.jsonl", [{"query": p["query"], "response": p["response"]} for p in PAIRS[20:28]])
    write_jsonl(d / "pairs_val.jsonl", [{"query": p["query"], "response": p["response"]} for p in PAIRS[50:54]])
    # a row with its own system: the dataset's instruction must not replace it
    write_jsonl(d / "own.jsonl", [{"messages": [{"role": "system", "content": "ROW SYSTEM"},
                                                {"role": "user", "content": PAIRS[30]["query"]},
                                                {"role": "assistant", "content": PAIRS[30]["response"]}]},
                                  {"query": PAIRS[31]["query"], "response": PAIRS[31]["response"]}])
    return d


def write_config(path, datasets, as_json=False) -> str:
    if as_json:
        path.write_text(json.dumps({"datasets": datasets}))
    else:
        import yaml

        path.write_text(yaml.safe_dump({"datasets": datasets}))
    return str(path)


# ----------------------------------------------------------------------------- the file's checks


@pytest.mark.parametrize("entry, key, words", [
    ({"name": "a", "path": "hn.jsonl", "weigth": 2}, "weigth", "unknown key"),
    ({"name": "a", "path": "missing.jsonl"}, "path", "no such file"),
    ({"name": "a", "path": "hn.jsonl", "weight": 0}, "weight", "> 0"),
    ({"name": "a", "path": "hn.jsonl", "sample": -3}, "sample", ">= 1"),
    ({"name": "a", "path": "hn.jsonl", "infonce": {"temprature": 0.1}}, "infonce.temprature", "not an InfoNCE"),
    ({"name": "a", "path": "hn.jsonl", "query_system": 3}, "query_system", "string"),
    ({"name": "a b", "path": "hn.jsonl"}, "name", "letters"),
    ({"name": "a", "path": "hn.jsonl", "val": ["nope.jsonl"]}, "val", "no such file"),
], ids=["unknown", "path", "weight", "sample", "infonce-key", "system", "name", "val"])
def test_a_bad_entry_is_one_error_naming_the_file_the_dataset_and_the_key(data, tmp_path, entry, key, words):
    """(The ``infonce`` keys are the loss's: checked by the function training passes.)"""
    from mmembed.losses.config import infonce_keys

    cfg = write_config(data / f"bad_{key.replace('.', '_')}.yaml",
                       [{"name": "good", "path": "pairs.jsonl"}, entry])
    with pytest.raises(ConfigError) as e:
        read_dataset_config(cfg, check_infonce=infonce_keys)
    msg = str(e.value)
    assert cfg in msg and f"dataset {entry['name']}" in msg and f"key '{key}'" in msg and words in msg, msg
    assert e.value.file == cfg and e.value.dataset == entry["name"] and e.value.key == key


def test_file_level_errors_name_the_file(data):
    dup = write_config(data / "dup.json", [{"name": "x", "path": "hn.jsonl"}, {"name": "x", "path": "pairs.jsonl"}],
                       as_json=True)
    with pytest.raises(ConfigError, match=r"dup.json: dataset x, key 'name': given to two datasets"):
        read_dataset_config(dup)
    broken = data / "broken.yaml"
    broken.write_text("datasets:\n  - name: a\n    path: [hn.jsonl\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML .*line"):
        read_dataset_config(str(broken))
    nameless = write_config(data / "nameless.yaml", [{"path": "hn.jsonl"}])
    with pytest.raises(ConfigError, match=r"dataset #1, key 'name'"):
        read_dataset_config(nameless)


def test_entries_read_as_written_relative_to_the_file(data):
    cfg = write_config(data / "ok.yaml", [
        {"name": "hn", "path": "hn.jsonl", "weight": 3, "query_system": "Q", "document_system": "D",
         "infonce": {"use_batch": False, "INFONCE_HARD_NEGATIVES": 2, "temperature": 0.02}, "val": "hn_val.jsonl"},
        {"name": "pairs", "path": ["pairs.jsonl", "own.jsonl"], "sample": 5, "loss_kwargs": {}},
    ])
    hn, pairs = read_dataset_config(cfg)
    assert hn.paths == [str(data / "hn.jsonl")] and hn.val == [str(data / "hn_val.jsonl")] and hn.weight == 3.0
    assert hn.infonce == {"use_batch": False, "INFONCE_HARD_NEGATIVES": 2, "temperature": 0.02}  # as written
    from mmembed.losses.config import infonce_values

    assert infonce_values(hn.infonce) == {"use_batch": False, "hard_negatives": 2, "temperature": 0.02}
    assert (hn.query_system, hn.document_system) == ("Q", "D") and hn.specs() == [str(data / "hn.jsonl")]
    assert pairs.paths == [str(data / "pairs.jsonl"), str(data / "own.jsonl")] and pairs.weight == 1.0
    assert not pairs.has_loss_settings and hn.has_loss_settings


def test_a_relative_path_falls_back_to_the_working_directory(data, monkeypatch):
    (data / "sub").mkdir(exist_ok=True)
    cfg = write_config(data / "sub" / "cwd.yaml", [{"name": "hn", "path": "hn.jsonl"}])
    with pytest.raises(ConfigError, match="no such file or folder: 'hn.jsonl'"):
        read_dataset_config(cfg)
    monkeypatch.chdir(data)
    assert read_dataset_config(cfg)[0].paths == [str(data / "hn.jsonl")]


def _argv(model, *extra):
    return ["--model", model, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--max_length", "64", "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", *extra]


def test_flags_beside_the_config(minilm_path, data, tmp_path):
    cfg = write_config(data / "flags.yaml", [{"name": "hn", "path": "hn.jsonl"}])
    with pytest.raises(UsageError, match="--dataset and --dataset_config .* both give training data: use one"):
        parse_sft_args(_argv(minilm_path, "--dataset", str(data / "pairs.jsonl"), "--dataset_config", cfg))
    with pytest.raises(UsageError, match="--val_dataset cannot be used with --dataset_config"):
        parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--val_dataset", str(data / "pairs.jsonl")))
    bad = write_config(data / "flags_bad.yaml", [{"name": "hn", "path": "hn.jsonl", "colour": 1}])
    with pytest.raises(UsageError, match=r"flags_bad.yaml: dataset hn, key 'colour': unknown key"):
        parse_sft_args(_argv(minilm_path, "--dataset_config", bad))
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path)))
    assert [e.name for e in args.dataset_entries] == ["hn"] and str(args.eval_strategy) in ("no", "IntervalStrategy.NO")
    with pytest.raises(UsageError, match="--eval_beir a b=c: with several folders name each one"):
        parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--eval_beir", "a", "b=c"))


# ----------------------------------------------------------------------------- the rows


def _load(args):
    from mmembed.training.data_assembly import TrainingData
    from mmembed.training.model_assembly import Encoding, make_loss
    from mmembed.training.preflight import media_settings

    return TrainingData.load(args, Encoding.resolve(args), make_loss(args), media_settings(args))


def test_rows_ids_instructions_and_sample(minilm_path, data, tmp_path, caplog):
    """Each dataset's rows carry its index; sample: N over two files draws as #N over their
    rows together; instructions apply to the texts without a system of their own, where the
    rows are rendered (the rows are not rewritten); val rows are tagged too; the start-up report shows each dataset's rows, share and rendered texts."""
    import logging

    from mmembed.data import load_samples

    cfg = write_config(data / "rows.yaml", [
        {"name": "hn", "path": "hn.jsonl", "query_system": "Q-HN", "document_system": "D-HN", "val": "hn_val.jsonl"},
        {"name": "mix", "path": ["pairs.jsonl", "own.jsonl"], "sample": 6, "query_system": "Q-MIX"},
        {"name": "one", "path": "pairs.jsonl", "sample": 3},
    ])
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path),
                                "--dataset_shuffle", "false"))
    with caplog.at_level(logging.INFO, logger="mmembed"):
        got = _load(args)
    report = next(r.getMessage() for r in caplog.records if "training datasets" in r.getMessage())
    assert "3 training datasets (--multi_dataset_sampler mixed" in report
    assert "hn: 8 rows (+4 val), weight 1, expected share 47.1%" in report  # 8 of 17 rows
    assert "one: 3 rows, weight 1, expected share 17.6%" in report
    # MiniLM's template puts a system prompt in front of the text ('{system} {content}')
    assert f"query:    'Q-HN {PAIRS[0]['query']}'" in report and f"document: 'D-HN {PAIRS[0]['response']}'" in report
    ids = got.train.dataset_ids
    assert ids.dtype == np.int64 and len(ids) == len(got.train) == 8 + 6 + 3
    assert [(d.name, d.rows, d.val_rows) for d in got.datasets] == [("hn", 8, 4), ("mix", 6, 0), ("one", 3, 0)]
    samples = [got.train[i] for i in range(len(got.train))]
    assert [s.dataset_id for s in samples] == ids.tolist() == [0] * 8 + [1] * 6 + [2] * 3
    # sample: 6 over pairs.jsonl (8 rows) + own.jsonl (2 rows): #N's draw over the 10 rows together
    both = load_samples([str(data / "pairs.jsonl"), str(data / "own.jsonl")], seed=args.data_seed + 1).dataset
    want = [both[int(i)]["line"] for i in sample_indices(10, 6, np.random.RandomState(args.data_seed + 1), False)]
    assert [s.line for s in samples[8:14]] == want
    # the single-path #N is ms-swift's own path#3
    assert [s.anchor.text for s in samples[14:]] == [p["query"] for p in PAIRS[20:23]]
    # the instructions are not written into the rows: only a row's own system is there
    assert all(x.system is None for s in samples[:8] + samples[14:] for x in (s.anchor, *s.positives, *s.negatives))
    own = [s for s in samples[8:14] if s.source.endswith("own.jsonl")]
    assert [s.anchor.system for s in own] == ["ROW SYSTEM" if s.line == 1 else None for s in own]
    # they are applied where the rows are rendered: the collator's inputs, against the tokenizer
    # on the text written out (MiniLM's template: '{system} {content}'). Query side and document
    # side; a row's own system wins; none where none is given
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.instructions import Instructions
    from mmembed.encoding.layout import Layout
    from mmembed.training.model_assembly import Encoding

    enc = Encoding.resolve(args)
    collator = EmbeddingCollator(enc.template, enc.processing, Layout.GROUP, 64, with_dataset_ids=True,
                                 instructions=Instructions.of(args.dataset_entries))

    def fed(sample) -> list[list[int]]:
        batch = collator([sample])
        return [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]

    def written(sample, query: str | None, document: str | None) -> list[list[int]]:
        texts = [(sample.anchor.system or query, sample.anchor.text)]
        texts += [(document, x.text) for x in (*sample.positives, *sample.negatives)]
        return [enc.processing(f"{system} {text}" if system else text)["input_ids"] for system, text in texts]

    for s in samples[:8]:
        assert fed(s) == written(s, "Q-HN", "D-HN")
    for s in samples[8:14]:
        assert fed(s) == written(s, "Q-MIX", None)
    for s in samples[14:]:
        assert fed(s) == written(s, None, None)
    assert got.val.dataset_ids.tolist() == [0] * 4 and fed(got.val[0]) == written(got.val[0], "Q-HN", "D-HN")
    # the collator hands the ids on
    batch = collator(samples[6:10])
    assert batch["dataset_ids"].tolist() == [0, 0, 1, 1] and batch["dataset_ids"].dtype == torch.long


def test_the_length_check_measures_each_row_with_its_datasets_instructions(minilm_path, data, tmp_path):
    """The same rows in two datasets, one with a long query instruction: with
    --truncation_strategy delete the rows that the instruction takes over --max_length go from
    that dataset only, and exactly those (the tokenizer's count of the text written out)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    long = "Given a question about the scene described, find the sentence that describes the same scene"
    cfg = write_config(data / "long.yaml", [{"name": "plain", "path": "pairs.jsonl"},
                                            {"name": "long", "path": "pairs.jsonl", "query_system": long}])
    rows = PAIRS[20:28]
    with_long = [len(tok(f"{long} {p['query']}")["input_ids"]) for p in rows]
    alone = [max(len(tok(p["query"])["input_ids"]), len(tok(p["response"])["input_ids"])) for p in rows]
    limit = sorted(with_long)[len(with_long) // 2]  # about half the rows fit with the instruction
    assert max(alone) <= limit < max(with_long)
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path),
                                "--dataset_shuffle", "false", "--max_length", str(limit)))
    got = _load(args)
    assert [(d.name, d.rows) for d in got.datasets] == [("plain", 8), ("long", sum(n <= limit for n in with_long))]
    kept = [got.train[i].anchor.text for i in range(len(got.train)) if got.train[i].dataset_id == 1]
    assert kept == [p["query"] for p, n in zip(rows, with_long) if n <= limit]


def test_a_plain_dataset_run_has_one_dataset_of_zeros(minilm_path, data, tmp_path):
    args = parse_sft_args(_argv(minilm_path, "--dataset", str(data / "hn.jsonl"), "--output_dir", str(tmp_path)))
    got = _load(args)
    assert got.train.dataset_ids.tolist() == [0] * 8
    assert [(d.name, d.rows) for d in got.datasets] == [("default", 8)] and got.losses == {}


# ----------------------------------------------------------------------------- per-dataset loss settings


def _trainer(args):
    from mmembed.training.sft import build_trainer

    return build_trainer(args)


def test_per_dataset_infonce_equals_the_variables_set_globally_on_that_dataset(minilm_no_dropout, data, tmp_path,
                                                                               monkeypatch):
    """A batch of dataset hn, scored by a --dataset_config run in which hn has its own InfoNCE
    settings, has the loss of a plain --dataset run of hn with the same settings as INFONCE_*
    variables; a batch of the other dataset keeps the run's settings (and its loss differs);
    both checked against a naive per-anchor reference on the same model's embeddings."""
    from reference_losses import reference_infonce

    settings = {"use_batch": False, "hard_negatives": 2, "temperature": 0.05, "include_qq": True}
    cfg = write_config(data / "loss.yaml", [{"name": "hn", "path": "hn.jsonl", "infonce": settings},
                                            {"name": "other", "path": "pairs.jsonl"}])
    common = ["--tuner_type", "full", "--output_dir", str(tmp_path / "a"), "--dataset_shuffle", "false"]
    argv = _argv(minilm_no_dropout, "--dataset_config", cfg, *common)
    with pytest.raises(UsageError, match="dataset\\(s\\) hn have loss settings of their own.*--multi_dataset_sampler"):
        _load(parse_sft_args(argv))  # the sampler (mixed without the flag) would mix the datasets in a batch
    args = parse_sft_args(argv)
    args.multi_dataset_sampler = "round_robin"  # as the homogeneous samplers set it
    trainer = _trainer(args)
    samples = [trainer.train_dataset[i] for i in range(4)]
    assert {s.dataset_id for s in samples} == {0}
    batch = trainer.data_collator(samples)
    trainer.model.eval()
    with torch.no_grad():
        own = trainer.compute_loss(trainer.model, dict(batch)).item()
        # the same rows, said to come from the other dataset: the run's settings
        run_default = trainer.compute_loss(trainer.model, {**batch, "dataset_ids": torch.ones(4, dtype=torch.long)})
        emb = trainer.model(**{k: v for k, v in batch.items() if k not in ("labels", "dataset_ids")})["last_hidden_state"]
    # the same settings as the variables, on a plain --dataset run of hn alone
    for var, value in {"INFONCE_USE_BATCH": "false", "INFONCE_HARD_NEGATIVES": "2", "INFONCE_TEMPERATURE": "0.05",
                       "INFONCE_INCLUDE_QQ": "true"}.items():
        monkeypatch.setenv(var, value)
    plain = _trainer(parse_sft_args(_argv(minilm_no_dropout, "--dataset", str(data / "hn.jsonl"), "--tuner_type",
                                          "full", "--output_dir", str(tmp_path / "b"), "--dataset_shuffle", "false")))
    plain.model.eval()
    plain_samples = [plain.train_dataset[i] for i in range(4)]
    assert [s.anchor.text for s in plain_samples] == [s.anchor.text for s in samples]
    with torch.no_grad():
        env_loss = plain.compute_loss(plain.model, plain.data_collator(plain_samples)).item()
    assert own == pytest.approx(env_loss, abs=1e-6)
    with pytest.raises(ValueError, match=r"a batch holds rows of several datasets \(hn, other\)"):
        trainer.batch_loss(torch.tensor([0, 1, 0, 0]))
    labels = batch["labels"].tolist()
    # hard_negatives 2: the first two of each row's three negatives
    keep = []
    row = 0
    for s in samples:
        keep += [row, row + 1, row + 2, row + 3]
        row += 2 + len(s.negatives)
    kept_labels = [x for s in samples for x in (1.0, 0.0, 0.0)]
    ref = reference_infonce(emb[keep].double(), kept_labels, temperature=0.05, use_batch=False)
    assert own == pytest.approx(ref.item(), abs=1e-5)
    ref_default = reference_infonce(emb.double(), labels, temperature=0.1, use_batch=True)
    assert run_default.item() == pytest.approx(ref_default.item(), abs=1e-5)
    assert abs(own - run_default.item()) > 1e-3


def test_per_dataset_settings_precede_loss_kwargs_and_variables(minilm_path, data, tmp_path, monkeypatch):
    """Order of precedence: a dataset's infonce > its loss_kwargs > --loss_kwargs > INFONCE_*;
    a dataset without settings has the run's loss; a bad value names the dataset and key."""
    from mmembed.losses import InfoNCEConfig
    from mmembed.training.data_assembly import dataset_losses

    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.3")
    monkeypatch.setenv("INFONCE_USE_BATCH", "false")
    cfg = write_config(data / "prec.yaml", [
        {"name": "a", "path": "hn.jsonl", "infonce": {"temperature": 0.02}, "loss_kwargs": {"temperature": 0.07}},
        {"name": "b", "path": "hn.jsonl", "loss_kwargs": {"hard_negatives": 1}},
        {"name": "c", "path": "hn.jsonl"},
        {"name": "d", "path": "hn.jsonl", "infonce": {"use_batch": True, "hard_negatives": None}},
    ])
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path),
                                "--loss_kwargs", '{"temperature": 0.05, "hard_negatives": 2}'))
    losses = dataset_losses(args, args.dataset_entries)
    a, b, c, d = (losses.get(i) for i in range(4))
    a, b, d = a.config, b.config, d.config
    assert (a.temperature, a.hard_negatives, a.use_batch) == (0.02, 2, False)
    assert (b.temperature, b.hard_negatives, b.use_batch) == (0.05, 1, False)
    assert c is None
    assert (d.temperature, d.hard_negatives, d.use_batch) == (0.05, None, True)
    assert InfoNCEConfig.from_env().temperature == 0.3  # the variables themselves are left alone
    bad = write_config(data / "prec_bad.yaml", [{"name": "z", "path": "hn.jsonl", "infonce": {"temperature": "hot"}}])
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", bad, "--output_dir", str(tmp_path)))
    with pytest.raises(UsageError, match=r"prec_bad.yaml: dataset z, key 'infonce.temperature': INFONCE_TEMPERATURE"):
        dataset_losses(args, args.dataset_entries)
    other = write_config(data / "prec_kw.yaml", [{"name": "z", "path": "pairs.jsonl", "loss_kwargs": {"margin": 1}}])
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", other, "--output_dir", str(tmp_path)))
    with pytest.raises(UsageError, match=r"dataset z, key 'loss_kwargs.margin'"):
        dataset_losses(args, args.dataset_entries)


def test_expected_shares_and_metric_names(minilm_path, data, tmp_path):
    from mmembed.data.dataset_config import DatasetInfo
    from mmembed.training.data_assembly import expected_shares
    from mmembed.training.model_assembly import make_loss
    from mmembed.training.preflight import check_metric_for_best_model

    infos = [DatasetInfo("a", 3.0, 10), DatasetInfo("b", 1.0, 30)]
    assert expected_shares(infos, "weighted") == [0.75, 0.25]
    assert expected_shares(infos, "proportional") == expected_shares(infos, "mixed") == [0.25, 0.75]
    assert expected_shares(infos, "round_robin") == [0.5, 0.5]
    cfg = write_config(data / "names.yaml", [{"name": "hn", "path": "hn.jsonl", "val": "hn_val.jsonl"},
                                             {"name": "pairs", "path": "pairs.jsonl"}])
    for metric in ("eval_hn_recall_at_1", "eval_recall_at_1", "eval_beir_sci_ndcg_at_10"):
        args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path),
                                    "--metric_for_best_model", metric, "--eval_beir", f"sci={data}"))
        check_metric_for_best_model(args, make_loss(args))
    args = parse_sft_args(_argv(minilm_path, "--dataset_config", cfg, "--output_dir", str(tmp_path),
                                "--metric_for_best_model", "eval_pairs_recall_at_1"))  # pairs has no val rows
    with pytest.raises(UsageError, match="is not a metric this run logs"):
        check_metric_for_best_model(args, make_loss(args))


# ----------------------------------------------------------------------------- a short real run


def write_beir(folder, pairs) -> str:
    os.makedirs(os.path.join(folder, "qrels"))
    write_jsonl(os.path.join(folder, "corpus.jsonl"), [{"_id": f"d{i}", "text": p["response"]}
                                                       for i, p in enumerate(pairs)])
    write_jsonl(os.path.join(folder, "queries.jsonl"), [{"_id": f"q{i}", "text": p["query"]}
                                                        for i, p in enumerate(pairs)])
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(pairs))))
    return str(folder)


@pytest.mark.parametrize("gradcache", ["0", "2"], ids=["plain", "gradcache"])
def test_short_run_logs_loss_per_dataset_and_evaluates_each_datasets_val_rows(minilm_no_dropout, data, tmp_path,
                                                                              gradcache):
    """Batches in file order (each from one dataset): the log has loss_<name> for the dataset
    each step drew from, equal to the step's loss; the evaluation has eval_<name>_* for each
    dataset with val rows, equal to evaluating that dataset's val rows alone; --eval_beir
    name=folder evaluates with that dataset's instructions, as `evaluate_beir` does with the
    instruction written in front of each query (the MiniLM template's '{system} {content}')."""
    from mmembed.eval.beir import evaluate_beir
    from mmembed.model.embedder import Embedder
    from mmembed.training.evaluation import dataset_metrics

    beir = write_beir(tmp_path / "beir", PAIRS[40:56])
    cfg = write_config(data / "run.yaml", [
        {"name": "hn", "path": "hn.jsonl", "val": "hn_val.jsonl", "query_system": "Find a paraphrase"},
        {"name": "pairs", "path": "pairs.jsonl", "val": "pairs_val.jsonl"},
    ])
    args = parse_sft_args(_argv(minilm_no_dropout, "--dataset_config", cfg, "--output_dir", str(tmp_path / "run"),
                                "--tuner_type", "full", "--dataset_shuffle", "false", "--train_dataloader_shuffle",
                                "false", "--max_steps", "4", "--logging_steps", "1", "--eval_steps", "4",
                                "--save_steps", "4", "--report_to", "none", "--gradcache_mini_batch_size", gradcache,
                                *(["--eval_beir", f"hn={beir}", f"plain={beir}"] if gradcache == "0" else
                                  ["--eval_strategy", "no"])))
    trainer = _trainer(args)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [sorted(k for k in h if k.startswith("loss_")) for h in logs] == [["loss_hn"]] * 2 + [["loss_pairs"]] * 2
    for h in logs:
        (name,) = [k for k in h if k.startswith("loss_")]
        assert h[name] == pytest.approx(h["loss"], rel=1e-4)
    if gradcache != "0":  # the gradient cache's path of the loss call; its evaluation is the same
        return
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals, trainer.state.log_history
    got = evals[-1]
    assert {"eval_hn_loss", "eval_hn_recall_at_1", "eval_pairs_loss", "eval_pairs_mrr_at_10"} <= set(got)
    ids = trainer.eval_dataset.dataset_ids
    for i, name in enumerate(["hn", "pairs"]):
        alone = type(trainer.eval_dataset)(trainer.eval_dataset.dataset.select(np.flatnonzero(ids == i)))
        want = dataset_metrics(trainer, alone)
        assert got[f"eval_{name}_loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got[f"eval_{name}_mean_pos"] == pytest.approx(want["mean_pos"], abs=1e-6)
    assert len(ids) == 8 and got["eval_loss"] != got["eval_hn_loss"]
    charts = os.listdir(tmp_path / "run" / "charts")
    assert "loss_hn.png" in charts and "train_loss_by_dataset.png" in charts
    embedder = Embedder.from_pretrained(str(tmp_path / "run" / "checkpoint-4"), device="cpu")
    with_instruction = evaluate_beir(embedder, beir, query_prefix="Find a paraphrase ")
    without = evaluate_beir(embedder, beir)
    for key in ("ndcg@10", "mrr@10", "recall@1"):
        name = key.replace("@", "_at_")
        assert got[f"eval_beir_hn_{name}"] == pytest.approx(with_instruction[key], abs=1e-5)
        assert got[f"eval_beir_plain_{name}"] == pytest.approx(without[key], abs=1e-5)
    saved = json.load(open(tmp_path / "run" / "checkpoint-4" / "mmembed.json"))
    assert saved["instructions"]["datasets"]["hn"] == {"query": "Find a paraphrase", "document": None}


def _one_dataset_worker(rank: int, init: str, cases: list, out: str) -> None:
    import torch.distributed as dist

    from mmembed.training.trainer import one_dataset

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results = []
    for ids in cases:
        try:
            results.append(one_dataset(torch.tensor(ids[rank]), ["a", "b", "c"], torch.device("cpu")))
        except ValueError as e:
            results.append(str(e).split(",")[0])
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def test_a_datasets_own_loss_needs_one_dataset_on_every_process(tmp_path):
    """Two processes (gloo): the same dataset on both gives it; different datasets, or a mixed
    batch on one process only, is an error on both (neither is left waiting in the exchange)."""
    import torch.multiprocessing as mp

    cases = [([1, 1], [1, 1, 1]), ([0, 0], [2, 2]), ([0, 1], [0, 0]), ([0, 1], [1, 2])]
    out = str(tmp_path / "result")
    mp.start_processes(_one_dataset_worker, args=(f"file://{tmp_path / 'store'}", cases, out), nprocs=2, join=True,
                       start_method="fork")
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in (0, 1))
    assert r0[0] == r1[0] == 1
    assert r0[1] == r1[1] == "the processes' batches of this step came from different datasets (or mixed ones)"
    assert r0[2] == "a batch holds rows of several datasets (a" and r1[2].startswith("the processes' batches")
    assert r0[3].startswith("a batch holds rows of several datasets (a") and r1[3].startswith("a batch holds")
