"""Launchers on a real Ray cluster: warm processes run many trials with each trial's own figures, and
every fault a long sweep meets (a killed trial process, an OOM, a timeout, SIGINT, a corrupt record
file, a second driver) ends with exactly one record per cell and nothing left running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from orchestrator.sweep import parse_sweep
from orchestrator.work import grid_items

from .conftest import OOM_VOCAB, REPO, SLOW_MODEL, cli_env, juicytalk, running_trial, user_env, wait_for
from .test_cluster import records, write_sweep

CPU_CELL = ("n_layers: 1, seq_len: 32, batch_size: 8, train_steps: %d, bench_steps: 3, warmup_steps: 1, "
            "gen_len: 2, precision: fp32, device: cpu, profile: false")  # no kernel breakdown: not under test here
SLOW_CELL = f"model: '{SLOW_MODEL}', " + CPU_CELL.split(", ", 1)[1]  # ~22 ms a train step, little CPU
NANOGPT = REPO / "tests" / "fixtures" / "nanogpt"
RELATIVE_FACTORY = "py:nanogpt/model.py:build_full"  # relative to the warm sweep's folder, which it is run in
TIMEOUT_S = 20  # trial_timeout_s of the killed-trial sweep: its ~4 s trials fit, timed from their start (it was 45
# while the bound held a new process's start too: on an AVX2 host under the suite, 15 s did not cover the first's)


def _sweep(out: Path, name: str, *extra: str, address: str | None = None, timeout: float = 600, cwd: Path = REPO):
    args = ["sweep", str(out / f"{name}.yaml"), "--out", str(out), "--no-progress", "--no-report", *extra]
    if address:
        args += ["--address", address]
    return juicytalk(*args, timeout=timeout, cwd=cwd)


def _by_d_model(out: Path, name: str) -> dict[int, dict]:
    return {r["d_model"]: r for r in records(out, name)}


def _servers() -> list[psutil.Process]:
    """This test session's trial processes (its Rays carry its token), not a concurrent run's on the host."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "trials.server" in " ".join(p.info["cmdline"] or []) and \
                    p.environ().get("RAY_AUTH_TOKEN") == os.environ["RAY_AUTH_TOKEN"]:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(scope="module")
def warm_sweep(ray_cluster, tmp_path_factory):
    """One sweep, one trial at a time on one reused worker, for the warm launcher's tests below: a small cell
    (d32) and a real OOM (d40) in a first process; then, in the process that replaces it, a small cell (d48),
    a large one (d64: a 64k vocabulary, ~380 MB of embedding, head, optimizer state and logits above a small
    cell's peak, 2.5x the 150 MB the test asks) and a small one (d56) after it, in the same process; last, a py:
    factory named by a path relative to the folder the sweep is run in (d16), as a user writes it for
    ``python file.py``."""
    out = tmp_path_factory.mktemp("warm")
    shutil.copytree(NANOGPT, out / "nanogpt")
    write_sweep(out, "warm", f"""
        grid:
          - {{d_model: [32]}}
          - {{d_model: [40], vocab: [{OOM_VOCAB}]}}
          - {{d_model: [48]}}
          - {{d_model: [64], vocab: [64000]}}
          - {{d_model: [56], vocab: [96]}}
          - {{d_model: [16], model: ["{RELATIVE_FACTORY}"], n_heads: [2]}}
        fixed: {{n_layers: 1, batch_size: 8, seq_len: 32, train_steps: 3, bench_steps: 2, warmup_steps: 1,
                gen_len: 2, precision: fp32, device: cpu, profile: false}}
        resources: {{cpu: 1, gpu: 0}}
        max_concurrent: 1
        launcher: warm
    """)
    run = _sweep(out, "warm", address=ray_cluster, cwd=out)
    return run, _by_d_model(out, "warm")


def test_warm_process_runs_trials_in_turn_and_each_reports_its_own_memory(warm_sweep):
    run, recs = warm_sweep
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]  # oom is a final status
    large, small = recs[64], recs[56]
    assert large["status"] == small["status"] == "ok"
    assert large["launcher"] == small["launcher"] == "warm"
    assert small["pid"] == large["pid"] and small["process_trial_index"] == large["process_trial_index"] + 1
    # without a reset the high-water mark would still hold the large cell's peak
    assert small["peak_rss_bytes"] < large["peak_rss_bytes"] - (150 << 20), (small["peak_rss_bytes"],
                                                                            large["peak_rss_bytes"])
    assert small["first_step_s"] > 0 and small["compile_cache_dir"].endswith("inductor")
    assert "1.0 trials per process" not in run.stdout and "launcher warm" in " ".join(run.stdout.split())


def test_warm_oom_replaces_the_process_and_the_next_trial_is_clean(warm_sweep):
    run, recs = warm_sweep
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]  # oom is a final status
    first, oom, after = recs[32], recs[40], recs[48]
    assert oom["status"] == "oom" and "allocate" in oom["error"]
    assert (first["pid"], first["process_trial_index"]) == (oom["pid"], 0) and oom["process_trial_index"] == 1
    assert after["status"] == "ok" and after["pid"] != oom["pid"] and after["process_trial_index"] == 0
    assert abs(after["peak_rss_bytes"] - first["peak_rss_bytes"]) < (100 << 20)


def test_a_relative_factory_path_is_read_from_the_folder_the_sweep_ran_in(warm_sweep, monkeypatch):
    """The trial runs in its launcher's folder, not the driver's: the path is still read from the driver's (on
    main before this, every such trial failed: "no file /tmp/juicytalk-.../nanogpt/model.py ..."). The record and
    the cell id keep the path as written."""
    run, recs = warm_sweep
    rec = recs[16]
    assert rec["status"] == "ok", rec["error"]
    assert rec["model"] == RELATIVE_FACTORY and rec["model_class"] == "FullGPT"
    sweep = Path(run.args[run.args.index("sweep") + 1])
    data = yaml.safe_load(sweep.read_text())
    data["grid"] = data["grid"][-1:]  # this cell alone: the others' checks take seconds
    monkeypatch.chdir(sweep.parent)  # where the driver read it: the file exists relative to it
    parsed = parse_sweep(yaml.safe_dump(data))
    assert [it.cell_id for it in grid_items(parsed.cells, parsed.samples)] == [rec["cell_id"]]


def test_a_killed_trial_process_is_retried_once_and_one_past_its_timeout_is_killed(ray_cluster, tmp_path):
    """One sweep per launcher, both at once on the cluster's two one-CPU nodes (each one trial at a time; were
    two tests, a sweep each, run one after the other: ~80 s each on 2 cores, most of it the timeout): a trial
    process SIGKILLed mid-trial is retried once in a new process and the later trials are unaffected; a trial
    past trial_timeout_s is recorded as timeout and its process killed."""
    drivers = {}
    for launcher in ("warm", "process"):
        name = f"kt-{launcher}"
        sweep = write_sweep(tmp_path, name, f"""
            grid:
              - {{d_model: [32, 48], train_steps: [150]}}
              - {{d_model: [256], train_steps: [100000]}}
            fixed: {{{SLOW_CELL.replace("train_steps: %d, ", "")}}}
            resources: {{cpu: 1, gpu: 0}}
            max_concurrent: 1
            trial_timeout_s: {TIMEOUT_S}
            launcher: {launcher}
        """)  # ~4 s a trial for the two small cells, well inside the timeout; the third outlasts it
        parsed = parse_sweep(sweep.read_text(), source=str(sweep))
        finite = {it.key for it in grid_items(parsed.cells, parsed.samples) if it.spec["train_steps"] == 150}
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(sweep), "--out",
                                   str(tmp_path), "--address", ray_cluster, "--no-progress", "--no-report"],
                                  cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        drivers[launcher] = (name, driver, finite)
    killed: dict[str, tuple[str, dict]] = {}

    def small_trials_killed():  # mid-trial, not mid-hand-over; one of the cells that would end by itself
        for launcher, (name, _, finite) in drivers.items():
            found = None if launcher in killed else running_trial(tmp_path / name / "running", min_age_s=2)
            if found and found[0] in finite:
                os.kill(found[1]["child_pid"], signal.SIGKILL)
                killed[launcher] = found
        return len(killed) == len(drivers)
    wait_for(small_trials_killed, 240)
    for launcher, (name, driver, _) in drivers.items():
        out, err = driver.communicate(timeout=600)
        # exit 1 for the timed-out trial alone: the killed trial's retry is no failure
        assert driver.returncode == 1, launcher + out[-2000:] + err[-2000:]
        assert "3 run now, 1 failed" in " ".join(out.split()) and "failed" in out, out[-2000:]
        recs = {r["d_model"]: r for r in records(tmp_path, name)}
        assert len(recs) == 3 and all(r["launcher"] == launcher for r in recs.values())
        assert recs[32]["status"] == recs[48]["status"] == "ok"
        key, info = killed[launcher]
        [retried] = [r for r in recs.values() if f"{r['cell_id']}-s{r['sample']}" == key]
        assert retried["pid"] != info["child_pid"] and retried["process_trial_index"] == 0
        rec = recs[256]  # (was test_timeout_kills_the_trial_process, and before it test_cluster.py's)
        assert rec["status"] == "timeout" and f"trial_timeout_s={TIMEOUT_S}" in rec["error"]
    wait_for(lambda: not _servers(), 30)  # the timed-out processes, and any kept ready, are gone


# A trial server's protocol (trials/server.py: a request line on stdin, JSON replies on --reply-fd) with its
# times set: `import_s` before it takes the request (a fresh server imports torch first), `run_s` of trial.
SLOW_START_SERVER = """
import json, os, sys, time
import_s, run_s, reply = float(sys.argv[1]), float(sys.argv[2]), os.fdopen(int(sys.argv[3]), "w")
time.sleep(import_s)
request = json.loads(sys.stdin.readline())
reply.write(json.dumps({"started": os.getpid()}) + "\\n"); reply.flush()
time.sleep(run_s)
open(request["out"], "w").write(json.dumps({**request["spec"], "status": "ok", "pid": os.getpid()}))
reply.write(json.dumps({"out": request["out"], "retire": True, "why": "one trial"}) + "\\n"); reply.flush()
"""


@pytest.mark.parametrize("import_s, status", [(1.2, "ok"), (2.5, "timeout")])
def test_trial_timeout_bounds_the_trials_run_from_its_start_and_separately_its_process_start(tmp_path, import_s,
                                                                                             status):
    """A trial of 1.2 s under trial_timeout_s 2: ok after a 1.2 s process start (their sum, 2.4 s, timed out
    while the bound held both: a loaded host's imports spent a trial's time), timeout after a 2.5 s one."""
    from orchestrator.launchers import LaunchSettings
    from orchestrator.launchers.base import TrialProcess
    from orchestrator.launchers.warm import WarmLauncher

    class OneServer(WarmLauncher):
        def _spawn(self) -> TrialProcess:
            read_fd, write_fd = os.pipe()
            log = tmp_path / f"server-{import_s}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen([sys.executable, "-c", SLOW_START_SERVER, str(import_s), "1.2", str(write_fd)],
                                        stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                        pass_fds=(write_fd,), start_new_session=True)
            os.close(write_fd)
            return TrialProcess(proc, proc.stdin, os.fdopen(read_fd, "rb", buffering=0), log)

    launcher = OneServer(LaunchSettings("warm", 1))
    try:
        record = launcher.run({"d_model": 32}, 2.0).record
    finally:
        launcher.close()
    assert record["status"] == status, record


def _interrupt(tmp_path: Path, sig: int, mid_trial: bool, env: dict[str, str]) -> int:
    """Start the sweep in the shell ``env``, send ``sig`` once it has a new record (or, ``mid_trial``, once a
    trial process is running); check it stopped cleanly. Returns the records on disk."""
    before = len(records(tmp_path, "int")) if (tmp_path / "int" / "trials").exists() else 0
    for marker in (tmp_path / "int" / "running").glob("*.json"):
        marker.unlink()  # the interrupted run's: a new one is what says a trial runs now
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(tmp_path / "int.yaml"), "--out",
                               str(tmp_path), "--no-progress", "--no-report"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trials_dir = tmp_path / "int" / "trials"

    def running() -> bool:  # a driver that ended first (its Ray did not start in this shell?) says why
        assert driver.poll() is None, driver.communicate()[1][-2000:]
        if mid_trial:
            return bool(running_trial(tmp_path / "int" / "running"))
        return trials_dir.exists() and sum(p.suffix == ".parquet" for p in trials_dir.iterdir()) > before
    wait_for(running, 240)
    tree = psutil.Process(driver.pid).children(recursive=True)  # embedded Ray, workers, trial processes
    assert any("trials.server" in " ".join(p.cmdline()) for p in tree if p.is_running())
    driver.send_signal(sig)
    out, err = driver.communicate(timeout=120)
    assert driver.returncode == 1, (sig, driver.returncode, err[-2000:])  # interrupted: cells are missing
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-2000:]
    text = " ".join(out.split())
    assert "rerun the same command to resume" in text, out[-2000:]
    # the summary counts what ran (not what was pending) and says the driver was interrupted
    now = len(records(tmp_path, "int"))
    assert f"{now - before} run now" in text and "missing (interrupted)" in text, text[-2000:]
    assert "not run: the sweep was interrupted" in text and "worker died" not in text, text[-2000:]
    deadline = time.time() + 60
    while time.time() < deadline:
        left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.5)
    assert not left, [" ".join(p.cmdline())[:120] for p in left]
    return len(records(tmp_path, "int"))


def test_ctrl_c_during_a_fit_is_noted_and_handed_to_tunes_stop():
    """The driver's SIGINT handler notes the interrupt and calls the SIGUSR1 handler (Tune's stop, here a
    stand-in function); a second Ctrl-C raises KeyboardInterrupt; the handlers before are restored."""
    from orchestrator.runner import Interrupts

    stops = []
    before_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: stops.append(signum))
    before_int = signal.getsignal(signal.SIGINT)
    try:
        interrupts = Interrupts()
        with interrupts.catching():
            assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: stops, 5, interval=0.01)
            assert interrupts.seen and stops == [signal.SIGINT]
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
        assert signal.getsignal(signal.SIGINT) is before_int
        assert "TUNE_DISABLE_SIGINT_HANDLER" not in os.environ
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)
    assert not Interrupts().seen


@pytest.mark.slow
def test_sigint_and_sigterm_stop_everything_and_the_rerun_resumes(tmp_path, ray_cluster):
    """SIGINT, and SIGTERM (Slurm, Kubernetes, systemd) on the resumed run, each end the driver the same way:
    no native stack dump, the summary, every process gone; the same command then finishes the sweep.

    Each interrupted run starts its own Ray (no --address) in a new user's shell (no RAY_* variables, an empty
    HOME) holding what could trip that start: a token file left by an earlier Ray, then RAY_AUTH_MODE=disabled.
    Its trials ran (records, a running trial process), so Ray started there. (Were the two one-cell sweeps of
    test_clean_start.py's test_a_sweep_starts_its_own_ray_whatever_the_users_shell_holds: a local Ray's start
    and a sweep's each, ~20 CPU-s a run.)"""
    write_sweep(tmp_path, "int", f"""
        grid: {{d_model: [32, 40, 48, 64]}}
        fixed: {{{SLOW_CELL % 100}}}
        resources: {{cpu: 1, gpu: 0}}
        launcher: warm
    """)
    stale = tmp_path / "stale-home"  # a token file some earlier Ray on this machine left
    (stale / ".ray").mkdir(parents=True)
    (stale / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    after_int = _interrupt(tmp_path, signal.SIGINT, mid_trial=False, env=user_env(stale))
    done_before = _interrupt(tmp_path, signal.SIGTERM, mid_trial=True,
                             env=user_env(tmp_path / "home", RAY_AUTH_MODE="disabled"))
    assert 1 <= after_int <= done_before < 4
    run = _sweep(tmp_path, "int", address=ray_cluster)  # the resume reads the store, whichever Ray runs it
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{done_before} already done" in " ".join(run.stdout.split())
    recs = records(tmp_path, "int")
    assert sorted(r["d_model"] for r in recs) == [32, 40, 48, 64] and all(r["status"] == "ok" for r in recs)


def test_corrupt_record_files_are_quarantined_and_rerun(tracked_sweep, ray_cluster, tmp_path):
    shutil.copytree(tracked_sweep[0] / "trk", tmp_path / "bad")  # four records, two of them of fp8 cells
    cells = (tracked_sweep[0] / "trk.yaml").read_text().split("trackers:")[0].split("\n", 1)[1]
    write_sweep(tmp_path, "bad", cells + "max_concurrent: 1\n")  # the same cells, no trackers; one Tune worker
    files = sorted((tmp_path / "bad" / "trials").glob("*.parquet"))
    files = [f for f in files if pq.read_table(f).column("precision")[0].as_py() == "fp8"]  # quick to rerun
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    files[1].write_text("not parquet at all")
    collect = juicytalk("collect", str(tmp_path / "bad"))
    assert collect.returncode == 0 and "2 records" in collect.stdout
    assert all(f.name in collect.stderr for f in files) and "Traceback" not in collect.stderr
    assert len(list((tmp_path / "bad" / "quarantine").iterdir())) == 2
    rerun = _sweep(tmp_path, "bad", address=ray_cluster)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "2 already done, 2 run now" in " ".join(rerun.stdout.split())
    files = sorted((tmp_path / "bad" / "trials").glob("*.parquet"))
    files[0].write_bytes(b"PAR1garbagePAR1")
    report = juicytalk("report", str(tmp_path / "bad"), "--out", str(tmp_path / "r.html"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert files[0].name in report.stderr and len(list((tmp_path / "bad" / "quarantine").iterdir())) == 3


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a filesystem this test can fill (mounting needs root, which CI has)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must be able to mount a tmpfs")
        pytest.skip("needs root to mount a tmpfs")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(path: Path) -> None:
    """Write zeros to ``path`` until the filesystem refuses (ENOSPC)."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass


@pytest.mark.slow
def test_a_full_disk_stops_the_sweep_in_one_line_and_the_rerun_resumes(tmp_path, small_disk, ray_cluster):
    write_sweep(tmp_path, "full", f"""
        grid: {{d_model: [32, 48, 64, 80]}}
        fixed: {{{SLOW_CELL % 40}}}
        resources: {{cpu: 1, gpu: 0}}
        max_concurrent: 1
    """)  # one Tune worker and trial process, not one per node; ~1 s a trial: the disk fills between two
    args = [sys.executable, "-m", "orchestrator.cli", "sweep", str(tmp_path / "full.yaml"), "--out", str(small_disk),
            "--no-progress", "--no-report", "--address", ray_cluster]
    driver = subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trials_dir = small_disk / "full" / "trials"
    wait_for(lambda: trials_dir.exists() and any(p.suffix == ".parquet" for p in trials_dir.iterdir()), 240)
    _fill(small_disk / "filler")  # the disk fills up mid-sweep
    out, err = driver.communicate(timeout=300)
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert driver.returncode == 1 and len(lines) <= 5, lines
    assert str(small_disk) in err and "no space left on device" in err and "rerun the same command" in err, err
    assert "Traceback" not in out + err
    intact = records(small_disk, "full")  # every record on disk reads back whole
    assert 1 <= len(intact) < 4 and all(r["status"] == "ok" for r in intact)
    assert not [p for p in small_disk.rglob(".*.tmp")]  # no half-written temporaries left behind

    (small_disk / "filler").unlink()
    rerun = subprocess.run(args, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert f"{len(intact)} already done" in " ".join(rerun.stdout.split())
    assert sorted(r["d_model"] for r in records(small_disk, "full")) == [32, 48, 64, 80]
