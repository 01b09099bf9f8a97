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

then the driver's wall against the trials' train+bench seconds (the GPU-busy part), and each trial in turn:
when it started, the gap since the one before, its ``duration_s`` split into the parts its record names (set-up,
training, benchmark, energy window, kernel profile, generation, teacher-forced partner) and the rest, and what
the driver spent after the last trial (Ray's and Tune's end). With ``--parts`` it
also times, in this process, what the middle phase is made of: ``import ray``, a local ``ray.init``,
``import ray.tune``, a one-trial Tune run of an empty trainable (Tune's set-up and worker actor) and
``ray.shutdown``, each once.

    python benchmarks/sweep_start.py examples/quickstart.yaml [--out DIR] [--parts]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.runner import tune_loggers  # noqa: E402
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
    timeline(df, t0, wall)


# the parts of each trial's duration_s its record names: the energy window (a run of the timed step of at least
# trials/energy.MIN_WINDOW_S, on a GPU with NVML) is one of them
PARTS = ("setup_s", "train_s", "bench_s", "energy_window_s", "profile_s", "gen_s", "tf_s")


def seconds(value) -> float:
    """A record's seconds field as a number: 0 where the trial had no such part (null, which pandas reads as None
    or NaN)."""
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def timeline(df, t0: float, wall: float) -> None:
    """Each trial in the order it ran: when it started (s after the command), the gap since the previous one
    ended (the hand-over: Tune, the worker, the trial process), its duration_s and the parts of it the record
    names (train_s holds the first step, shown apart too); then what the driver spent after the last trial
    ended (Ray's and Tune's end)."""
    names = " ".join(f"{p.removesuffix('_s').replace('energy_window', 'energy'):>7s}" for p in PARTS)
    print(f"{'trial':28s} {'start':>6s} {'gap':>5s} {'dur':>6s} {names}    rest  1st step")
    end = None
    for _, r in df.assign(t=df["started_at"].map(epoch)).sort_values("t").iterrows():
        start, dur = r["t"] - t0, seconds(r["duration_s"])
        parts = [seconds(r[p]) for p in PARTS]
        gap = "" if end is None else f"{start - end:5.1f}"
        print(f"{r['cell_label'][:28]:28s} {start:6.1f} {gap:>5s} {dur:6.1f} " + " ".join(f"{x:7.2f}" for x in parts)
              + f" {dur - sum(parts):7.2f} {float(r['first_step_s'] or 0):9.2f}")
        end = max(end or 0.0, epoch(r["finished_at"]) - t0)
    print(f"last trial ended at {end:.1f} s; driver wall {wall:.1f} s: {wall - end:.1f} s after it")


def parts() -> None:
    """The middle phase's pieces, each timed once in this process: Ray's start, Tune's import, and a one-trial
    Tune run of a trainable that does nothing (Tune's set-up, its worker actor, its end), then Ray's shutdown."""
    from orchestrator import embedded_ray

    embedded_ray.configure(local=True)
    t = time.perf_counter()
    import ray

    print(f"import ray                     {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    embedded_ray.start(ray, str(REPO), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    print(f"ray.init (local)               {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    from ray import tune

    print(f"import ray.tune                {time.perf_counter() - t:6.1f} s")

    class Nothing(tune.Trainable):
        def setup(self, config: dict) -> None:
            self.set_up_at = time.time()

        def step(self) -> dict:
            return {"set_up_at": self.set_up_at, "done": True}

    t, wall = time.perf_counter(), time.time()
    tuner = tune.Tuner(tune.with_resources(Nothing, {"cpu": 1, "gpu": 0}), param_space={"x": tune.grid_search([0])},
                       tune_config=tune.TuneConfig(reuse_actors=True),
                       run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="jt-parts-"), verbose=0,
                                                 checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False,
                                                                                         checkpoint_frequency=0)))
    # the sweep's own Tune loggers (orchestrator/runner.fit): without them Tune's automatic ones import
    # tensorboardX and torch into the driver (~4 s of this phase on an H200 host), which no sweep pays
    with tune_loggers():
        result = tuner.fit()[0]
    print(f"Tune fit -> trainable set up   {result.metrics['set_up_at'] - wall:6.1f} s   (Tune's set-up, its actor)")
    print(f"Tune fit, one empty trial      {time.perf_counter() - t:6.1f} s")
    t = time.perf_counter()
    ray.shutdown()
    print(f"ray.shutdown                   {time.perf_counter() - t:6.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_file")
    ap.add_argument("--out", help="where the sweep writes (default: a temporary directory)")
    ap.add_argument("--parts", action="store_true",
                    help="also time import ray, ray.init, import ray.tune, an empty Tune run, ray.shutdown")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs")
    run(args.sweep_file, args.out or tempfile.mkdtemp(prefix="jt-start-"))
    if args.parts:
        parts()


if __name__ == "__main__":
    main()
