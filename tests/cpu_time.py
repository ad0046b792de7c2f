"""CPU seconds per test, for ranking the suite by what it costs rather than by wall time (two
workers share two cores, so a test's wall time says as much about its neighbour as itself).

With ``MMEMBED_TEST_CPU=FOLDER`` each pytest worker appends one JSON line per test to
``FOLDER/<worker>.jsonl``: the test's id, when it ended (epoch seconds), its wall seconds (setup, call and teardown, so a
session fixture's build counts to the first test that uses it), and the CPU seconds spent in

- ``self``: the worker process,
- ``children``: its child processes it waited for (``subprocess.run``: a fresh interpreter,
  torchrun and the workers torchrun waited for),
- ``forked``: the processes forked from the tests' forkserver (``tests/forked_cli.py``), which
  the forkserver waits for; read from its ``/proc/PID/stat`` (``cutime`` + ``cstime``).

``python tests/cpu_time.py FOLDER`` prints the files and tests that cost most. Off unless the
variable is set (the hook then does nothing)."""

import json
import os
import resource
import sys
import time

import pytest

FOLDER = os.environ.get("MMEMBED_TEST_CPU")
TICKS = os.sysconf("SC_CLK_TCK")


def _forkserver_cpu() -> float:
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields after the name: state is [0], utime [11], stime [12], cutime [13], cstime [14]
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS
    except (OSError, AttributeError, IndexError, ValueError):
        return 0.0


def _cpu() -> tuple[float, float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, _forkserver_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not FOLDER:
        yield
        return
    start, before = time.monotonic(), _cpu()
    yield
    after = _cpu()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.makedirs(FOLDER, exist_ok=True)
    row = {"test": item.nodeid, "end": round(time.time(), 1), "wall": round(time.monotonic() - start, 2),
           **{k: round(max(b - a, 0.0), 2) for k, a, b in zip(("self", "children", "forked"), before, after)}}
    with open(os.path.join(FOLDER, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def _report(folder: str, top: int = 40) -> None:
    rows = [json.loads(line) for name in sorted(os.listdir(folder)) if name.endswith(".jsonl")
            for line in open(os.path.join(folder, name))]
    for row in rows:
        row["cpu"] = row["self"] + row["children"] + row["forked"]
    by_file: dict[str, list[float]] = {}
    for row in rows:
        acc = by_file.setdefault(row["test"].split("::")[0], [0.0, 0.0, 0])
        acc[0] += row["cpu"]
        acc[1] += row["wall"]
        acc[2] += 1
    for name in sorted(os.listdir(folder)):  # when each worker finished: an idle worker at the end is lost time
        ends = [json.loads(line).get("end", 0) for line in open(os.path.join(folder, name))]
        print(f"{name[:-6]}: last test ended {time.strftime('%H:%M:%S', time.localtime(max(ends)))}")
    print(f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} CPU s, {sum(r['wall'] for r in rows):.0f} wall s "
          f"(self {sum(r['self'] for r in rows):.0f}, children {sum(r['children'] for r in rows):.0f}, "
          f"forked {sum(r['forked'] for r in rows):.0f})")
    print("\n   CPU s   wall s  tests  file")
    for name, (cpu, wall, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {name}")
    print("\n   CPU s   wall s   self  child forked  test")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{r['cpu']:8.1f} {r['wall']:8.1f} {r['self']:6.1f} {r['children']:6.1f} {r['forked']:6.1f}  {r['test']}")


if __name__ == "__main__":
    _report(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
