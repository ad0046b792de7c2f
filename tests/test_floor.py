"""The declared dependency floors are the tested ones (.ci/floor installs them), and what
needs more than the floor says so before loading anything."""

import os
import re

import pytest
import tomllib
from conftest import REPO


def _lower_bounds() -> dict[str, str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    bounds = {}
    for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", req.split(";")[0].strip())
        if m:
            bounds[m.group(1).lower()] = m.group(2)
    return bounds


def test_floor_constraints_pin_the_lower_bounds_of_pyproject():
    pins = {}
    with open(os.path.join(REPO, "tests", "floor-constraints.txt")) as f:
        for line in f:
            if "==" in line and not line.startswith("#"):
                name, version = line.strip().split("==")
                pins[name.lower()] = version
    bounds = _lower_bounds()
    for name, version in pins.items():
        # 5.17 and 5.17.0 are the same release
        assert bounds[name].split(".")[:2] == version.split(".")[:2], (name, bounds[name], version)
    # the libraries mmembed calls into are all pinned at their floor in .ci/floor
    assert {"transformers", "peft", "accelerate", "deepspeed", "datasets", "sentence-transformers"} <= set(pins)


def test_a_template_needing_a_newer_transformers_is_refused_before_loading(monkeypatch):
    import transformers

    from mmembed.encoding.templates import get_template

    template = get_template("qwen2_audio")
    assert template.min_transformers == "5.23.0"
    monkeypatch.setattr(transformers, "__version__", "5.22.2")
    with pytest.raises(ValueError, match=r"template 'qwen2_audio' needs transformers >= 5.23.0 \(installed: 5.22.2\)"):
        template.check_installed()
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    template.check_installed()
    get_template("qwen3_emb").check_installed()  # no floor of its own
