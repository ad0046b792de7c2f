"""A user's own loss: the worked example of docs/losses.md (examples/custom_loss.py) against its
formula written out, the registry (register_loss, module:Class), and a run from the CLI."""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, REPO
from forked_cli import run_cli

EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)

from custom_loss import SymmetricInfoNCE  # noqa: E402

from mmembed.losses import LOSSES, CrossProcess, EmbeddingLoss, Layout, build_loss, loss_class, register_loss  # noqa: E402


def _symmetric_by_hand(emb, groups, t):
    """Loop over anchors: -log softmax of the own positive among all documents, and of the
    own anchor among all anchors, seen from the positive."""
    anchors = [emb[a] for a, _, _ in groups]
    positives = [emb[p] for _, p, _ in groups]
    docs = positives + [emb[n] for _, _, negs in groups for n in negs]
    one, two = 0.0, 0.0
    for i, (a, p) in enumerate(zip(anchors, positives)):
        s = [float(a @ d) / t for d in docs]
        one += -(s[i] - math.log(sum(math.exp(v) for v in s)))
        s = [float(p @ b) / t for b in anchors]
        two += -(s[i] - math.log(sum(math.exp(v) for v in s)))
    return (one + two) / (2 * len(groups))


def test_symmetric_infonce_equals_its_formula():
    torch.manual_seed(0)
    emb = F.normalize(torch.randn(9, 8, dtype=torch.float64), dim=-1)
    # a0 p0 n0 n0 | a1 p1 | a2 p2 n2
    labels = torch.tensor([1.0, 0, 0, 1, 1, 0])
    groups = [(0, 1, [2, 3]), (4, 5, []), (6, 7, [8])]
    got = SymmetricInfoNCE(temperature=0.07)({"last_hidden_state": emb}, labels)
    assert got.item() == pytest.approx(_symmetric_by_hand(emb, groups, 0.07), abs=1e-10)
    loss = SymmetricInfoNCE()
    assert loss.layout is Layout.GROUP and loss.cross_process is CrossProcess.WHOLE_BATCH
    assert not loss.side.guide and not loss.side.teacher


def test_registry_takes_module_class_and_registered_names(monkeypatch):
    assert loss_class("custom_loss:SymmetricInfoNCE") is SymmetricInfoNCE
    monkeypatch.setitem(LOSSES, "symmetric_infonce", LOSSES.get("symmetric_infonce", SymmetricInfoNCE))
    register_loss("symmetric_infonce", SymmetricInfoNCE)
    assert build_loss("symmetric_infonce", temperature=0.1).temperature == 0.1

    @register_loss("decorated_loss")
    class Decorated(EmbeddingLoss):
        def forward(self, outputs, labels):
            return outputs["last_hidden_state"].sum() * 0

    try:
        assert isinstance(build_loss("decorated_loss"), Decorated)
        with pytest.raises(ValueError, match="taken by Decorated"):
            register_loss("decorated_loss", SymmetricInfoNCE)
    finally:
        LOSSES.pop("decorated_loss")
    with pytest.raises(ValueError, match="not a subclass of mmembed.losses.EmbeddingLoss"):
        register_loss("plain", torch.nn.Module)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        loss_class("no_such_module:Loss")
    with pytest.raises(ValueError, match="custom_loss.F is not a subclass"):
        loss_class("custom_loss:F")
    with pytest.raises(ValueError, match="unknown loss 'infonse'.*package.module:ClassName"):
        build_loss("infonse")
    with pytest.raises(ValueError, match="loss 'custom_loss:SymmetricInfoNCE'.*no_such_option"):
        build_loss("custom_loss:SymmetricInfoNCE", no_such_option=1)


def test_a_layout_declared_by_its_value_is_the_enum():
    """A user's loss may write ``layout = "pair"``: the class holds ``Layout.PAIR`` from its
    definition on (everything after it takes the enum only); an unknown value is an error there."""
    class ByValue(EmbeddingLoss):
        layout = "pair"

    assert ByValue.layout is Layout.PAIR and ByValue().label_rule is not None
    with pytest.raises(ValueError, match="Triplets.layout must be Layout.GROUP or Layout.PAIR, got 'triplet'"):
        class Triplets(EmbeddingLoss):
            layout = "triplet"


@pytest.mark.parametrize("loss_class_name", ["SymmetricInfoNCE", "Exploding"])
def test_custom_loss_trains_from_the_command_line(minilm_path, tmp_path, loss_class_name):
    """The CLI builds the user's class by ``module:Class``; a loss that raises shows its
    message, so the run really called it."""
    (tmp_path / "exploding_loss.py").write_text(
        "from custom_loss import SymmetricInfoNCE\n"
        "class Exploding(SymmetricInfoNCE):\n"
        "    def forward(self, outputs, labels):\n"
        "        raise ValueError('the exploding loss was called')\n")
    module = "custom_loss" if loss_class_name == "SymmetricInfoNCE" else "exploding_loss"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONPATH=os.pathsep.join([EXAMPLES, str(tmp_path), REPO]))
    r = run_cli(["sft", "--model", minilm_path, "--dataset", os.path.join(DATA, "stsb_train_hardneg.jsonl") + "#16",
                 "--loss_type", f"{module}:{loss_class_name}", "--loss_kwargs", '{"temperature": 0.05}',
                 "--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                 "--output_dir", str(tmp_path / "out"), "--report_to", "none"], env=env)
    if loss_class_name == "Exploding":
        assert r.returncode != 0 and "the exploding loss was called" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads(r.stdout[r.stdout.rindex("{\n"):])
    assert math.isfinite(metrics["train_loss"]) and metrics["train_loss"] > 0
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "mmembed.json").read_text())
    assert saved["loss_type"] == "custom_loss:SymmetricInfoNCE"
