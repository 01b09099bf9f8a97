"""Shared fixtures. Ray is started once per test session: a real two-node cluster on this machine
(``ray start --head`` plus a second ``ray start --address``), with token authentication on."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Token authentication, explicitly, for every Ray this suite starts (local or cluster).
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
os.environ.pop("RAY_ADDRESS", None)
OOM_VOCAB = 400_000_000  # a 100 GB embedding: the allocator refuses it at once on any CI machine


def _ray_bin() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else shutil.which("ray") or "ray"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A new user's shell: this machine's environment less every RAY_* variable (conftest's token auth among
    them) and PYTHONPATH, with an empty ``home`` (so no ~/.ray). What the README's commands must pass in."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    env.update(HOME=str(home), **extra)
    return env


def juicytalk(*args: str, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          env=env or cli_env(), timeout=timeout, cwd=kw.pop("cwd", REPO), **kw)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Trials run in this process (tests/test_trial_cpu.py and others) on one thread: these tiny models gain
    nothing from a second, and on a 2-core host beside the test cluster OpenMP's spinning threads contend (the
    pinned 300-step cell: 10 s on one thread, 56 s on two, its loss trajectory the same to 1e-4)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """Address of a two-node Ray cluster on loopback (head: 1 CPU, worker: 1 CPU)."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    common = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=120000000", "--disable-usage-stats"]
    env = cli_env()
    head = subprocess.run([_ray_bin(), "start", "--head", f"--port={port}", "--include-dashboard=false",
                           f"--temp-dir={temp}", *common], capture_output=True, text=True, env=env, timeout=120)
    assert head.returncode == 0, head.stderr[-2000:]
    address = f"127.0.0.1:{port}"
    worker = subprocess.run([_ray_bin(), "start", f"--address={address}", *common], capture_output=True,
                            text=True, env=env, timeout=120)
    assert worker.returncode == 0, worker.stderr[-2000:]
    yield address
    stop_cluster(str(temp))


@pytest.fixture(scope="session")
def tracked_sweep(ray_cluster, tmp_path_factory):
    """One ordinary sweep on the test cluster that several tests read (a sweep costs ~15 s of start-up):
    two CPU cells and two FP8 cells (unsupported on CPU: records too), to MLflow, W&B (offline) and
    TensorBoard. Returns (out, run, mlflow_uri); the sweep's directory is ``out / "trk"``. Tests that change
    it work on a copy."""
    out = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{out / 'db' / 'mlflow.db'}"  # MLflow 3's recommended store; its folder is made
    (out / "trk.yaml").write_text(TRACKED_SWEEP.format(uri=uri, wandb=out / "wb"))
    run = juicytalk("sweep", str(out / "trk.yaml"), "--out", str(out), "--address", ray_cluster, "--no-progress",
                    "--no-report", env=cli_env(WANDB_SILENT="true"))
    return out, run, uri


TRACKED_SWEEP = """name: trk
grid: {{d_model: [32, 48], precision: [fp32, fp8]}}
fixed: {{n_layers: 1, seq_len: 32, batch_size: 8, train_steps: 3, bench_steps: 2, warmup_steps: 1, gen_len: 2}}
resources: {{cpu: 1, gpu: 0}}
trackers:
  - mlflow: {{tracking_uri: "{uri}", experiment: trk-exp}}
  - wandb: {{project: juicytalk-test, mode: offline, dir: "{wandb}"}}
  - tensorboard: {{}}
"""


def stop_cluster(temp_dir: str) -> None:
    """Kill the processes of the cluster whose temp dir is ``temp_dir``, and theirs. Not ``ray stop``, which
    kills every Ray on the host: a user's, a concurrent test run's, an embedded sweep's."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"])
             if p.pid != os.getpid() and any(temp_dir in a for a in (p.info["cmdline"] or []))]
    procs = {}
    for root in roots:
        try:
            procs.update({p.pid: p for p in (root, *root.children(recursive=True))})
        except psutil.Error:
            pass
    for p in procs.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=10)


@pytest.fixture(scope="session")
def te():
    """Transformer Engine's module for the GPU tests (-m gpu); skips without a CUDA GPU or TE."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trials.te_compat import import_te

    try:
        return import_te()
    except ImportError as exc:
        pytest.skip(f"Transformer Engine not importable: {exc}")


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def running_trial(running: Path, min_age_s: float = 0.0):
    """(key, marker) of a trial whose trial process has started and run ``min_age_s``, else None."""
    for marker in (running.glob("*.json") if running.exists() else []):
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue  # a marker being replaced right now
        if info.get("child_pid") and time.time() - info["started_at"] >= min_age_s:
            return marker.stem, info
    return None
