"""The documentation. The site's reference tables are read from the source by
docs/hooks/generated.py with ``ast`` (no import, so the build stays quick): here they are held
against the flags the code really defines, so a flag the reader misses or misreads fails. And
README.md keeps its two commands and links to every page of the site (``mkdocs build --strict``
in tests/run.sh checks the links inside docs/)."""

import argparse
import ast
import dataclasses
import os
import re

import pytest
import yaml
from conftest import REPO, load_docs_hooks


def _value(node):
    """The value an ``ast`` default (or default_factory) gives."""
    if node is None:
        return None
    if isinstance(node, ast.Lambda):
        node = node.body
    if isinstance(node, ast.Name) and node.id in ("list", "dict", "tuple"):
        return {"list": [], "dict": {}, "tuple": ()}[node.id]
    return ast.literal_eval(node)


def test_the_sft_flag_table_lists_every_field_sftarguments_declares_with_its_default_and_help():
    from mmembed.training.arguments import SftArguments
    from mmembed.training.sft_flags import SftFlags

    fields = load_docs_hooks().sft_fields()
    assert [f["name"] for f in fields] == list(SftFlags.__dict__["__annotations__"])
    assert not SftArguments.__dict__.get("__annotations__")  # its flags are SftFlags' all
    runtime = {f.name: f for f in dataclasses.fields(SftArguments)}
    for f in fields:
        field = runtime[f["name"]]
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert _value(f["default"]) == default, f["name"]
        assert f["metadata"].get("help") == field.metadata.get("help"), f["name"]
        assert f["metadata"].get("choices") == field.metadata.get("choices"), f["name"]
    markdown = load_docs_hooks().sft_flags()
    for f in fields:
        assert f"| `--{f['name']}` |" in markdown


class _Parser(Exception):
    def __init__(self, parser):
        super().__init__(parser.prog)
        self.parser = parser


def test_the_tool_flag_tables_list_what_each_command_parses(monkeypatch):
    from mmembed.tools import cli

    def caught(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    tools = {tool["command"]: tool for tool in load_docs_hooks().tool_parsers()}
    commands = {name for name, function in cli.COMMANDS.items() if function is not cli.cmd_sft}
    assert set(tools) == commands
    for name, tool in tools.items():
        with pytest.raises(_Parser) as e:
            cli.COMMANDS[name]([])
        parser = e.value.parser
        assert (tool["prog"], tool["description"]) == (parser.prog, parser.description or "")
        actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        assert [f["names"] for f in tool["flags"]] == [a.option_strings for a in actions], name
        for flag, action in zip(tool["flags"], actions):
            where = f"mmembed {name} {action.option_strings[0]}"
            assert bool(_value(flag.get("required"))) == action.required, where
            assert _value(flag.get("help")) == action.help, where
            assert _value(flag.get("choices")) == action.choices, where
            expected = False if isinstance(action, argparse._StoreTrueAction) else action.default
            if not isinstance(action, argparse._StoreTrueAction):
                assert _value(flag.get("default")) == expected, where
    markdown = load_docs_hooks().tool_flags()
    for name in commands:
        assert f"### `mmembed {name}`" in markdown


def test_the_template_tables_list_every_field_and_file():
    from mmembed.encoding.templates import Template

    hook = load_docs_hooks()
    assert re.findall(r"^\| `(\w+)` \|", hook.template_fields(), re.MULTILINE) == \
        [f.name for f in dataclasses.fields(Template)]
    shipped = sorted(n for n in os.listdir(os.path.join(REPO, "templates")) if n.endswith(".toml"))
    assert re.findall(r"^\| `(\w+\.toml)` \|", hook.templates(), re.MULTILINE) == shipped


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_readme_keeps_its_two_commands_and_links_to_every_page():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert ("```bash\n"
            "bash examples/quickstart.sh   # set up .venv, fine-tune all-MiniLM-L6-v2 on STS-B pairs, print before/after metrics\n"
            "bash tests/run.sh             # set up .venv if needed, run the test suite (CI runs exactly this)\n"
            "```") in text
    assert "Replace `swift sft` by `mmembed sft`" in text
    links = [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text) if "://" not in m.group(1)]
    missing = [link for link in links if not os.path.exists(os.path.join(REPO, link))]
    assert not missing, missing
    with open(os.path.join(REPO, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]
    unlinked = [page for page in _nav_pages(nav) if page != "index.md" and f"docs/{page}" not in links]
    assert not unlinked, f"README.md links to no {unlinked}"
