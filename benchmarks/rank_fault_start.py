"""How long a two-rank trial whose rank is stopped before its trial starts takes to end, and what it leaves.

A rank SIGSTOPped after its trial started is the fault test's (tests/test_distributed.py): the other rank's
collective times out. One stopped before (as soon as both Ray Train workers exist, before either wrote its
pid file) is caught only by the start-up bound in ``orchestrator/launchers/ranks.py``: Ray Train's
worker-group start timeout plus the process group's (min(300 s, trial_timeout_s)). ``--cells 2`` adds a
second cell after it: whether it still runs says whether the first one's Train run let go of its ranks.
Needs a cluster whose nodes each fit one rank, e.g.
    ray start --head --num-cpus 1 --port 6399 && ray start --address 127.0.0.1:6399 --num-cpus 1
    python benchmarks/rank_fault_start.py --address 127.0.0.1:6399 [--cells 2] [--trial-timeout-s null]
Prints when the rank was stopped, when the sweep ended, its summary, and the Ray Train processes left.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
SWEEP = """
    name: stopped-early
    grid: {world_size: [2], parallel: [ddp], d_model: %s}
    fixed: {n_layers: 2, seq_len: 32, batch_size: 4, train_steps: 50, warmup_steps: 1, bench_steps: 3,
            gen_len: 4, backend: torch, precision: fp32, profile: false}
    resources: {cpu: 1, gpu: 0}
    trial_timeout_s: %s
"""


def train_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if any(t in " ".join(p.info["cmdline"] or []) for t in ("RayTrainWorker", "TrainController"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True)
    parser.add_argument("--trial-timeout-s", default="12", help="seconds, or null (no limit)")
    parser.add_argument("--give-up-s", type=float, default=300.0)
    parser.add_argument("--cells", type=int, default=1, help="two-rank cells; the first one's rank is stopped")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp, "s.yaml")
        sweep.write_text(textwrap.dedent(SWEEP % ([32 + 8 * i for i in range(args.cells)], args.trial_timeout_s)))
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.setdefault("RAY_AUTH_MODE", "token")
        t0 = time.time()
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(sweep), "--out", tmp,
                                   "--no-progress", "--no-report", "--address", args.address], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stopped = None
        while driver.poll() is None and time.time() - t0 < args.give_up_s:
            # this sweep's ranks: a run just before may leave a worker that is still exiting
            workers = [p for p in train_processes()
                       if "RayTrainWorker" in " ".join(p.info["cmdline"]) and p.create_time() >= t0]
            if stopped is None and len(workers) == 2:
                stopped = max(workers, key=lambda p: p.pid)
                stopped.send_signal(signal.SIGSTOP)
                pid_files = len(list(Path(tmp).rglob("*.pid.json")))
                print(f"{time.time() - t0:.1f} s: stopped rank process {stopped.pid} ({pid_files} pid files then)")
            time.sleep(0.05)
        ended = driver.poll() is not None
        print(f"{time.time() - t0:.1f} s: the sweep {'ended, exit ' + str(driver.returncode) if ended else 'still runs'}")
        if not ended:
            driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=120)
        print(out[-2500:])
        time.sleep(5)
        left = train_processes()
        print("Ray Train processes left:", [p.pid for p in left])
        for p in left:
            p.kill()


if __name__ == "__main__":
    main()
