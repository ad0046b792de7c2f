"""MkDocs hook: the reference tables that follow from the code, written at build time.

A page asks for a table with a marker line, ``<!-- generated: NAME -->``; the hook replaces
it with the table built from the source as it is now, so the site never lists a flag that
is gone or misses a new one. An unknown marker, or a source that no longer has what the
table is built from, fails the build (``mkdocs build --strict`` runs in ``tests/run.sh``).

Most tables are read from the source with ``ast`` (no import: ``mmembed.training.arguments``
imports transformers and torch, seconds the build should not spend); the ms-swift flag
tables of ``mmembed/training/swift_flags.py`` are computed dicts, imported (that module
imports nothing heavy).

Markers:

- ``sft-flags``: the fields of ``SftFlags`` (``mmembed/training/sft_flags.py``, the flags
  ``SftArguments`` checks), each with its type, default and help metadata, grouped by the
  comments of the class body;
- ``swift-flags``: ``NO_EFFECT``, ``NO_EFFECT_FIELDS`` and ``REFUSED`` of ``swift_flags.py``;
- ``tool-flags``: the commands of ``mmembed`` (``USAGE`` of ``mmembed/tools/cli.py``) and
  the argparse flags of each tool (``cmd_*`` in ``cli.py``, ``parse_serve_args`` in
  ``mmembed/tools/serve.py``);
- ``template-fields``: the fields of ``Template`` (``mmembed/encoding/templates.py``);
- ``templates``: the template files shipped in ``templates/``;
- ``swift-models``: ms-swift's embedding and reranker model types
  (``tests/fixtures/swift/model_list.json``, read by ms-swift's own code) with mmembed's status:
  the template that names each (``templates/*.toml``), else the reason kept in
  ``mmembed/encoding/swift_models.py`` (imported: it imports nothing).

It also shows the docstrings' Sphinx roles as Sphinx would (:func:`on_page_content`) and takes
the backslash out of ``\\|`` in a table's code spans, which GitHub needs and Python-Markdown
would show (:func:`_unescape_pipes_in_code`).
"""

from __future__ import annotations

import ast
import html
import importlib
import json
import os
import re
import sys

import tomllib
from mkdocs.exceptions import PluginError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def _source(relative: str) -> tuple[ast.Module, list[str]]:
    path = os.path.join(ROOT, relative)
    text = open(path, encoding="utf-8").read()
    return ast.parse(text, filename=path), text.splitlines()


def cell(text: object) -> str:
    """``text`` as plain text in a Markdown table cell (no markup, no HTML, no cell break)."""
    text = html.escape(" ".join(str(text).split()), quote=False)
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)


def code(text: str) -> str:
    """``text`` as a code span in a Markdown table cell (Python-Markdown's tables take a ``|``
    inside a code span as text)."""
    text = " ".join(str(text).split())
    if not text:
        return ""
    ticks = "``" if "`" in text else "`"
    return f"{ticks}{text}{ticks}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _class(tree: ast.Module, name: str, where: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise PluginError(f"docs/hooks/generated.py: {where} has no class {name}")


def _function(tree: ast.Module, name: str, where: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise PluginError(f"docs/hooks/generated.py: {where} has no function {name}")


def _literal(node: ast.expr | None) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _shown_default(node: ast.expr | None) -> str:
    """A default as the command line spells it: true / false, a list, a number, a string."""
    if node is None:
        return ""
    if isinstance(node, ast.Lambda):  # default_factory=lambda: [...]
        node = node.body
    if isinstance(node, ast.Name) and node.id in ("list", "dict", "tuple"):
        return {"list": "[]", "dict": "{}", "tuple": "()"}[node.id]
    value = _literal(node)
    if value is None and isinstance(node, ast.Constant):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):  # several values, as the command line takes them
        return " ".join(map(str, value))
    return ast.unparse(node)


def _dataclass_fields(cls: ast.ClassDef, lines: list[str]) -> list[dict]:
    """Each annotated field of a dataclass body: name, type, default, metadata, the comment
    group it sits in (a one-line comment of its own above a run of fields) and its trailing
    comment."""
    fields, group, previous_end = [], "", cls.lineno
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = node.end_lineno
            continue
        comments = [lines[i].strip() for i in range(previous_end, node.lineno - 1)]
        comments = [c for c in comments if c.startswith("#")]
        if len(comments) == 1:
            group = comments[0].lstrip("# ").strip()
        default, metadata = node.value, {}
        if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "field":
            keywords = {k.arg: k.value for k in node.value.keywords}
            default = keywords.get("default", keywords.get("default_factory"))
            metadata = _literal(keywords.get("metadata")) or {}
        trailing = lines[node.end_lineno - 1].split("#", 1)[1].strip() if "#" in lines[node.end_lineno - 1] else ""
        if trailing.startswith("type:"):
            trailing = ""
        fields.append({"name": node.target.id, "type": ast.unparse(node.annotation), "default": default,
                       "metadata": metadata, "group": group, "comment": trailing})
        previous_end = node.end_lineno
    return fields


def sft_fields() -> list[dict]:
    """The fields ``SftFlags`` declares itself (:func:`_dataclass_fields`): mmembed's flags,
    which ``SftArguments`` (``mmembed/training/arguments.py``) extends with its checks."""
    where = "mmembed/training/sft_flags.py"
    tree, lines = _source(where)
    fields = _dataclass_fields(_class(tree, "SftFlags", where), lines)
    if not fields:
        raise PluginError(f"docs/hooks/generated.py: SftFlags in {where} has no fields")
    return fields


def sft_flags() -> str:
    where = "mmembed/training/sft_flags.py"
    fields = sft_fields()
    out, group = [], None
    rows: list[list[str]] = []

    def flush():
        if rows:
            out.append(_table(["flag", "type", "default", "meaning"], rows))
            rows.clear()

    for f in fields:
        if f["group"] != group:
            flush()
            group = f["group"]
            title = group[0].upper() + group[1:] if group.split()[0].isalpha() else group  # not "Ms-swift"
            out.append(f"### {title}" if group else "### Flags")
        help_text = f["metadata"].get("help") or f["comment"]
        choices = f["metadata"].get("choices")
        if choices:
            help_text = f"{help_text} (one of: {', '.join(map(str, choices))})"
        rows.append([code("--" + f["name"]), code(f["type"]), code(_shown_default(f["default"])), cell(help_text)])
    flush()
    return (f"{len(fields)} flags are mmembed's own, the fields of `SftFlags` (`{where}`, in the order of its "
            "source), which `SftArguments` checks; "
            "every other `transformers.TrainingArguments` flag is taken too, with transformers' default.\n\n"
            + "\n\n".join(out))


def swift_flags() -> str:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    module = importlib.import_module("mmembed.training.swift_flags")
    no_effect = [[code("--" + name), cell(why)] for name, why in module.NO_EFFECT.items()]
    fields = [[code("--" + name), code(_shown_default(ast.parse(repr(value), mode="eval").body)), cell(why)]
              for name, (value, why) in module.NO_EFFECT_FIELDS.items()]
    refused = [[code("--" + name), ", ".join(code(v) if v else "''" for v in harmless), cell(instead)]
               for name, (instead, harmless) in module.REFUSED.items()]
    if not (no_effect and refused and fields):
        raise PluginError("docs/hooks/generated.py: mmembed/training/swift_flags.py lost a table")
    return "\n\n".join([
        f"### Accepted, no effect ({len(no_effect)} flags: `NO_EFFECT`)",
        "One log line names the flag and says why, as below.",
        _table(["flag", "why it changes nothing here"], no_effect),
        f"### Kept as fields, no effect ({len(fields)} flags: `NO_EFFECT_FIELDS`)",
        "Another value than what mmembed does is logged in one line with the reason.",
        _table(["flag", "what mmembed does", "why another value changes nothing"], fields),
        f"### Refused ({len(refused)} flags: `REFUSED`)",
        "Exit status 2 with what to use instead; given ms-swift's default value (the middle column) "
        "the flag is accepted with a log line, so scripts that spell defaults out run.",
        _table(["flag", "accepted values (ms-swift's default)", "what to use instead"], refused),
    ])


def _argparse_flags(function: ast.FunctionDef) -> dict:
    """The ``prog``, ``description`` and flags (one per ``add_argument`` call, in source order:
    ``names``, and the call's keywords as ``ast`` nodes) of a function that builds a parser."""
    parser = {"prog": "", "description": "", "flags": []}
    for node in (n for statement in function.body for n in ast.walk(statement)):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if getattr(node.func, "id", "") == "ArgumentParser":
            parser["prog"] = _literal(keywords.get("prog")) or ""
            parser["description"] = _literal(keywords.get("description")) or ""
        elif getattr(node.func, "attr", "") == "add_argument":
            parser["flags"].append({"names": [_literal(a) for a in node.args], **keywords})
        elif getattr(node.func, "id", "") in SHARED_FLAGS:  # flags a helper adds to several commands' parsers
            where, name = SHARED_FLAGS[node.func.id]
            parser["flags"].extend(_argparse_flags(_function(_source(where)[0], name, where))["flags"])
    return parser


#: functions that add the same flags to several tools' parsers: name -> (file, function)
SHARED_FLAGS = {"add_hub_flags": ("mmembed/hub.py", "add_hub_flags")}


def tool_parsers() -> list[dict]:
    """Each tool of ``mmembed`` but ``sft`` (``COMMANDS`` of ``cli.py``, aliases once) with its
    parser (:func:`_argparse_flags`) and ``command`` / ``function`` names."""
    tree, _ = _source("mmembed/tools/cli.py")
    commands = next((n.value for n in tree.body if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", "") == "COMMANDS"), None)
    if not isinstance(commands, ast.Dict):
        raise PluginError("docs/hooks/generated.py: mmembed/tools/cli.py has no COMMANDS table")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    serve_tree, _ = _source("mmembed/tools/serve.py")
    functions["cmd_serve"] = _function(serve_tree, "parse_serve_args", "mmembed/tools/serve.py")
    tools, seen = [], set()
    for key, value in zip(commands.keys, commands.values):
        command, function = _literal(key), value.id
        if function == "cmd_sft" or function in seen:  # sft's flags: SftArguments
            continue
        seen.add(function)
        if function not in functions:
            raise PluginError(f"docs/hooks/generated.py: no function {function} for mmembed {command}")
        parser = _argparse_flags(functions[function])
        if not parser["flags"]:
            raise PluginError(f"docs/hooks/generated.py: mmembed {command} ({function}) adds no flags")
        tools.append({"command": command, "function": function, **parser})
    return tools


def _flag_row(flag: dict) -> list[str]:
    kind = flag.get("type")
    kind_name = "bool" if isinstance(kind, ast.Name) and kind.id in ("_bool", "string_to_bool") else (
        ast.unparse(kind) if kind is not None else "")
    default = _shown_default(flag.get("default"))
    if _literal(flag.get("action")) == "store_true":
        kind_name, default = "switch", ""
    help_text = _literal(flag.get("help")) or ""
    choices = _literal(flag.get("choices"))
    if choices:
        help_text = f"{help_text}{'; ' if help_text else ''}one of: {', '.join(map(str, choices))}"
    if _literal(flag.get("nargs")) == "?":
        help_text = f"{help_text}{'; ' if help_text else ''}alone: {_shown_default(flag.get('const'))}"
    required = bool(_literal(flag.get("required")))
    return [" ".join(code(n) for n in flag["names"]), code(kind_name), "(required)" if required else code(default),
            cell(help_text)]


def tool_flags() -> str:
    tree, _ = _source("mmembed/tools/cli.py")
    usage = next((_literal(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "USAGE"), None)
    if not usage:
        raise PluginError("docs/hooks/generated.py: mmembed/tools/cli.py has no USAGE")
    out = ["```\n" + usage.rstrip() + "\n```"]
    for tool in tool_parsers():
        out.append(f"### `{tool['prog'] or 'mmembed ' + tool['command']}`")
        if tool["description"]:
            out.append(cell(tool["description"]))
        out.append(_table(["flag", "type", "default", "meaning"], [_flag_row(f) for f in tool["flags"]]))
    return "\n\n".join(out)


def template_fields() -> str:
    where = "mmembed/encoding/templates.py"
    tree, lines = _source(where)
    fields = _dataclass_fields(_class(tree, "Template", where), lines)
    if not fields:
        raise PluginError(f"docs/hooks/generated.py: Template in {where} has no fields")
    rows = [[code(f["name"]), code(f["type"]), code(_shown_default(f["default"])) if f["default"] is not None
             else "(required)"] for f in fields]
    return _table(["field", "type", "default"], rows)


def templates() -> str:
    folder = os.path.join(ROOT, "templates")
    rows = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".toml"):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            t = tomllib.load(f)
        rows.append([code(name), code(t.get("task", "embedding")),
                     ", ".join(code(m) for m in t.get("model_types", ())), code(t.get("pooling", "auto")),
                     code(t.get("padding_side", "right")), code(t.get("tower", "")),
                     ", ".join(code(k) for k in t.get("media", {})), cell(t.get("description", ""))])
    if not rows:
        raise PluginError("docs/hooks/generated.py: templates/ holds no .toml file")
    return _table(["file", "task", "model types", "pooling", "padding", "tower", "media", "description"], rows)


#: the kind of template each ms-swift task searches (``Task.template_task`` of mmembed/tasks/*,
#: held equal by tests/tools/test_swift_model_list.py)
TEMPLATE_TASK = {"embedding": "embedding", "reranker": "reranker", "generative_reranker": "reranker"}
SWIFT_MODEL_LIST = "tests/fixtures/swift/model_list.json"  # made by tests/fixtures/swift/make_model_list.py


def swift_model_statuses() -> list[dict]:
    """Each model type of ms-swift's list (``tests/fixtures/swift/model_list.json``) with
    mmembed's status: the template that names it among the templates of its task (as
    ``get_template(model_type=...)`` finds it), else the reason of ``NOT_SUPPORTED``
    (``mmembed/encoding/swift_models.py``)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    reasons = importlib.import_module("mmembed.encoding.swift_models")
    where = SWIFT_MODEL_LIST
    with open(os.path.join(ROOT, where), encoding="utf-8") as f:
        listed = json.load(f)
    folder = os.path.join(ROOT, "templates")
    templates = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".toml"):
            with open(os.path.join(folder, name), "rb") as f:
                templates.append(tomllib.load(f))
    out = []
    for entry in listed["model_types"]:
        model_type, task = entry["model_type"], entry["task"]
        if task not in TEMPLATE_TASK:
            raise PluginError(f"docs/hooks/generated.py: {where}: {model_type}'s task {task!r} is not one of "
                              f"{', '.join(TEMPLATE_TASK)}")
        found = next((t["name"] for t in templates if t.get("task", "embedding") == TEMPLATE_TASK[task]
                      and (model_type in t.get("model_types", ()) or model_type == t["name"])), None)
        if found:
            status = {"status": "supported", "mmembed_template": found}
        elif model_type in reasons.NOT_SUPPORTED:
            status = {"status": "not supported", "why": reasons.NOT_SUPPORTED[model_type]}
        else:
            raise PluginError(f"docs/hooks/generated.py: ms-swift's model type {model_type} ({where}) has no "
                              "template and no reason in mmembed/encoding/swift_models.py")
        out.append({**entry, **status})
    return out


def swift_models() -> str:
    with open(os.path.join(ROOT, SWIFT_MODEL_LIST), encoding="utf-8") as f:
        listed = json.load(f)
    rows, counts = [], {}
    for e in swift_model_statuses():
        counts[e["status"]] = counts.get(e["status"], 0) + 1
        ids = ", ".join(code(i["huggingface"] or i["modelscope"]) for i in e["model_ids"])
        mine = (f"supported: template {code(e['mmembed_template'])}" if e["status"] == "supported"
                else f"{e['status']}: {cell(e['why'])}")
        rows.append([code(e["model_type"]), code(e["task"]), ids, ", ".join(code(a) for a in e["architectures"]),
                     f"{code(e['template'] or '')} ({code(e['loader'][0])})", mine])
    summary = "; ".join(f"{n} {status}" for status, n in counts.items())
    return (f"ms-swift {listed['versions']['ms_swift']} registers {listed['registered_model_types']} model types, "
            f"{len(rows)} of them for embedding or reranking ({summary}):\n\n"
            + _table(["`--model_type`", "`--task_type`", "model ids", "architectures", "ms-swift template (loader)",
                      "mmembed"], rows))


CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _unescape_pipes_in_code(markdown: str) -> str:
    """A table row written for GitHub escapes a ``|`` inside a code span (``<\\|im_end\\|>``),
    which GitHub needs and Python-Markdown would show as written: take the backslash out of
    code spans on table rows."""
    def row(line: str) -> str:
        if not line.startswith("|"):
            return line
        return CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)

    return "\n".join(row(line) for line in markdown.split("\n"))


TABLES = {"sft-flags": sft_flags, "swift-flags": swift_flags, "tool-flags": tool_flags,
          "template-fields": template_fields, "templates": templates, "swift-models": swift_models}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise PluginError(f"{page.file.src_path}: unknown marker <!-- generated: {name} --> "
                              f"(known: {', '.join(TABLES)})")
        return TABLES[name]()

    return _unescape_pipes_in_code(MARKER.sub(replace, markdown))


SPHINX_ROLE = re.compile(r":(?:meth|class|func|attr|data|mod|exc|obj):<code>(~?)([^<]*)</code>")


def on_page_content(html_text: str, page, config, files) -> str:
    """The docstrings' Sphinx roles (``:class:`~a.b.C```), rendered by mkdocstrings as the
    role's name before a code span, shown as Sphinx shows them: the code span alone, only the
    last name after a ``~``."""
    return SPHINX_ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>",
                           html_text)
