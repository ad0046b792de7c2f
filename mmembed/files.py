"""Writing output files whole or not at all, and saying in one line which path could not be written."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO


class WriteError(OSError):
    """An output could not be written (disk full, read-only folder, file too large, ...).
    ``str()`` is one line naming the path and the cause; nothing partial is left under the
    path's name."""

    def __init__(self, path: str, cause: BaseException):
        self.path = path
        super().__init__(getattr(cause, "errno", None), f"cannot write {path}: {describe(cause)}")

    def __str__(self) -> str:
        return self.args[1]


def describe(exc: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error's text, or the first line of
    the message (torch and safetensors wrap the OS error in their own exceptions)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


@contextlib.contextmanager
def replaced_when_done(path: str, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; when the block ends without an
    error it is flushed to disk and takes ``path``'s place (an atomic rename), otherwise it is
    removed. Readers see the old file or the complete new one, never a part. A write that
    fails (full disk, read-only folder) raises :class:`WriteError` naming ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=folder)
        os.fchmod(fd, 0o666 & ~_umask())  # the permissions a plain open() would give, not mkstemp's 0600
    except OSError as e:
        raise WriteError(path, e) from e
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if "b" in mode and os.fstat(f.fileno()).st_size < f.tell():
                # numpy writes through a C FILE* of its own and loses the error of its last flush
                raise OSError(errno.EFBIG, f"only {os.fstat(f.fileno()).st_size} of {f.tell()} bytes reached the disk")
        os.replace(tmp, path)
        sync_folder(folder)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(path, e) from e
        raise


@contextlib.contextmanager
def folder_replaced_when_done(path: str) -> Iterator[str]:
    """Like :func:`replaced_when_done` for a folder: yields a temporary folder beside ``path``
    to write into; when the block ends without an error it takes ``path``'s name (which must
    not exist), otherwise it is removed and any error becomes a :class:`WriteError` naming ``path``."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())  # the mode a plain mkdir would give, not mkdtemp's 0700
    except OSError as e:
        raise WriteError(path, e) from e
    try:
        yield tmp
        sync_tree(tmp)
        os.rename(tmp, path)
        sync_folder(parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, WriteError):
            raise WriteError(path, e) from e
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sync_folder(path: str) -> None:
    """Flush a folder's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str, hashes: dict[str, str] | None = None, written: dict[str, str] | None = None) -> dict[str, int]:
    """Flush every file under ``root`` and the folders holding them to disk; returns each
    file's size by its path relative to ``root``. With ``hashes`` (a dict), each file's sha256
    (hex) goes into it by the same path: taken from ``written`` (the digests computed while the
    files were written, :class:`HashingWriter`) for the files it names, otherwise read once,
    through the descriptor that flushes it (just written, it comes from the page cache), before
    the flush."""
    import hashlib

    written = written or {}
    sizes = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            with open(path, "rb") as f:
                if hashes is not None:
                    if rel in written:
                        hashes[rel] = written[rel]
                    else:
                        digest = hashlib.sha256()
                        while block := f.read(1 << 20):
                            digest.update(block)
                        hashes[rel] = digest.hexdigest()
                os.fsync(f.fileno())
            sizes[rel] = os.path.getsize(path)
        sync_folder(folder)
    return sizes


class HashingWriter:
    """A binary file opened for writing that computes the sha256 of what goes through it, for
    writers that take a file object (``torch.save``): the digest is had without reading the
    file back."""

    def __init__(self, path: str):
        import hashlib

        self._file = open(path, "wb")  # a buffered file: write() takes every byte or raises
        self._digest = hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data)
        self._file.write(view)
        self._digest.update(view)
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading a model folder's small files once ---------------------------------------------------

_READ: dict[tuple[str, str, int, int], object] = {}


def read_once(path: str, read, kind: str) -> object:
    """``read(path)``, called once per process for ``kind`` as long as the file stays the same
    (its size and modification time); later calls give the object read then (the caller copies
    it when it hands it on).

    Raises:
        OSError: ``path`` cannot be stat'ed; and what ``read`` raises (nothing is kept then).
    """
    stat = os.stat(path)
    key = (kind, os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _READ:
        _READ[key] = read(path)
    return _READ[key]


def _load_json(path: str) -> object:
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_once(path: str) -> object:
    """``json.load`` of ``path`` (a model folder's ``config.json``, ``modules.json``,
    ``config_sentence_transformers.json``, ...), read from the disk once per process as long as
    the file stays the same (its size and modification time): the run's checks, the template's
    pooling and the encoding all ask for the same few files. Each call gets its own copy.

    Raises:
        OSError, ValueError: as ``open`` and ``json.load`` do (nothing is kept then).
    """
    import copy

    return copy.deepcopy(read_once(path, _load_json, "json"))
