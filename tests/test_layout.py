"""The package's shape: each folder imports only from the folders before it in the flow,
and outside losses/ no code decides anything by comparing loss names."""

import ast
import os
import re

from conftest import REPO

ORDER = ["data", "encoding", "model", "losses", "eval", "training", "tools"]
PACKAGE = os.path.join(REPO, "mmembed")


def _modules():
    for layer in ORDER:
        folder = os.path.join(PACKAGE, layer)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                yield layer, os.path.join(folder, name)


def _imported_layers(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 2 and node.module:
                yield node.module.split(".")[0], node.lineno
            elif node.level == 0 and node.module and node.module.startswith("mmembed."):
                yield node.module.split(".")[1], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mmembed."):
                    yield alias.name.split(".")[1], node.lineno


def test_every_folder_imports_only_from_the_folders_before_it():
    wrong = []
    for layer, path in _modules():
        for target, line in _imported_layers(path):
            if target in ORDER and ORDER.index(target) > ORDER.index(layer):
                wrong.append(f"{os.path.relpath(path, REPO)}:{line} imports {target}/ ({layer}/ comes before it)")
    assert not wrong, "\n".join(wrong)


def test_no_loss_name_is_compared_outside_losses():
    names = r"(infonce|gist|distill_\w*|cosine_similarity|contrastive|online_contrastive|matryoshka)"
    pattern = re.compile(r"loss_type\s*(==|!=|in\b)|\.startswith\([\"']distill|[\"']" + names + r"[\"']\s*(==|!=|in\b)"
                         r"|(==|!=)\s*[\"']" + names + r"[\"']")
    found = []
    for layer, path in _modules():
        if layer == "losses":
            continue
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            if pattern.search(line):
                found.append(f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
