"""mmembed never runs a model folder's own code: a folder whose config.json's ``auto_map``
points to its own ``.py`` files for a model type transformers does not implement is refused by
every command in one line (and the code is not run); for a model type transformers implements,
transformers' own classes load it and the folder's code is still not run."""

import json
import shutil

import numpy as np
import pytest
from conftest import stsb_pairs, write_jsonl
from forked_cli import run_cli

PAYLOAD = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def _custom_code_folder(minilm_path, tmp_path, model_type):
    """MiniLM copied, with an ``auto_map`` naming code in the folder that would leave a marker file when run."""
    folder = tmp_path / "custom"
    shutil.copytree(minilm_path, folder)
    marker = tmp_path / "code-ran"
    for module in ("configuration_custom", "modeling_custom"):
        (folder / f"{module}.py").write_text(PAYLOAD.format(marker=str(marker)))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder), marker


@pytest.mark.parametrize("command", ["embed", "export", "serve", "sft"])
def test_a_model_folder_needing_its_own_code_is_refused_in_one_line(minilm_path, tmp_path, command):
    folder, marker = _custom_code_folder(minilm_path, tmp_path, "custom_bert")
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(4))
    argv = {
        "embed": ["embed", "--model", folder, "--input", data, "--output", str(tmp_path / "e.npy")],
        "export": ["export", "--adapters", folder, "--merge_lora", "true", "--output_dir", str(tmp_path / "x")],
        "serve": ["serve", "--model", folder],
        "sft": ["sft", "--model", folder, "--dataset", data, "--output_dir", str(tmp_path / "out"), "--max_steps", "1"],
    }[command]
    r = run_cli(argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    flag = "--adapters" if command == "export" else "--model"
    assert lines[0].startswith(f"mmembed {command}: error: {flag} {folder!r}: its config.json has auto_map"), lines[0]
    assert "never runs a model folder's own code" in lines[0]
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_a_known_model_type_loads_with_transformers_classes_not_the_folders_code(minilm_path, tmp_path):
    folder, marker = _custom_code_folder(minilm_path, tmp_path, "bert")
    inputs = tmp_path / "in.txt"
    inputs.write_text("a cat sits on the mat\nstocks fell sharply today\n")
    runs = {}
    for name, model in (("custom", folder), ("plain", minilm_path)):
        r = run_cli(["embed", "--model", model, "--input", str(inputs), "--output", str(tmp_path / f"{name}.npy")])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = r
    assert not marker.exists()
    assert "auto_map" in runs["custom"].stderr and "never runs a model folder's own code" in runs["custom"].stderr
    np.testing.assert_array_equal(np.load(tmp_path / "custom.npy"), np.load(tmp_path / "plain.npy"))


@pytest.mark.parametrize("tokenizer_class, refused", [("CustomTokenizer", True), ("BertTokenizer", False)])
def test_a_tokenizer_in_the_folders_own_code_is_checked_as_the_model_is(minilm_path, tmp_path, tokenizer_class, refused):
    """tokenizer_config.json's auto_map gets config.json's rule: a tokenizer class transformers
    does not implement is refused in one line (its code not run); one it implements loads with
    transformers' class and a warning."""
    folder = tmp_path / "custom_tok"
    shutil.copytree(minilm_path, folder)
    marker = tmp_path / "code-ran"
    (folder / "tokenization_custom.py").write_text(PAYLOAD.format(marker=str(marker)))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = tokenizer_class
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    inputs = tmp_path / "in.txt"
    inputs.write_text("a cat sits on the mat\n")
    r = run_cli(["embed", "--model", str(folder), "--input", str(inputs), "--output", str(tmp_path / "e.npy")])
    assert not marker.exists()
    if refused:
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
        assert r.stderr.startswith(f"mmembed embed: error: --model {str(folder)!r}: its tokenizer_config.json has auto_map "
                                   "(tokenization_custom.CustomTokenizer)")
    else:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "tokenizer_config.json's auto_map (tokenization_custom.CustomTokenizer) is ignored" in r.stderr
