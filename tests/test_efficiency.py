"""Sweep-run efficiency from records: wall, busy time and fractions per run, with known answers."""

from __future__ import annotations

import math

import pandas as pd

from orchestrator.efficiency import concurrent_trials, describe, run_efficiency


def _rec(run_id, started, recorded, train_s, bench_s, gpus, startup_s=5.0, wall_s=23.0, pid=1, first=2.0,
         launcher="process"):
    return {"run_id": run_id, "run_started_at": started, "recorded_at": recorded, "train_s": train_s,
            "bench_s": bench_s, "setup_s": 1.0, "gen_s": 0.5, "run_gpus": gpus, "startup_s": startup_s,
            "first_step_s": first, "trial_wall_s": wall_s, "launcher": launcher, "hostname": "h", "pid": pid}


def test_two_runs_of_one_sweep_are_reported_separately():
    records = pd.DataFrame([
        # run A: 1 GPU, 100 s from start to last record, 30 s of train+bench
        # (overheads: 23 - 16.5 = 6.5 and 24 - 16.5 = 7.5; each trial its own process)
        _rec("a", "2026-11-30T04:00:00Z", "2026-11-30T04:00:40Z", 10.0, 5.0, 1, startup_s=4.0, pid=1, first=1.0),
        _rec("a", "2026-11-30T04:00:00Z", "2026-11-30T04:01:40Z", 12.0, 3.0, 1, startup_s=6.0, wall_s=24.0, pid=2),
        # run B (a resume, warm launcher): 2 GPUs, 50 s, 40 s of train+bench, three trials in two processes
        _rec("b", "2026-11-30T05:00:00Z", "2026-11-30T05:00:50Z", 30.0, 10.0, 2, wall_s=42.0, launcher="warm"),
        _rec("b", "2026-11-30T05:00:00Z", "2026-11-30T05:00:20Z", 0.0, 0.0, 2, wall_s=2.0, launcher="warm"),
        _rec("b", "2026-11-30T05:00:00Z", "2026-11-30T05:00:30Z", 0.0, 0.0, 2, wall_s=2.5, pid=7, launcher="warm"),
        # a record from before runs were recorded: ignored
        _rec(None, None, "2026-11-29T05:00:50Z", 99.0, 99.0, None),
    ])
    eff = run_efficiency(records).set_index("run_id")
    assert list(eff.index) == ["a", "b"]
    a, b = eff.loc["a"], eff.loc["b"]
    assert (a["trials"], a["gpus"], a["wall_s"], a["busy_s"]) == (2, 1, 100.0, 30.0)
    assert math.isclose(a["busy_fraction"], 0.30) and math.isclose(a["busy_per_gpu"], 0.30)
    assert a["startup_s_median"] == 5.0 and a["overhead_s_median"] == 7.0 and a["first_step_s_median"] == 1.5
    assert a["trials_per_process"] == 1.0 and a["launcher"] == "process"
    assert math.isclose(b["busy_fraction"], 0.80) and math.isclose(b["busy_per_gpu"], 0.40)
    assert b["trials_per_process"] == 1.5 and b["launcher"] == "warm"
    assert b["overhead_s_median"] == 0.5  # overheads 0.5, 0.5 and 1.0 s
    assert "0.80 (0.40 per GPU over 2 GPUs)" in describe(b)
    assert describe(a).startswith("GPU-busy fraction 0.30: train+bench 30.0s of 100.0s from the run's start to its "
                                  "last record; launcher process, "
                                  "1.0 trials per process; per-trial overhead 7.00s median, first step 1.50s")


def test_records_without_runs_give_no_rows():
    assert run_efficiency(pd.DataFrame([_rec(None, None, "2026-11-29T05:00:50Z", 1.0, 1.0, None)])).empty
    cpu = run_efficiency(pd.DataFrame([_rec("c", "2026-11-30T04:00:00Z", "2026-11-30T04:00:10Z", 2.0, 3.0, 0)]))
    assert math.isnan(cpu.iloc[0]["busy_per_gpu"]) and describe(cpu.iloc[0]).startswith("busy fraction (no GPU) 0.50")


def _span(host, start, end, launch_bound=True, ip=None):
    return {"hostname": host, "node_ip": ip, "started_at": f"2026-11-30T04:{start}+00:00",
            "finished_at": f"2026-11-30T04:{end}+00:00", "launch_bound": launch_bound}


def test_concurrent_trials_counts_overlaps_on_the_same_host_only():
    records = pd.DataFrame([
        _span("a", "00:00.000", "00:30.000"),
        _span("a", "00:20.000", "00:50.000"),   # overlaps the first and the third
        _span("a", "00:40.000", "01:00.000"),
        _span("b", "00:00.000", "01:00.000"),   # same time, other host
        _span("a", "01:00.000", "01:10.000"),   # starts as the third ends: not concurrent
        _span("x", "00:00.000", "01:00.000", ip="10.0.0.2"),  # node_ip wins over hostname
        _span("y", "00:10.000", "00:20.000", ip="10.0.0.2"),
    ])
    assert concurrent_trials(records).tolist() == [1, 2, 1, 0, 0, 1, 1]


def test_a_run_where_no_trial_reached_its_first_step_says_so_not_nan():
    """Every trial failed before training (unsupported, error): no first-step time, no work; the closing line
    says so in words instead of ``first step nans median``."""
    rec = _rec("d", "2026-11-30T04:00:00Z", "2026-11-30T04:00:10Z", None, None, 0, startup_s=None, first=None)
    line = describe(run_efficiency(pd.DataFrame([rec, dict(rec, pid=2)])).iloc[0])
    assert "nan" not in line and line.endswith("first step no trial reached its first step")
