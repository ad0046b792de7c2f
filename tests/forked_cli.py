"""Run the ``mmembed`` command line in a child process, forked from a server that imported
torch, transformers and mmembed once: a run costs its own work rather than the imports, and
the child is a real process that a test can kill (SIGKILL) or starve of disk."""

import multiprocessing
import os
import sys
import tempfile
import threading
from dataclasses import dataclass

_context = None


@dataclass
class Result:
    returncode: int  # -9: killed by SIGKILL
    stdout: str
    stderr: str


def _child(argv: list[str], env: dict[str, str], out_path: str, err_path: str, file_size_limit: int | None,
           user: int | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    import torch

    torch.set_num_threads(1)
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
    global _context  # noqa: PLW0603  (one forkserver context for the whole test session)
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "transformers", "mmembed.training.sft", "mmembed.tools.cli",
                                         "mmembed.model.embedder", "forked_cli"])
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
