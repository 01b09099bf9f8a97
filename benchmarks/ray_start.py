"""How long a local Ray's GCS takes to come up, and how long a sweep waits for one that died.

``ray.init`` starts the GCS, then waits (``RAY_gcs_server_port_wait_time_s``, Ray's default 30 s) for it to write
its port file; the embedded start (``orchestrator/embedded_ray.start``) sets that wait to ``GCS_PORT_WAIT_S``. This
times, in this process, the wait of a GCS that comes up (``ray.init`` of a new local instance, ``--runs`` times),
idle or beside ``--busy`` processes that spin on the CPU; then, with ``--dead-gcs``, a GCS that dies at start (the
auth split of issue 31, made on purpose in a child process: Ray imported with auth off, then token auth turned on
for the processes it starts) and how long the embedded start took to say so, with a thread that should have
printed one second in (it prints only when Ray's wait lets go of the GIL).

    python benchmarks/ray_start.py [--runs 3] [--busy 8] [--dead-gcs]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEAD_GCS = """
import os, sys, threading, time
sys.path.insert(0, {repo!r})
import ray
from orchestrator import embedded_ray
os.environ["RAY_AUTH_MODE"] = "token"  # after the import: the GCS looks for a token the driver never made
t0 = time.perf_counter()
threading.Timer(1.0, lambda: print(f"a thread timed for 1.0 s ran at {{time.perf_counter() - t0:.1f}} s",
                                   flush=True)).start()
try:
    embedded_ray.start(ray, {repo!r}, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
except embedded_ray.RayStartError as exc:
    print(f"RayStartError after {{time.perf_counter() - t0:.1f}} s: {{str(exc)[:160]}}", flush=True)
"""


def spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def gcs_waits(runs: int) -> None:
    from orchestrator import embedded_ray

    embedded_ray.configure(local=True)
    import ray
    import ray._private.node as node

    native = node.wait_for_persisted_port
    waits: list[float] = []

    def timed(*args, **kwargs):  # instrumentation: the GCS port wait inside ray.init
        t = time.perf_counter()
        try:
            return native(*args, **kwargs)
        finally:
            waits.append(time.perf_counter() - t)

    node.wait_for_persisted_port = timed
    try:
        for _ in range(runs):
            t = time.perf_counter()
            embedded_ray.start(ray, str(REPO), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            init = time.perf_counter() - t
            ray.shutdown()
            print(f"ray.init {init:5.2f} s, of it the GCS port wait {waits[-1]:.2f} s", flush=True)
    finally:
        node.wait_for_persisted_port = native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile")
    ap.add_argument("--dead-gcs", action="store_true", help="also time the start of a GCS that dies")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs, {args.busy} busy processes", flush=True)
    hogs = spin(args.busy)
    try:
        gcs_waits(args.runs)
        if args.dead_gcs:
            env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
            env["HOME"] = tempfile.mkdtemp(prefix="jt-home-")  # no ~/.ray token: the GCS finds none
            subprocess.run([sys.executable, "-c", DEAD_GCS.format(repo=str(REPO))], env=env, cwd=REPO, check=False)
    finally:
        for p in hogs:
            p.kill()


if __name__ == "__main__":
    main()
