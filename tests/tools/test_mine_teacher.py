"""``mmembed mine --teacher_reranker``: each mined row's candidates (positive, then the
negatives the row ends up with) scored by a reranker, written as ``teacher_scores``, in the
order the reader pairs them with; then ``distill_kl`` trains from the mined file."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from conftest import DATA, stsb_pairs, write_jsonl

from mmembed.data import read_file
from mmembed.data.sample import Item
from mmembed.tasks.reranker.scorer import Reranker
from mmembed.tools.cli import main
from mmembed.tools.mining import MiningConfig, mine_rows


class LengthTeacher:
    """A stand-in reranker: a pair's score is the document's length plus a tenth of the query's."""

    class template:  # noqa: N801 - the attribute Reranker has
        media = ()

    def __init__(self):
        self.calls = 0

    def score_pairs(self, pairs, batch_size=32, raw_scores=False):
        assert raw_scores, "teacher_scores are raw scores (logits), not sigmoid probabilities"
        self.calls += 1
        return np.array([len(d.text) + len(q.text) / 10 for q, d in pairs], dtype=np.float32)


def _expected(sample):
    return [len(c.text) + len(sample.anchor.text) / 10 for c in [sample.positives[0], *sample.negatives]]


ROWS = [
    {"query": "cat sat on the mat", "response": "a cat is sitting on a mat", "rejected_response": ["a dog"]},
    {"query": "dog chases the ball", "response": "the dog runs after a red ball", "teacher_scores": [1.0]},
    {"messages": [{"role": "user", "content": "cat chases a mouse"}],
     "positive_messages": [[{"role": "user", "content": "a cat hunting a mouse in the grass"}]],
     "negative_messages": [[{"role": "user", "content": "an old negative"}]]},
    {"query": "children play ball in the park", "response": "kids playing with a ball in a park"},
    {"query": "red ball on grass", "response": "a red ball lying in the grass", "label": 0.0},  # a pair row
    {"query": "mouse and keyboard", "response": "a computer mouse next to a keyboard"},
]


@pytest.mark.parametrize("overwrite", [False, True])
def test_teacher_scores_follow_the_rows_candidates_in_both_forms(tmp_path, overwrite):
    teacher = LengthTeacher()
    out, stats = mine_rows([(i + 1, dict(r)) for i, r in enumerate(ROWS)], "t.jsonl", str(tmp_path),
                           config=MiningConfig(num_negatives=2, overwrite=overwrite), teacher=teacher)
    assert teacher.calls == 1  # every row's pairs in one call
    assert stats.teacher_scored == 5 and stats.teacher_skipped == []
    assert "teacher_scores from the reranker: 5 row(s)" in stats.summary()
    assert "teacher_scores" not in out[4]  # the pair row is copied unchanged
    path = write_jsonl(tmp_path / "mined.jsonl", out)
    samples = read_file(path)  # the reader accepts the scores: one per candidate
    for i, s in enumerate(samples):
        if i == 4:
            assert s.teacher_scores is None
            continue
        np.testing.assert_allclose(s.teacher_scores, _expected(s), rtol=1e-6)
        assert len(s.negatives) >= 1
    if not overwrite:  # the old negatives stay first, and are scored first
        assert samples[0].negatives[0].text == "a dog"
        assert samples[2].negatives[0].text == "an old negative"
    assert ROWS[1]["teacher_scores"] == [1.0]  # the input rows are not modified


def test_rows_with_media_the_reranker_does_not_take_are_left_unscored(tmp_path):
    teacher = LengthTeacher()
    rows = [dict(ROWS[0]), dict(ROWS[3])]
    from mmembed.tools.rerank_teacher import add_teacher_scores

    shutil.copy(os.path.join(DATA, "mm", "red_circle.png"), tmp_path / "x.png")
    rows[1] = dict(rows[1], query="<image> kids", images=["x.png"])
    skipped = add_teacher_scores(rows, [0, 1], [1, 2], "t.jsonl", str(tmp_path), teacher)
    assert skipped == [2] and "teacher_scores" not in rows[1]
    assert rows[0]["teacher_scores"] == pytest.approx([len("a cat is sitting on a mat") + 1.8, len("a dog") + 1.8])


# ---- end to end: MiniLM mines, the trained reranker scores, distill_kl trains ------------------
@pytest.fixture(scope="module")
def checkpoint(reranker_checkpoints):
    """A one-step full classifier reranker from all-MiniLM-L6-v2 (the session's, tests/conftest.py)."""
    return reranker_checkpoints["classifier_full"]


def test_mine_with_teacher_reranker_then_distill(minilm_path, checkpoint, tmp_path, capsys):
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    rows = [{"query": r["query"], "response": r["response"]} for r in stsb_pairs(16)]
    rows[0]["rejected_response"] = ["A completely unrelated sentence about taxes."]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = str(tmp_path / "mined.jsonl")
    assert main(["mine", "--dataset", src, "--output", out, "--model", minilm_path, "--teacher_reranker", checkpoint,
                 "--num_negatives", "3", "--range_max", "10"]) == 0
    assert "teacher_scores from the reranker: 16 row(s)" in capsys.readouterr().out
    raw = [json.loads(line) for line in open(out, encoding="utf-8")]
    reranker = Reranker.from_pretrained(checkpoint, device="cpu")
    for row in raw:
        want = reranker.score(row["query"], [row["response"], *row["rejected_response"]], raw_scores=True)  # independent
        np.testing.assert_allclose(row["teacher_scores"], want, atol=1e-4)
        assert len(row["rejected_response"]) >= 2
    assert raw[0]["rejected_response"][0] == rows[0]["rejected_response"][0]  # kept first, scored second
    for s in read_file(out):  # what the reader pairs the scores with
        assert len(s.teacher_scores) == 1 + len(s.negatives)
        np.testing.assert_allclose(s.teacher_scores, reranker.score(Item(s.anchor.text), [s.positives[0], *s.negatives],
                                                                    raw_scores=True), atol=1e-4)

    args = parse_sft_args([
        "--model", minilm_path, "--task_type", "embedding", "--dataset", out, "--loss_type", "distill_kl",
        "--loss_kwargs", json.dumps({"use_batch": False, "teacher_temperature": 1.0}), "--tuner_type", "full",
        "--per_device_train_batch_size", "4", "--max_length", "64", "--max_steps", "2", "--save_steps", "2",
        "--logging_steps", "1", "--eval_strategy", "no", "--output_dir", str(tmp_path / "student"),
        "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
    ])
    metrics = run_sft(args)
    with open(os.path.join(metrics["last_checkpoint"], "trainer_state.json"), encoding="utf-8") as f:
        losses = [e["loss"] for e in json.load(f)["log_history"] if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) and x >= 0 for x in losses), losses
    assert any(x > 0 for x in losses)  # the teacher's distribution is not the student's
