"""Writing output files whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def replaced_when_done(path: str, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; when the block ends without an
    error it takes ``path``'s place (an atomic rename), otherwise it is removed. Readers see
    the old file or the complete new one, never a part."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
