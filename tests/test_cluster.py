"""Sweeps on a real two-node Ray cluster: placement, fail-fast, timeouts, and crash-proof resume
(the driver and a trial's worker killed by PID mid-sweep)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator.lock import lock_path
from orchestrator.store import Store

from .conftest import REPO, SLOW_MODEL, cli_env, juicytalk, running_trial, wait_for


def write_sweep(tmp: Path, name: str, body: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(f"name: {name}\n" + textwrap.dedent(body))
    return path


def records(out: Path, name: str) -> list[dict]:
    return Store(str(out), name).read_records().to_pylist()




def test_unschedulable_resources_fail_fast(ray_cluster, tmp_path):
    sweep = write_sweep(tmp_path, "big", """
        grid: {d_model: [32]}
        resources: {cpu: 8, gpu: 0}
    """)
    t0 = time.time()
    run = juicytalk("sweep", str(sweep), "--out", str(tmp_path), "--address", ray_cluster, "--no-progress")
    assert run.returncode == 2
    assert "resources" in run.stderr and "cpu=8" in run.stderr
    assert time.time() - t0 < 60 and records(tmp_path, "big") == []


SMALL = """
    grid: {d_model: [32, 48, 64, 80]}
    fixed: {model: "%s", seq_len: 32, batch_size: 8, train_steps: %d, bench_steps: 5, warmup_steps: 1,
            gen_len: 4, precision: fp32, device: cpu, profile: false}
    resources: {cpu: 1, gpu: 0}
    max_concurrent: 1
"""


def test_a_sweep_runs_on_both_nodes(tracked_sweep):
    out, run, _ = tracked_sweep  # four cells, two of them FP8 (unsupported on CPU): conftest.TRACKED_SWEEP
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    table = pq.read_table(out / "trk" / "results.parquet").to_pylist()
    assert len(table) == 4 and all(r["status"] == ("ok" if r["precision"] == "fp32" else "unsupported") for r in table)
    # the two fp32 cells built their model at once (conftest.PAIRED_MODEL), each holding a whole node
    assert len({r["node_id"] for r in table if r["precision"] == "fp32"}) == 2


def _start(sweep: Path, out: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(sweep), "--out", str(out),
                             "--address", address, "--no-progress", "--no-report"], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow
def test_driver_killed_mid_sweep_then_rerun_completes_exactly_once(ray_cluster, tmp_path):
    """The driver SIGKILLed mid-sweep; a second driver meanwhile is refused; the rerun takes the stale lock
    over and, though a trial's worker is SIGKILLed mid-trial (retried), finishes every cell exactly once."""
    sweep = write_sweep(tmp_path, "kd", SMALL % (SLOW_MODEL, 100))  # ~2.5 s a trial, one at a time
    trials_dir, running = tmp_path / "kd" / "trials", tmp_path / "kd" / "running"
    driver = _start(sweep, tmp_path, ray_cluster)
    # the second driver as soon as the first holds the lock (it writes its pid there before Ray starts): refused
    # while the first lives, its whole sweep (not only what is left after a record, which a loaded host can miss)
    lock = Path(lock_path(Store(str(tmp_path), "kd")))
    wait_for(lambda: lock.exists() and f'"pid": {driver.pid},' in lock.read_text(), 120)
    second = juicytalk("sweep", str(sweep), "--out", str(tmp_path), "--address", ray_cluster,
                       "--no-progress", "--no-report", timeout=60)
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert "in use by another juicytalk sweep" in second.stderr and f"pid {driver.pid}," in second.stderr
    wait_for(lambda: trials_dir.exists() and any(p.suffix == ".parquet" for p in trials_dir.iterdir()), 240, 0.05)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(30)
    first = {r["cell_id"]: r["recorded_at"] for r in records(tmp_path, "kd")}
    assert 1 <= len(first) < 4, "the driver should die mid-sweep"
    for marker in running.glob("*.json"):
        marker.unlink()  # the killed driver's: a new one is what says a trial of the rerun runs now
    rerun = _start(sweep, tmp_path, ray_cluster)
    # (was test_worker_killed_mid_trial_is_retried) a trial's worker killed mid-trial: Tune retries the trial
    key, info = wait_for(lambda: running_trial(running), 240)
    os.kill(info["worker_pid"], signal.SIGKILL)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out[-2000:] + err[-2000:]
    assert "took over the lock of a driver that is gone" in err  # the killed driver's lock was stale
    recs = records(tmp_path, "kd")
    assert sorted(r["d_model"] for r in recs) == [32, 48, 64, 80]  # nothing lost, nothing twice
    assert all(r["status"] == "ok" for r in recs)
    again = {r["cell_id"]: r["recorded_at"] for r in recs}
    assert all(again[c] == t for c, t in first.items())  # finished trials were not run again
    assert f"{len(first)} already done" in " ".join(out.split())
    [retried] = [r for r in recs if f"{r['cell_id']}-s{r['sample']}" == key]
    assert retried["worker_pid"] != info["worker_pid"]
