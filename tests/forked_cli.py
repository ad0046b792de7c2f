"""Run the ``mmembed`` command line in a child process, forked from a server that imported
torch, transformers and mmembed once: a run costs its own work rather than the imports, and
the child is a real process that a test can kill (SIGKILL) or starve of disk."""

import multiprocessing
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

_context = None


@dataclass
class Result:
    returncode: int  # -9: killed by SIGKILL
    stdout: str
    stderr: str


def _enter(env: dict[str, str], out_path: str, err_path: str) -> None:
    """A forked child's start: exactly ``env`` as its environment, its output to ``out_path`` /
    ``err_path`` (named pipes, or files made here), one torch thread."""
    os.environ.clear()
    os.environ.update(env)
    # as a fresh interpreter would: PYTHONPATH's folders first on sys.path (a test's own loss module)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # huggingface_hub and datasets read their variables (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE)
    # once, at import, in the server: read again from this child's, as a fresh process would
    import importlib

    for name in ("huggingface_hub.constants", "datasets.config"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    import tempfile

    tempfile.tempdir = None  # the temporary folder of this child's TMPDIR, not the server's cached one
    import torch

    torch.set_num_threads(1)
    # a process the forkserver starts inherits its start method; a fresh interpreter's is fork
    # (Linux), which its DataLoader workers and datasets' processes use: with forkserver each
    # process of a run would start a server of its own that imports torch and mmembed again
    multiprocessing.set_start_method("fork", force=True)
    if env.get("MMEMBED_TEST_PROFILE"):
        _profile(env["MMEMBED_TEST_PROFILE"], f"rank{env['RANK']}" if "RANK" in env else f"pid{os.getpid()}")


def _profile(folder: str, name: str) -> None:
    """cProfile this forked process from here on, written to ``folder/NAME.prof`` when it leaves:
    every forked process ends with ``os._exit`` (multiprocessing's, after the target returns or
    raises SystemExit; a distributed run's own, cli._close_process_group), so the dump goes there."""
    import cProfile

    profile = cProfile.Profile()
    leave = os._exit

    def dump_then_exit(code: int) -> None:
        profile.disable()
        os.makedirs(folder, exist_ok=True)
        profile.dump_stats(os.path.join(folder, f"{name}.prof"))
        leave(code)

    os._exit = dump_then_exit
    profile.enable()


def _child(argv: list[str], env: dict[str, str], out_path: str, err_path: str, file_size_limit: int | None,
           user: int | None) -> None:
    _enter(env, out_path, err_path)
    from mmembed.tools.cli import main

    if user is not None:
        os.setgid(user)
        os.setuid(user)
    if file_size_limit is not None:  # a full disk: a write past this size fails with EFBIG
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _rank(args: list[str], env: dict[str, str], out_path: str, err_path: str, cwd: str) -> None:
    """One process of a forked multi-process run: ``python ARGS`` (``-m mmembed ...`` or a
    script with its arguments) with the variables torchrun gives a worker."""
    import runpy

    os.chdir(cwd)
    _enter(env, out_path, err_path)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            if args[1] in ("mmembed", "mmembed.tools.cli"):
                from mmembed.tools.cli import main

                code = main(args[2:])
            else:
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (printed as python would, then the exit code)
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_ranks(args: list[str], nproc: int, env: dict[str, str] | None = None, timeout: float = 600,
              cwd: str | None = None) -> Result:
    """``torchrun --standalone --nproc_per_node NPROC ARGS`` without torchrun: NPROC processes
    forked from the server that imported torch, transformers and mmembed once, each given the
    variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...).
    As torchrun does, when one process fails the others are stopped. The exit code is the
    first failing process's (0 when all succeed); the output is every process's, in rank order."""
    _server()
    from conftest import free_port

    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "forked", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as d:
        procs, files = [], []
        for r in range(nproc):
            out, err = os.path.join(d, f"out{r}"), os.path.join(d, f"err{r}")
            files.append((out, err))
            rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
            procs.append(_context.Process(target=_rank, args=(list(args), rank_env, out, err, cwd or os.getcwd())))
            procs[-1].start()
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.exitcode is None for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise TimeoutError(f"python {' '.join(args)} in {nproc} processes ran over {timeout}s")
            for p in procs:
                if p.exitcode not in (None, 0) and failed is None:
                    failed = p.exitcode
                    for q in procs:  # as torchrun: one failed, the others are stopped
                        if q.exitcode is None:
                            q.kill()
            time.sleep(0.05)
        for p in procs:
            p.join()
        if failed is None:
            failed = next((p.exitcode for p in procs if p.exitcode), 0)
        text = ["".join(open(path, encoding="utf-8", errors="replace").read() for path in paths) for paths in zip(*files)]
        return Result(failed, *text)


def _server() -> None:
    global _context  # noqa: PLW0603  (one forkserver context for the whole test session)
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # DeepSpeed (and matplotlib, which it imports) too: ~2 s of every DeepSpeed process's start
        # here. mmembed imports DeepSpeed only for a run that uses it; the tests of that rule run
        # in fresh interpreters (tests/training/test_quiet_deepspeed.py). forkserver_warm: what
        # every run would still do first (DeepSpeed's Muon import, matplotlib's first chart)
        _context.set_forkserver_preload(["torch", "transformers", "deepspeed", "mmembed.training.sft",
                                         "mmembed.tools.cli", "mmembed.model.embedder", "forked_cli",
                                         "forkserver_warm"])


def _drain(path: str, chunks: list[bytes]) -> None:
    with open(path, "rb") as f:
        while data := f.read(65536):
            chunks.append(data)


def run_cli(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600,
            file_size_limit: int | None = None, user: int | None = None) -> Result:
    """``mmembed ARGV`` in a forked child with ``os.environ`` plus ``env``; its exit code and
    output. ``file_size_limit``: no file can grow past so many bytes (``RLIMIT_FSIZE``), as if
    the disk were full; ``user``: run as this user id (a read-only folder means nothing to root).
    The output comes through named pipes, which a file size limit does not touch."""
    _server()
    with tempfile.TemporaryDirectory() as d:
        pipes = [os.path.join(d, "out"), os.path.join(d, "err")]
        outputs: list[list[bytes]] = [[], []]
        readers = []
        for path, chunks in zip(pipes, outputs):
            os.mkfifo(path, 0o666)
            readers.append(threading.Thread(target=_drain, args=(path, chunks), daemon=True))
            readers[-1].start()
        proc = _context.Process(target=_child, args=(list(argv), {**os.environ, **(env or {})}, *pipes,
                                                       file_size_limit, user))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise TimeoutError(f"mmembed {' '.join(argv)} ran over {timeout}s")
        for t in readers:
            t.join(10)
        text = [b"".join(chunks).decode("utf-8", errors="replace") for chunks in outputs]
        return Result(proc.exitcode, *text)
