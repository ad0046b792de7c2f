"""The package's shape: each folder imports only from the folders before it in the flow,
no module comes back to itself through its imports (a circle, imports for annotations under
``if TYPE_CHECKING:`` and inside functions counted), outside losses/ no code decides anything
by comparing loss names, no module is over 600 lines, no committed file names a path of one
machine, and benchmarks/ is a package of short modules that neither edits ``sys.path`` nor imports
from tests/ or examples/."""

import ast
import os
import pathlib
import re

import pytest
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
    names = r"(infonce|gist|distill_\w*|cosine_similarity|contrastive|online_contrastive|matryoshka|\w*_reranker)"
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


def test_shared_code_asks_the_task():
    """Task code lives under mmembed/tasks/ and is found through mmembed.task's registry: no
    module of the shared layers imports mmembed.tasks, and none decides by a task's name
    (``task_type ==``, ``in``, or a task name compared)."""
    names = r"(embedding|reranker|generative_reranker|late_interaction)"
    compared = re.compile(r"task_type\b\)?\s*(==|!=|in\b|not in\b)|[\"']" + names + r"[\"']\s*(==|!=|in\b)"
                          r"|(==|!=)\s*[\"']" + names + r"[\"']|\bRERANK_TASKS\b")
    found = []
    for _, path in _modules():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
            elif isinstance(node, ast.Import):
                target = ",".join(a.name for a in node.names)
            if target and re.search(r"(^\.\.tasks\b|mmembed\.tasks\b)", target):
                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno} imports {target}")
        if path.endswith(os.path.join("encoding", "templates.py")):
            continue  # a template's own kind (embedding / reranker template), not a --task_type
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            if compared.search(line.split("#")[0]):
                found.append(f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def _module_name(path):
    parts = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules():
    """Every module of mmembed/ by its dotted name -> its file."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


def _sources():
    """mmembed's modules: dotted name -> (source, whether it is a package's ``__init__``)."""
    out = {}
    for name, path in _all_modules().items():
        with open(path, encoding="utf-8") as f:
            out[name] = (f.read(), path.endswith("__init__.py"))
    return out


def import_graph(sources=None):
    """The module import graph, read from the source (``sources``: dotted name -> (source,
    is a package's ``__init__``); default mmembed's files): module -> {module: first line}.

    Every ``import`` / ``from ... import`` counts: at module level, inside functions (a
    function's import runs when it is called, and the circle is still there) and under
    ``if TYPE_CHECKING:`` (a type needed only for an annotation still ties the two modules: the
    type belongs below both, or the function with the type). ``from A import n`` is an edge to
    ``A.n`` when that is a module, else to ``A``; a package's ``__init__`` run on the way to its
    submodule is not counted as an edge.
    """
    sources = _sources() if sources is None else sources
    graph = {}
    for name, (text, is_package) in sources.items():
        tree = ast.parse(text)
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in sources else source)
            for target in targets:
                if target in sources and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def _cycles(graph):
    """One circle (a list of modules, first == last) per strongly connected part of the graph,
    with the part's other modules (on other circles through it) after it."""
    index, low, stack, on_stack, parts = {}, {}, [], set(), []

    def visit(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, {})):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            part = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.add(member)
                if member == node:
                    break
            if len(part) > 1:
                parts.append(part)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for part in parts:  # the shortest way back to the part's first module, inside the part
        start = min(part)
        paths = {start: [start]}
        queue = [start]
        while queue:
            node = queue.pop(0)
            for succ in sorted(graph[node]):
                if succ == start:
                    cycles.append((paths[node] + [start], sorted(part - set(paths[node]))))
                    queue = []
                    break
                if succ in part and succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    queue.append(succ)
    return sorted(cycles)


def test_the_cycle_finder_names_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert _cycles(graph) == [(["a", "b", "c", "a"], [])]
    graph["b"]["f"] = 6
    graph["f"] = {"b": 7}
    assert _cycles(graph) == [(["a", "b", "c", "a"], ["f"])]


def _circles(graph):
    """Each circle of ``graph`` as a line: ``a (line 3) -> b (line 7) -> a``, then the part's
    other modules."""
    circles = []
    for cycle, others in _cycles(graph):
        steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        circles.append(" -> ".join(steps + [cycle[-1]]) + (f"; also in the circle: {', '.join(others)}" if others else ""))
    return circles


def test_an_import_for_annotations_or_in_a_function_closes_a_circle_too():
    """The graph counts what ``if TYPE_CHECKING:`` guards and what a function imports: the
    circles mmembed had (issue 39: inputs / measure, serve / serve_rerank, arguments /
    flag_checks) were closed by imports for annotations."""
    sources = {
        "p": ("", True),
        "p.inputs": ("from .measure import lengths\n\nclass Builder: ...\n", False),
        "p.measure": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .inputs import Builder\n\n"
                      "def lengths(builder: 'Builder'): ...\n", False),
        "p.serve": ("def serve():\n    from p.serve_rerank import app\n", False),
        "p.serve_rerank": ("from . import serve\n", False),
        "p.config": ("from .measure import lengths\n", False),  # an edge into a circle, not on one
    }
    graph = import_graph(sources)
    assert graph["p.measure"] == {"p.inputs": 3} and graph["p.serve"] == {"p.serve_rerank": 2}
    assert _circles(graph) == ["p.inputs (line 1) -> p.measure (line 3) -> p.inputs",
                               "p.serve (line 2) -> p.serve_rerank (line 1) -> p.serve"]


def test_no_module_imports_itself_in_a_circle():
    """No circle, counting every import (:func:`import_graph`): a module that needs another's
    type only for an annotation is not needed by it in turn (the type lives below both, or
    the function with the type)."""
    graph = import_graph()
    assert "mmembed.losses.registry" in graph["mmembed.losses"]  # the graph is read at all
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_test_files_have_unique_names():
    """The test folders are not packages, so pytest imports each test file by its base name: two
    files of one name in different folders break the collection of the second."""
    import collections

    names = collections.Counter(p.name for p in pathlib.Path(REPO, "tests").rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], names.most_common(3)


MAX_LINES = 600


def test_no_module_is_over_600_lines():
    """A module that outgrows 600 lines is split where its parts meet (issue 27: dataset.py's
    Arrow build became data/arrow_rows.py, measure.py's media headers encoding/media_measure.py)."""
    long = {}
    for path in pathlib.Path(PACKAGE).rglob("*.py"):
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[str(path.relative_to(REPO))] = n
    assert not long, f"over {MAX_LINES} lines: {long}"


#: absolute folders of one machine (this project's workspace, a user's home): the repository's
#: files name paths relative to it, or take them from a variable or a flag
MACHINE_PATH = re.compile(r"(?<![\w.~$])/(?:work|root|home/\w+)/")


def test_no_file_names_a_path_of_one_machine():
    """The committed text files (``git ls-files``: not what a run leaves in the tree)."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    found = []
    for name in listed.stdout.split("\0"):
        path = pathlib.Path(REPO, name)
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".json", ".txt", ".cfg") \
                or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{i}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
    assert MACHINE_PATH.search("MMEMBED_SWIFT_PYTHON=" + "/wo" + "rk/swift-venv/bin/python")  # the pattern bites


BENCHMARKS = os.path.join(REPO, "benchmarks")
#: what benchmarks/ may not import: the folders tests/ and examples/ and the modules directly in them
#: (benchmarks/checkout.py reads the two files the benchmarks need by their paths)
NOT_FOR_BENCHMARKS = {"tests", "examples"} | {p.stem for top in ("tests", "examples")
                                               for p in pathlib.Path(REPO, top).glob("*.py")}
SYS_PATH_EDITS = {"insert", "append", "extend", "remove", "pop", "clear"}


def _is_sys_path(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _benchmark_problems(folder) -> list:
    """Each file under ``folder`` over MAX_LINES lines, each Python file without an opening
    docstring, each edit of ``sys.path`` (a call of its insert / append / ..., an assignment to it or
    to an item of it) and each import of a module of tests/ or examples/."""
    problems = []
    for path in sorted(pathlib.Path(folder).rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        name = path.relative_to(folder).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text.splitlines()) > MAX_LINES:
            problems.append(f"{name}: {len(text.splitlines())} lines, over {MAX_LINES}")
        if path.suffix != ".py":
            continue
        tree = ast.parse(text)
        if ast.get_docstring(tree) is None:
            problems.append(f"{name}: no opening docstring")
        found = []  # (line, problem): ast.walk goes level by level, the report line by line
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                modules = []
            found += [(node.lineno, f"{name}:{node.lineno} imports {m} (from tests/ or examples/)") for m in modules
                      if m.split(".")[0] in NOT_FOR_BENCHMARKS]
            edited = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                edited = _is_sys_path(node.func.value) and node.func.attr in SYS_PATH_EDITS
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                edited = any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value))
                             for t in targets)
            if edited:
                found.append((node.lineno, f"{name}:{node.lineno} edits sys.path"))
        problems += [problem for _, problem in sorted(found)]
    return problems


def test_benchmarks_are_a_package_of_short_modules_apart_from_tests_and_examples():
    """benchmarks/ (issue 45): no file over 600 lines, every module opening with a docstring, no
    ``sys.path`` edit (a command run as a file finds its package through benchmarks/_bootstrap.py),
    nothing imported from tests/ or examples/ (benchmarks/checkout.py reads what it needs of them by
    path)."""
    problems = _benchmark_problems(BENCHMARKS)
    assert not problems, "\n".join(problems)


def test_the_benchmark_check_names_each_violation(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "bad.py").write_text(
        '"""A planted violation."""\nimport sys\n\nimport tiny_models\nfrom tests.reference_losses import parse_groups\n'
        'sys.path.insert(0, "x")\nsys.path += ["y"]\nsys.path[0] = "z"\nprint(sys.path[0])\n')
    (tmp_path / "long.sh").write_text("echo\n" * (MAX_LINES + 1))
    (tmp_path / "bare.py").write_text("import os\n")
    assert _benchmark_problems(tmp_path) == [
        "bare.py: no opening docstring", f"long.sh: {MAX_LINES + 1} lines, over {MAX_LINES}",
        "sub/bad.py:4 imports tiny_models (from tests/ or examples/)",
        "sub/bad.py:5 imports tests.reference_losses (from tests/ or examples/)",
        "sub/bad.py:6 edits sys.path", "sub/bad.py:7 edits sys.path", "sub/bad.py:8 edits sys.path"]
