"""Errors a command reports in one line, and the argument parser that reports its own the same way.

Every ``mmembed`` command stops a bad flag, option or environment variable with one line,
``mmembed COMMAND: error: ...``, and exit status 2 (``--debug true`` or ``MMEMBED_DEBUG=1``:
the traceback instead). This module is the bottom of the package (no torch, no
transformers), so every layer may raise :class:`UsageError`.
"""

from __future__ import annotations

import argparse

_TRUE = ("1", "true", "yes", "y", "on")
_FALSE = ("0", "false", "no", "n", "off", "")


class UsageError(ValueError):
    """A flag, option or environment variable whose value cannot work, alone or with the
    others: reported as one line naming it, its value and what is allowed, exit status 2,
    before the model loads."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (a bad int, an unknown choice, a missing flag) raise
    :class:`UsageError` rather than print the whole usage and exit, so the command reports
    them in one line like its other errors."""

    def error(self, message: str):
        raise UsageError(message)


def one_line(error: BaseException | str) -> str:
    """An error's message on one line (transformers' and argparse's may span several)."""
    return " ".join(str(error).split())


def parse_bool(flag: str, text: str) -> bool:
    """true/false, yes/no, 1/0 (any case) as a bool, or a UsageError naming ``flag``."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise UsageError(f"{flag} must be true or false (or 1/0), got {text!r}")


def take_debug(argv: list[str], debug: bool | None = None) -> tuple[list[str], bool]:
    """``--debug [true|false]`` taken out of ``argv``, for every command; with it (or
    ``MMEMBED_DEBUG=1``: ``debug``, read from the environment when None) an error shows its
    traceback instead of one line. A value that is
    not a boolean (transformers' ``--debug underflow_overflow``) is left for the command's
    parser."""
    rest: list[str] = []
    if debug is None:
        from .environment import read

        debug = read().debug
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name != "--debug":
            rest.append(token)
            i += 1
            continue
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
        if value is not None and value.strip().lower() not in _TRUE + _FALSE:
            rest.append(token)  # not ours
            i += 1
            continue
        debug = True if value is None else parse_bool("--debug", value)
        i += 1 if eq or value is None else 2
    return rest, debug
