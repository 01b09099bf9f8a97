"""How well a sweep run used its GPUs: busy fraction and per-trial overhead, from the records alone.

Every record names the driver run that produced it (``run_id``, ``run_started_at``, ``run_gpus``), so
a resumed sweep, or results consolidated from several runs, still gives one row per run. A run's
wall time is its start to its last record; its GPU-busy time is the train+bench time of its trials
(the steps that keep a GPU working; imports, CUDA init, compiles and process start are not busy).
With several GPUs the busy time is shared among them: ``busy_per_gpu`` divides by ``run_gpus``.
Per trial, the overhead is what the worker waited beyond the trial's own work: ``trial_wall_s``
minus setup, training, benchmark and generation (imports, CUDA init, process start and exit, reply).
``first_step_s`` is the first training step, where TE's fusers compile; ``trials_per_process`` how
many trials one trial process ran on average (1 for the process launcher).

Concurrency has a price the GPU count hides: trials that share a host share its CPUs, and an eager
launch-bound step is timed by how fast the host issues kernels. On a two-H200 host, the launch-bound
768x4 and 2048x4 cells ran 1.2-1.36x slower beside another trial than alone, while GPU-bound cells
did not move (docs/results/h200). :func:`concurrent_trials` finds the records that shared a host.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

INPUT_COLUMNS = ["run_id", "run_started_at", "run_gpus", "recorded_at", "train_s", "bench_s", "setup_s", "gen_s",
                 "startup_s", "first_step_s", "trial_wall_s", "launcher", "hostname", "pid"]
COLUMNS = ["run_id", "run_started_at", "launcher", "trials", "gpus", "wall_s", "busy_s", "busy_fraction",
           "busy_per_gpu", "overhead_s_median", "first_step_s_median", "startup_s_median", "trials_per_process"]


def _median(values: pd.Series) -> float:
    values = values.dropna()
    return float(values.median()) if len(values) else math.nan


def _epoch(stamp: Any) -> float:
    """Epoch seconds of an ISO-8601 UTC stamp (``...Z`` or ``...+00:00``); NaN when missing."""
    if not isinstance(stamp, str) or not stamp:
        return math.nan
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run_efficiency(records: pd.DataFrame) -> pd.DataFrame:
    """One row per driver run: trials, GPUs, wall, busy seconds and fractions, start-up medians."""
    if records.empty or "run_id" not in records or records["run_id"].isna().all():
        return pd.DataFrame(columns=COLUMNS)
    rows = []
    for run_id, g in records[records["run_id"].notna()].groupby("run_id", sort=False):
        start = _epoch(g["run_started_at"].iloc[0])
        wall = max(_epoch(s) for s in g["recorded_at"]) - start
        busy = float((g["train_s"].fillna(0) + g["bench_s"].fillna(0)).sum())
        gpus = g["run_gpus"].dropna()
        n_gpus = int(gpus.iloc[0]) if len(gpus) else 0
        work = g[["setup_s", "train_s", "bench_s", "gen_s"]].fillna(0).sum(axis=1)
        processes = g[["hostname", "pid"]].dropna().drop_duplicates()
        launchers = sorted({str(v) for v in g["launcher"] if isinstance(v, str)})
        rows.append({
            "run_id": run_id, "run_started_at": g["run_started_at"].iloc[0], "launcher": ",".join(launchers) or "-",
            "trials": len(g), "gpus": n_gpus, "wall_s": wall, "busy_s": busy,
            "busy_fraction": busy / wall if wall > 0 else math.nan,
            "busy_per_gpu": busy / wall / n_gpus if wall > 0 and n_gpus else math.nan,
            "overhead_s_median": _median(g["trial_wall_s"] - work),
            "first_step_s_median": _median(g["first_step_s"]),
            "startup_s_median": _median(g["startup_s"]),
            "trials_per_process": g[["hostname", "pid"]].notna().all(axis=1).sum() / len(processes)
            if len(processes) else math.nan,
        })
    return pd.DataFrame(rows, columns=COLUMNS).sort_values("run_started_at", ignore_index=True)


def concurrent_trials(records: pd.DataFrame) -> pd.Series:
    """For each record, how many other trials ran on the same host at some point of its run (0: alone).

    Per host, with starts and ends sorted: the trials overlapping [a0, a1) are those that started
    before a1 minus those that had ended by a0 (an interval ending by a0 also started before a1),
    minus the trial itself. O(n log n), so a 10,000-record report stays fast.
    """
    counts = pd.Series(0, index=records.index, dtype="int64")
    if records.empty:
        return counts
    hosts = records["node_ip"].where(records["node_ip"].notna(), records["hostname"])
    starts = np.array([_epoch(v) for v in records["started_at"]])
    ends = np.array([_epoch(v) for v in records["finished_at"]])
    known = hosts.notna().to_numpy() & ~np.isnan(starts) & ~np.isnan(ends)
    for host in hosts[known].unique():
        rows = np.flatnonzero(known & (hosts == host).to_numpy())
        s, e = np.sort(starts[rows]), np.sort(ends[rows])
        began = np.searchsorted(s, ends[rows], side="left")
        ended = np.searchsorted(e, starts[rows], side="right")
        counts.iloc[rows] = np.maximum(began - ended - 1, 0)  # a zero-length span does not count itself
    return counts


def describe(row: pd.Series) -> str:
    """One line for the sweep's closing summary."""
    per_gpu = f" ({row['busy_per_gpu']:.2f} per GPU over {row['gpus']} GPUs)" if row["gpus"] > 1 else ""
    what = "GPU-busy fraction" if row["gpus"] else "busy fraction (no GPU)"
    return (f"{what} {row['busy_fraction']:.2f}{per_gpu}: train+bench {row['busy_s']:.1f}s of "
            f"{row['wall_s']:.1f}s from the run's start to its last record; launcher {row['launcher']}, {row['trials_per_process']:.1f} trials per "
            f"process; per-trial overhead {_seconds(row['overhead_s_median'])}, first step "
            f"{_seconds(row['first_step_s_median'], 'no trial reached its first step')}")


def _seconds(median: float, none: str = "unknown") -> str:
    """``1.50s median``, or ``none`` where no trial had the value (a run whose every trial failed before its first
    training step has no first-step time: the median of nothing is not a number to print)."""
    return none if median != median else f"{median:.2f}s median"
