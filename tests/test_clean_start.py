"""A sweep starts its own Ray in whatever shell a user has: no RAY_* variables, a token file left by an
earlier Ray, RAY_AUTH_MODE=disabled. The README's own first command runs in a stripped shell in
test_e2e_quickstart.py, the two variants in test_launchers.py's SIGINT/SIGTERM test (its interrupted runs
start their own Ray, one in each such shell); here the rule that keeps it so, and a Ray that cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from .conftest import REPO, stop_cluster, user_env, wait_for

# A one-cell sweep: what is under test is Ray's start, not the trial.
TINY = """name: clean
grid: {precision: [fp32]}
fixed: {d_model: 64, n_layers: 2, device: cpu, backend: torch, train_steps: 5, warmup_steps: 1, bench_steps: 3}
resources: {gpu: 0, cpu: 1}
"""

# Modules Ray runs (Tune's trainable, its searcher, trackers built on Tune callbacks): imported only inside
# the sweep's Ray session, after orchestrator.embedded_ray.configure.
RAY_SIDE = {"orchestrator.trainable", "orchestrator.searcher", "orchestrator.trackers.mlflow_tracker",
            "orchestrator.trackers.tensorboard_tracker", "orchestrator.trackers.wandb_tracker"}


def test_no_orchestrator_module_imports_ray_at_import_time():
    """Ray reads RAY_AUTH_MODE once, at import: a module that imports it before a sweep configures its local
    Ray (the CLI importing search.py did) leaves the driver and the GCS it starts disagreeing."""
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import orchestrator
        names = [m.name for m in pkgutil.walk_packages(orchestrator.__path__, "orchestrator.")]
        for name in names:
            if name not in {sorted(RAY_SIDE)!r}:
                importlib.import_module(name)
                assert "ray" not in sys.modules, name + " imports ray at import time"
        print(len(names))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert int(out.stdout) > 30  # it walked the package, not nothing


def test_a_ray_that_cannot_start_is_one_line_with_rays_own_reason(tmp_path):
    """The GCS dies at start (here the very split the auth fix prevents, made on purpose: this process
    imports Ray, then turns token auth on for the processes it starts, with no token anywhere)."""
    (tmp_path / "s.yaml").write_text(TINY)
    code = textwrap.dedent(f"""
        import os, sys
        import ray
        os.environ["RAY_AUTH_MODE"] = "token"
        from orchestrator.cli import main
        sys.exit(main(["sweep", {str(tmp_path / "s.yaml")!r}, "--out", {str(tmp_path / "out")!r}, "--no-progress"]))
    """)
    # Ray waits for a GCS that already died (embedded_ray.GCS_PORT_WAIT_S, in the test below); its own knob
    # shortens the wait here, not what is reported after
    env = user_env(tmp_path / "home", RAY_gcs_server_port_wait_time_s="4")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=180)
    assert out.returncode == 1, out.stdout[-1500:] + out.stderr[-1500:]
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("juicytalk: error: Ray could not start here"), line
    assert "gcs_server.err: Check failed" in line and "token" in line, line
    log = line.rsplit("(log: ", 1)[1].rstrip(")")
    assert log.endswith("gcs_server.err") and "Check failed" in open(log).read()


def test_a_local_start_waits_less_than_rays_30_s_for_a_dead_gcs_and_a_users_own_wait_wins(monkeypatch):
    """Ray's own wait for a GCS that died at start is 30 s; the embedded start's is GCS_PORT_WAIT_S (the GCS writes
    its port in 0.1-0.2 s: benchmarks/ray_start.py), unless the user gave one. Joining a cluster sets none."""
    from orchestrator import embedded_ray

    name = "RAY_gcs_server_port_wait_time_s"
    monkeypatch.delenv(name, raising=False)
    embedded_ray.configure(local=False)
    assert name not in os.environ
    embedded_ray.configure(local=True)
    assert os.environ[name] == str(embedded_ray.GCS_PORT_WAIT_S) and embedded_ray.GCS_PORT_WAIT_S < 30
    monkeypatch.setenv(name, "45")
    embedded_ray.configure(local=True)
    assert os.environ[name] == "45"


def _of(temp: str) -> list[str]:
    """The live processes a sweep whose temporary directories are under ``temp`` started, and theirs (each inherits
    RAY_TMPDIR): Ray's, its workers and agents, the trial servers."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and (
                    proc.environ().get("RAY_TMPDIR") == temp or any(temp in a for a in proc.cmdline())):
                found.append(" ".join(proc.cmdline())[:120])
        except psutil.Error:  # gone meanwhile, or not this user's
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("point", ["store", "ray"])
def test_ctrl_c_while_a_sweep_starts_is_one_line_exit_130_and_leaves_nothing_running(tmp_path, point):
    """Ctrl-C (SIGINT to the driver's process group, as a terminal sends it) once the sweep's store is made (before
    Ray), and once Ray's raylet is starting: a KeyboardInterrupt traceback before; interrupted inside ray.init, the
    agents the raylet had started outlived the driver."""
    (tmp_path / "s.yaml").write_text(TINY)
    temp = tempfile.mkdtemp(prefix="jt-int-")  # short: Ray's socket paths must fit in 107 bytes
    reached = {"store": lambda: (tmp_path / "out" / "clean" / "sweep.yaml").exists(),
               "ray": lambda: any(Path(temp, "ray").glob("session_*/logs/raylet.out"))}[point]
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(tmp_path / "s.yaml"), "--out",
                               str(tmp_path / "out"), "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=user_env(tmp_path / "home", RAY_TMPDIR=temp, TMPDIR=temp))
    try:
        wait_for(lambda: reached() or driver.poll() is not None, timeout=240, interval=0.02)
        assert driver.poll() is None, driver.communicate()[1][-2000:]
        os.killpg(driver.pid, signal.SIGINT)
        out, err = driver.communicate(timeout=240)
        assert driver.returncode == 130, err[-3000:]
        assert err == ("juicytalk: interrupted; what the sweep started is stopped, its records stay, and the same "
                       "command resumes it\n") and not out, out[-2000:] + err[-2000:]
        assert not _of(temp)
    finally:
        if driver.poll() is None:
            driver.kill()
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)
