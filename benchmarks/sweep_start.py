"""Where a sweep's fixed start goes: from the command to the first trial's first training step.

Runs ``juicytalk sweep FILE --restart --no-progress --no-report`` as a user would (a subprocess, its own
embedded Ray) and reads the timeline off the records:

    command      -> driver start    the CLI's imports, the sweep file, the store (``run_started_at``)
    driver start -> first trial     Ray's start, Tune's set-up, the Ray worker, the trial process and its
                                    imports (torch, TE where a GPU is given) (the first ``started_at``);
                                    of it, what the worker waited for its trial process (its
                                    ``trial_wall_s - duration_s``: the trial server's start and imports
                                    left when the spec was handed over; ~0 when the server the driver
                                    started before Ray had finished them, orchestrator/launchers/prestart.py)
    first trial  -> first step      the trial's own set-up: capability probe, model, optimizer (``startup_s``)
    first step                      the first step alone: TE's fuser compiles, torch.compile (``first_step_s``)

then the driver's wall against the trials' train+bench seconds (the GPU-busy part). With ``--parts`` it
also times, in this process, what the middle phase is made of: ``import ray``, a local ``ray.init`` and
``import ray.tune``, each once.

    python benchmarks/sweep_start.py examples/quickstart.yaml [--out DIR] [--parts]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.store import read_results  # noqa: E402
from orchestrator.sweep import load_sweep  # noqa: E402


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run(sweep_file: str, out: str) -> None:
    cmd = [sys.executable, "-m", "orchestrator.cli", "sweep", sweep_file, "--out", out, "--restart", "--no-progress",
           "--no-report"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    wall = time.time() - t0
    print("\n".join(done.stdout.strip().splitlines()[-3:]))
    if done.returncode not in (0, 1):
        sys.exit(f"sweep failed ({done.returncode}): {done.stderr[-2000:]}")
    df = read_results(str(Path(out) / load_sweep(sweep_file).name)).to_pandas()
    df = df[df["run_started_at"] == df["run_started_at"].max()]  # this run's records
    first = df.loc[df["started_at"].map(epoch).idxmin()]
    driver, trial = epoch(first["run_started_at"]) - t0, epoch(first["started_at"]) - t0
    step = trial + float(first["startup_s"] or 0)
    busy = float((df["train_s"].fillna(0) + df["bench_s"].fillna(0)).sum())
    print(f"command -> driver start        {driver:6.1f} s")
    print(f"driver start -> first trial    {trial - driver:6.1f} s   (Ray, Tune, worker, trial process)")
    waited = float(first["trial_wall_s"] or 0) - float(first["duration_s"] or 0)
    print(f"  of it, waiting for the trial process {waited:4.1f} s   (its start and imports, after the worker's)")
    print(f"first trial -> its first step  {step - trial:6.1f} s   (startup_s of {first['cell_label']})")
    print(f"first step alone               {float(first['first_step_s'] or 0):6.1f} s")
    print(f"=> first step issued at        {step:6.1f} s after the command")
    print(f"driver wall {wall:.1f} s for {len(df)} trials, train+bench {busy:.1f} s (busy {busy / wall:.2f})")


def parts() -> None:
    """The middle phase's pieces, each timed once in this process."""
    from orchestrator import embedded_ray

    embedded_ray.configure(local=True)
    t = time.perf_counter()
    import ray

    print(f"import ray                     {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    print(f"ray.init (local)               {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    import ray.tune  # noqa: F401

    print(f"import ray.tune                {time.perf_counter() - t:6.1f} s")
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_file")
    ap.add_argument("--out", help="where the sweep writes (default: a temporary directory)")
    ap.add_argument("--parts", action="store_true", help="also time import ray, ray.init and import ray.tune")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs")
    run(args.sweep_file, args.out or tempfile.mkdtemp(prefix="jt-start-"))
    if args.parts:
        parts()


if __name__ == "__main__":
    main()
