"""Run the ``mmembed`` command line in a child process, forked from a server that imported
torch, transformers and mmembed once: a run costs its own work rather than the imports, and
the child is a real process that a test can kill (SIGKILL) or starve of disk."""

import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass

_context = None


@dataclass
class Result:
    returncode: int  # -9: killed by SIGKILL
    stdout: str
    stderr: str


def _child(argv: list[str], env: dict[str, str], out_path: str, err_path: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    import torch

    torch.set_num_threads(1)
    from mmembed.tools.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_cli(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> Result:
    """``mmembed ARGV`` in a forked child with ``os.environ`` plus ``env``; its exit code and output."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "transformers", "mmembed.training.sft", "mmembed.tools.cli",
                                         "mmembed.model.embedder", "forked_cli"])
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        proc = _context.Process(target=_child, args=(list(argv), {**os.environ, **(env or {})}, out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise TimeoutError(f"mmembed {' '.join(argv)} ran over {timeout}s")
        read = lambda p: open(p, encoding="utf-8", errors="replace").read() if os.path.exists(p) else ""  # noqa: E731
        return Result(proc.exitcode, read(out), read(err))
