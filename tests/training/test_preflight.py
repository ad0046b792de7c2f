"""The run's set-up (mmembed/training/preflight.py): the up-front checks read the model's config,
resolve its template and build the loss once, and hand them to build_trainer (RunSetup), which
reads and builds none of them again."""

import json

import pytest

from mmembed.training.arguments import parse_sft_args


@pytest.fixture
def args(minilm_path, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"query": f"q{i}", "response": f"d{i}", "rejected_response": [f"n{i}"]}) + "\n"
                            for i in range(8)))
    return parse_sft_args(["--model", minilm_path, "--dataset", str(rows), "--output_dir", str(tmp_path / "out"),
                           "--per_device_train_batch_size", "4", "--report_to", "none", "--system", "Be brief.",
                           "--loss_type", "infonce", "--dataset_num_proc", "1"])


def test_check_settings_returns_what_it_read_and_built(args, minilm_path):
    from transformers import AutoConfig

    from mmembed.losses import InfoNCELoss
    from mmembed.training.preflight import RunSetup, check_settings

    setup = check_settings(args)
    assert isinstance(setup, RunSetup)
    assert setup.config.to_dict() == AutoConfig.from_pretrained(minilm_path).to_dict()
    assert setup.template.name == "bert" and setup.template.default_system == "Be brief."
    assert isinstance(setup.loss, InfoNCELoss)


def test_build_trainer_reads_and_builds_nothing_the_setup_holds(args, monkeypatch):
    from mmembed.training import model_assembly, preflight, sft

    setup = preflight.check_settings(args)
    calls = []

    def refuse(name):
        def fail(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called again")
        return fail

    for module in (sft, model_assembly, preflight):
        for name in ("make_loss", "read_model_config", "check_settings", "check_model_folders"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse(name))
    trainer = sft.build_trainer(args, setup)
    assert calls == []
    assert trainer.loss is setup.loss
    assert trainer.data_collator.template.default_system == "Be brief."  # the setup's template, with --system
    assert trainer.data_collator.builder.media is setup.media
