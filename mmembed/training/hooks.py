"""Test-only hooks of the checkpoint protocol (``MMEMBED_TEST_KILL_AT``, ``MMEMBED_TEST_FULL_AT``,
``MMEMBED_TEST_PAUSE_AT`` / ``MMEMBED_TEST_PAUSE_FILE``; :class:`~mmembed.environment.TestHooks`):
the saving code calls :func:`test_point` at each named point of a save, a rotation and a
training step, and a test that set a variable makes the process die there (SIGKILL), find the
disk full from there on, or pause there until the test removes a file. Read once when a run
starts (:func:`arm_test_hooks`); a run that arms none pays one dictionary lookup per point.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from ..environment import TestHooks

_hits: Counter = Counter()
_armed = {"hooks": TestHooks()}  # the run's, read once when it starts (arm_test_hooks)


def arm_test_hooks(hooks: TestHooks) -> None:
    """The run's test-only hooks (``MMEMBED_TEST_*``, read once where the run starts): every
    :func:`test_point` of the run follows these, counted from 0."""
    _armed["hooks"] = hooks
    _hits.clear()


def test_point(name: str) -> None:
    """Test-only hooks (see the module docstring); nothing happens unless
    ``MMEMBED_TEST_KILL_AT``, ``MMEMBED_TEST_FULL_AT`` or ``MMEMBED_TEST_PAUSE_AT`` names this
    point (as :func:`arm_test_hooks` was given them at the run's start)."""
    hooks = _armed["hooks"]
    if not hooks:
        return
    _test_pause(name, hooks)
    for var, spec in (("MMEMBED_TEST_KILL_AT", hooks.kill_at), ("MMEMBED_TEST_FULL_AT", hooks.full_at)):
        if not spec:
            continue
        point, _, count = spec.rpartition(":")
        if point != name:
            continue
        _hits[var, name] += 1
        if _hits[var, name] != int(count):
            continue
        if var == "MMEMBED_TEST_KILL_AT":
            os.kill(os.getpid(), signal.SIGKILL)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _test_pause(name: str, hooks: TestHooks) -> None:
    spec = hooks.pause_at
    if not spec:
        return
    _hits["MMEMBED_TEST_PAUSE_AT", name] += 1
    if f"{name}:{_hits['MMEMBED_TEST_PAUSE_AT', name]}" not in spec.split(","):
        return
    if hooks.pause_file is None:
        raise KeyError("MMEMBED_TEST_PAUSE_FILE")
    flag = hooks.pause_file
    if hooks.rank:  # under torchrun: one file per process
        flag += f".rank{hooks.rank}"
    with open(flag + ".tmp", "w", encoding="utf-8") as f:
        f.write(f"{name} {os.getpid()}")
    os.replace(flag + ".tmp", flag)  # the test sees the file whole
    deadline = time.monotonic() + 600
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)
