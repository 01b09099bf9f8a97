"""How well a sweep run used its GPUs: busy fraction and per-trial start-up, from the records alone.

Every record names the driver run that produced it (``run_id``, ``run_started_at``, ``run_gpus``), so
a resumed sweep, or results consolidated from several runs, still gives one row per run. A run's
wall time is its start to its last record; its GPU-busy time is the train+bench time of its trials
(the steps that keep a GPU working; imports, CUDA init, compiles and process start are not busy).
With several GPUs the busy time is shared among them: ``busy_per_gpu`` divides by ``run_gpus``.

Concurrency has a price the GPU count hides: trials that share a host share its CPUs, and an eager
launch-bound step is timed by how fast the host issues kernels. On a two-H200 host, the launch-bound
768x4 and 2048x4 cells ran 1.2-1.36x slower beside another trial than alone, while GPU-bound cells
did not move (docs/results/h200). :func:`concurrent_trials` finds the records that shared a host.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import pandas as pd

COLUMNS = ["run_id", "run_started_at", "trials", "gpus", "wall_s", "busy_s", "busy_fraction", "busy_per_gpu",
           "startup_s_median", "process_overhead_s_median"]


def _epoch(stamp: Any) -> float:
    if not isinstance(stamp, str) or not stamp:
        return math.nan
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


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
        overhead = (g["trial_wall_s"] - g["duration_s"]).dropna()
        rows.append({
            "run_id": run_id, "run_started_at": g["run_started_at"].iloc[0], "trials": len(g), "gpus": n_gpus,
            "wall_s": wall, "busy_s": busy, "busy_fraction": busy / wall if wall > 0 else math.nan,
            "busy_per_gpu": busy / wall / n_gpus if wall > 0 and n_gpus else math.nan,
            "startup_s_median": float(g["startup_s"].median()) if g["startup_s"].notna().any() else math.nan,
            "process_overhead_s_median": float(overhead.median()) if len(overhead) else math.nan,
        })
    return pd.DataFrame(rows, columns=COLUMNS).sort_values("run_started_at", ignore_index=True)


def _instant(stamp: Any) -> float:
    """Epoch seconds of a record's started_at/finished_at (ISO-8601 with offset), NaN when missing."""
    if not isinstance(stamp, str) or not stamp:
        return math.nan
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def concurrent_trials(records: pd.DataFrame) -> pd.Series:
    """For each record, how many other trials ran on the same host at some point of its run (0: alone)."""
    hosts = list(records["node_ip"].where(records["node_ip"].notna(), records["hostname"])) if len(records) else []
    spans = [(_instant(a), _instant(b)) for a, b in zip(records.get("started_at", []), records.get("finished_at", []))]
    counts = []
    for i, (host, (a0, a1)) in enumerate(zip(hosts, spans)):
        counts.append(0 if host is None or host != host or a0 != a0 or a1 != a1 else
                      sum(1 for j, (other, (b0, b1)) in enumerate(zip(hosts, spans))
                          if j != i and other == host and b0 < a1 and a0 < b1))
    return pd.Series(counts, index=records.index, dtype="int64")


def describe(row: pd.Series) -> str:
    """One line for the sweep's closing summary."""
    per_gpu = f" ({row['busy_per_gpu']:.2f} per GPU over {row['gpus']} GPUs)" if row["gpus"] > 1 else ""
    what = "GPU-busy fraction" if row["gpus"] else "busy fraction (no GPU)"
    return (f"{what} {row['busy_fraction']:.2f}{per_gpu}: train+bench {row['busy_s']:.1f}s of "
            f"{row['wall_s']:.0f}s run wall; trial start to first step {row['startup_s_median']:.1f}s median, "
            f"process start+exit {row['process_overhead_s_median']:.1f}s median")
