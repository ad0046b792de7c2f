"""ms-swift's embedding and reranker model types against mmembed: every one that ms-swift 4.6's
own code lists (tests/fixtures/swift/model_list.json, made by make_model_list.py in ms-swift's
venv) is either found by :func:`~mmembed.encoding.templates.get_template` for its task, or kept
in mmembed/encoding/swift_models.py with why not; and docs/swift.md's table (made by
docs/hooks/generated.py) has exactly those model types with that status. A model type a new
ms-swift release adds, once the fixture is made again, fails here until it is handled."""

import json
import os
import re

import pytest
from conftest import REPO, load_docs_hooks

from mmembed.encoding.swift_models import NOT_SUPPORTED
from mmembed.encoding.templates import get_template
from mmembed.task import get_task

FIXTURE = os.path.join(REPO, "tests", "fixtures", "swift", "model_list.json")


def _listed():
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def template_of(entry: dict) -> str | None:
    """The template mmembed trains ``entry``'s model type with for its ms-swift task, as
    ``mmembed sft --model_type TYPE --task_type TASK`` finds it (None: unknown)."""
    try:
        return get_template(model_type=entry["model_type"], task=get_task(entry["task"]).template_task).name
    except ValueError:
        return None


def unaccounted(entries: list[dict]) -> list[str]:
    """The model types of ``entries`` that no template names for their task and that no reason
    explains (NOT_SUPPORTED)."""
    return [e["model_type"] for e in entries if template_of(e) is None and e["model_type"] not in NOT_SUPPORTED]


def test_the_fixture_is_ms_swift_4_6_s_own_list():
    listed = _listed()
    assert listed["versions"]["ms_swift"] == "4.6.0"
    types = [e["model_type"] for e in listed["model_types"]]
    assert types == sorted(set(types))
    # the families issue 44 names, and the ones the suite already trains, are in it
    for model_type in ("qwen3_emb", "qwen3_vl_emb", "qwen2_gme", "qwen3_reranker", "qwen3_vl_reranker", "bge_reranker",
                       "gemma_emb", "qwen3_5_emb", "wemm_embedding", "jina_reranker_m0"):
        assert model_type in types
    tasks = {e["model_type"]: e["task"] for e in listed["model_types"]}
    assert tasks["qwen3_reranker"] == tasks["qwen3_vl_reranker"] == "generative_reranker"
    assert tasks["jina_reranker_m0"] == tasks["bge_reranker"] == "reranker"
    assert all(e["marks"] for e in listed["model_types"])


def test_every_listed_model_type_is_trained_or_explained():
    entries = _listed()["model_types"]
    assert unaccounted(entries) == []
    # and a model type the next release could add, with no template and no reason, is caught
    new = {"model_type": "qwen9_emb", "task": "embedding"}
    assert unaccounted([*entries, new]) == ["qwen9_emb"]


def test_a_reason_is_kept_only_for_a_listed_model_type_no_template_names():
    listed = {e["model_type"]: e for e in _listed()["model_types"]}
    assert set(NOT_SUPPORTED) <= set(listed)
    stale = [m for m in NOT_SUPPORTED if template_of(listed[m]) is not None]
    assert stale == [], f"mmembed/encoding/swift_models.py: {stale} are trained now; take their reason out"


def test_a_model_type_kept_as_not_supported_says_why_in_the_error():
    for model_type, why in NOT_SUPPORTED.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            get_template(model_type=model_type, task="embedding")


def test_the_docs_table_lists_the_fixture_with_mmembed_s_status():
    hook = load_docs_hooks()
    for task, template_task in hook.TEMPLATE_TASK.items():
        assert get_task(task).template_task == template_task
    statuses = hook.swift_model_statuses()
    assert [s["model_type"] for s in statuses] == [e["model_type"] for e in _listed()["model_types"]]
    for s in statuses:
        found = template_of(s)
        if found is not None:
            assert (s["status"], s["mmembed_template"]) == ("supported", found), s["model_type"]
        else:
            assert s["status"] == "not supported" and s["why"] == NOT_SUPPORTED[s["model_type"]], s["model_type"]
    table = hook.swift_models()
    rows = [line for line in table.splitlines() if line.startswith("| `") and not line.startswith("| `--")]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == [s["model_type"] for s in statuses]
    for row, s in zip(rows, statuses):
        if s["status"] == "supported":
            assert row.endswith(f"| supported: template `{s['mmembed_template']}` |")
        else:
            assert f"| {s['status']}: " in row
        assert f"| `{s['template']}` (`{s['loader'][0]}`) |" in row  # ms-swift's template, not mmembed's
    with open(os.path.join(REPO, "docs", "swift.md"), encoding="utf-8") as f:
        assert "<!-- generated: swift-models -->" in f.read().splitlines()
