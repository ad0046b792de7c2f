"""Errors a command reports in one line, and the argument parser that reports its own the same way.

Every ``mmembed`` command stops a bad flag, option or environment variable with one line,
``mmembed COMMAND: error: ...``, and exit status 2 (``--debug true`` or ``MMEMBED_DEBUG=1``:
the traceback instead). This module is the bottom of the package (no torch, no
transformers), so every layer may raise :class:`UsageError`.
"""

from __future__ import annotations

import argparse

TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off", "")


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
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    raise UsageError(f"{flag} must be true or false (or 1/0), got {text!r}")
