"""Where the CPU test suite's time goes: CPU-seconds of each test, Ray's daemons and trial processes included.

The suite on a 2-core machine is CPU-bound once two pytest-xdist workers run (each Ray start, trial process and
torch import is CPU), and ``time pytest`` misses most of it: Ray's GCS, raylet, agents and workers daemonize, so
their CPU is never a child's of pytest. This script runs pytest in its own cpuacct cgroup (cgroup v1, root
needed), which every process it starts inherits, and reads the cgroup's CPU-nanoseconds around each test
(setup + call + teardown) with a plugin loaded into pytest. Run it with one worker (``-n 0``, the default here) so
each test's CPU is its own; under xdist the figures of concurrent tests mix.

Usage (repository root):  .venv/bin/python benchmarks/suite_cpu.py [--top 30] [pytest args...]
Prints wall, CPU-seconds of the whole run and the tests with the most CPU-seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CGROOT = Path("/sys/fs/cgroup/cpuacct")

PLUGIN = '''
import json, os, time
import pytest

_USAGE = os.environ["JT_CPU_USAGE"]
_rows = []

def _cpu():
    with open(_USAGE) as f:
        return int(f.read()) / 1e9

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0 = _cpu(), time.perf_counter()
    yield
    _rows.append((item.nodeid, _cpu() - c0, time.perf_counter() - t0))

def pytest_sessionfinish(session):
    with open(os.environ["JT_CPU_OUT"], "w") as f:
        json.dump(_rows, f)
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    args, pytest_args = parser.parse_known_args()
    if not (CGROOT / "cpuacct.usage").exists():
        print(f"needs cgroup v1 cpuacct at {CGROOT}", file=sys.stderr)
        return 2
    group = CGROOT / f"jt-suite-{os.getpid()}"
    group.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "jt_cpu_plugin.py").write_text(PLUGIN)
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "JT_CPU_USAGE": str(group / "cpuacct.usage"), "JT_CPU_OUT": str(out),
               "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH", "")]))}

        def enter() -> None:  # the child joins the cgroup before exec: everything it starts is counted
            (group / "tasks").write_text(str(os.getpid()))

        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "jt_cpu_plugin", "-p", "no:cacheprovider",
                              *(pytest_args or ["-n", "0"])], env=env, preexec_fn=enter)
        wall = time.perf_counter() - t0
        total = int((group / "cpuacct.usage").read_text()) / 1e9
        rows = json.loads(out.read_text()) if out.exists() else []
    try:
        group.rmdir()
    except OSError:
        pass  # a daemon Ray left behind still holds it
    print(f"\nwall {wall:.1f} s, CPU {total:.1f} s ({total / wall:.2f} cores busy on average)")
    print(f"{'cpu s':>7} {'wall s':>7}  test")
    for nodeid, cpu, w in sorted(rows, key=lambda r: -r[1])[:args.top]:
        print(f"{cpu:7.1f} {w:7.1f}  {nodeid}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
