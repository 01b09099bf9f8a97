"""Shared fixtures. Ray is started once per test session: a real two-node cluster on this machine
(``ray start --head`` plus a second ``ray start --address``), with token authentication on.

The whole suite (``pytest`` with no path: the README's and CI's command) runs on three pytest-xdist workers
(:func:`pytest_cmdline_main`) on the 2-core CI machine: its slow tests wait on subprocesses, Ray's start, trials
that sleep and timeouts, and with two workers the cores were idle ~30% of the run; a third fills them. A
session is then a worker's: each worker that runs a test needing the cluster starts its own
(two sweeps sharing one two-CPU cluster would queue behind each other and could not say which node ran
what), and a fixture that is one run several tests read puts those tests on one worker
(:data:`SHARED_RUNS`). A path or test named on the command line, ``-n 0``, or no pytest-xdist installed
(the GPU host): one process, as before."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Token authentication, explicitly, for every Ray this suite starts (local or cluster).
os.environ["RAY_AUTH_MODE"] = "token"
# A token of this test process's own (each xdist worker its own): tests tell their session's Ray processes by it.
if "RAY_AUTH_TOKEN" not in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
os.environ.pop("RAY_ADDRESS", None)
# OpenMP threads that sleep at a barrier rather than spin: a CPU trial that takes the whole host (the quickstart,
# every local sweep: OMP_NUM_THREADS=2) spins one core while its other thread waits for the core the other
# xdist worker holds. The quickstart sweep beside one busy process at the same niceness: 316 s spinning, 37 s
# passive (22 s alone). Every process the suite starts inherits it (user_env too: it is no Ray setting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
OOM_VOCAB = 400_000_000  # a 100 GB embedding: the allocator refuses it at once on any CI machine
# A tiny model whose forward passes wait (tests/fixtures/factories.py): for the fault tests that must catch a
# trial mid-run, a trial that lasts in wall time (~22 ms a train step) without taking a core from the suite
SLOW_MODEL = "py:tests.fixtures.factories:slow"
# A tiny model whose build waits for a second trial's, in another process: two trials at once, so on two nodes
PAIRED_MODEL = "py:tests.fixtures.factories:paired"


WORKERS = 3  # the CI machine's 2 cores and the suite's waits (above); each worker starts a cluster of its own
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Ray runs its workers (every sweep's trials) at niceness 15; a test worker at 0, with the in-process trials and
    # sweep drivers it starts, took the cores from the other worker's sweeps (the quickstart fixture 98 s serial,
    # 396 s beside it). At Ray's niceness every process of the suite competes on equal terms.
    os.nice(max(0, int(os.environ.get("RAY_worker_niceness", "15")) - os.nice(0)))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns -n into workers
def pytest_cmdline_main(config):
    """``pytest`` with no path runs the whole suite on :data:`WORKERS` xdist workers, unless -n was given;
    workers share the tests out by group (``--dist loadgroup``) unless another --dist was given."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is None and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        config.option.numprocesses = WORKERS
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadgroup"


# Fixtures that are one run several tests read (a sweep costs ~15 s of start-up): the tests reading one are an
# xdist group of its name, so that the run is made once, on one worker, not once on each. s3: tests/test_s3.py's
# moto server, which its shared sweep (s3_sweep) and its other tests use.
SHARED_RUNS = ("tracked_sweep", "warm_sweep", "quickstart", "s3")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """On an xdist worker: group the readers of each shared run (above), and put the tests marked ``slow``
    first, so that the workers start the longest tests early and do not end on one of them alone (xdist
    hands out its larger groups first anyway, and a group's tests stay in a row)."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        shared = [name for name in SHARED_RUNS if name in item.fixturenames]
        if shared:
            group = shared[0]
            item.add_marker(pytest.mark.xdist_group(group))
            if hasattr(item, "_id") and not item.nodeid.endswith("@" + group):
                # xdist 3.8 tells its scheduler a test's group by appending "@group" to the test's id through
                # item._nodeid, which pytest 9.2's structured ids no longer read (pytest-xdist#1386, fix in
                # #1388), and only when the worker's own command line said --dist loadgroup (here the
                # controller chose it): done here, on the structured id, as that fix does
                item._id = type(item._id).parse(f"{item.nodeid}@{group}")
    items.sort(key=lambda item: not (item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group")))


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


def installed_juicytalk(*args: str, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed ``juicytalk`` command in ``cwd`` (a user's project folder), as a user would: unlike
    ``python -m``, which :func:`juicytalk` runs, it puts no working directory on ``sys.path`` (Python puts the
    script's own folder there). Without the script (not installed with pip), ``python -P -m`` does the same."""
    script = Path(sys.executable).with_name("juicytalk")
    command = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "orchestrator.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Trials run in this process (tests/test_trial_cpu.py and others) on one thread: these tiny models gain
    nothing from a second, and on a 2-core host beside the test cluster OpenMP's spinning threads contend (the
    pinned 300-step cell: 10 s on one thread, 56 s on two, its loss trajectory the same to 1e-4)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    """Address of a two-node Ray cluster on loopback (head: 1 CPU, worker: 1 CPU)."""
    port = _free_port()
    # Ray's socket paths (<temp>/session_<date>_<pid>/sockets/plasma_store.1) must fit in 107 bytes: a short
    # directory of its own in /tmp, not pytest's (under xdist, /tmp/pytest-of-<user>/pytest-<n>/popen-gw0/...)
    temp = tempfile.mkdtemp(prefix="jt-ray-")
    # No log monitor: it streams every Ray worker's log to drivers that say log_to_driver (a sweep's, with -v
    # only, which no test gives), ~1 CPU-s a minute per node idle and more while trials log
    common = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=120000000", "--disable-usage-stats",
              "--include-log-monitor=false"]
    # Ray Train's controller polls its ranks every 2 s by default; a multi-rank trial's start and end each wait
    # for polls (tests/test_distributed.py runs four such trials). Its preemption watcher (an actor per Train run,
    # a process importing Ray: ~2 CPU-s a trial) watches for nodes being drained, which these never are.
    # Ray Train's bound on starting a worker group (60 s by default; the product adds it to a multi-rank trial's
    # start bound): on a 2-core CI host under the whole suite, two two-rank cells of tests/test_distributed.py
    # (each starts six new Ray processes) did not have both ranks running within 60 + 12 s and were recorded as
    # start timeouts; the bound is for a hung start, which no test here makes.
    # The rendezvous of tests/fixtures/factories.py:paired, whose trials run in this cluster's workers.
    env = cli_env(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
                  RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="180", JUICYTALK_TEST_PAIR_DIR=os.path.join(temp, "pair"))
    try:
        head = subprocess.run([_ray_bin(), "start", "--head", f"--port={port}", "--include-dashboard=false",
                               f"--temp-dir={temp}", *common], capture_output=True, text=True, env=env, timeout=120)
        assert head.returncode == 0, head.stderr[-2000:]
        address = f"127.0.0.1:{port}"
        worker = subprocess.run([_ray_bin(), "start", f"--address={address}", *common], capture_output=True,
                                text=True, env=env, timeout=120)
        assert worker.returncode == 0, worker.stderr[-2000:]
        yield address
    finally:  # a node that did not start leaves the other running
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def tracked_sweep(ray_cluster, tmp_path_factory):
    """One ordinary sweep on the test cluster that several tests read (a sweep costs ~15 s of start-up):
    two CPU cells of :data:`PAIRED_MODEL` (so they ran at once, one on each node) and two FP8 cells
    (unsupported on CPU: records too), to MLflow, W&B (offline) and TensorBoard. Returns (out, run,
    mlflow_uri); the sweep's directory is ``out / "trk"``. Tests that change it work on a copy."""
    out = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{out / 'db' / 'mlflow.db'}"  # MLflow 3's recommended store; its folder is made
    (out / "trk.yaml").write_text(TRACKED_SWEEP.format(uri=uri, wandb=out / "wb", model=PAIRED_MODEL))
    run = juicytalk("sweep", str(out / "trk.yaml"), "--out", str(out), "--address", ray_cluster, "--no-progress",
                    "--no-report", env=cli_env(WANDB_SILENT="true"))
    return out, run, uri


TRACKED_SWEEP = """name: trk
grid: {{d_model: [32, 48], precision: [fp32, fp8]}}
fixed: {{model: "{model}", seq_len: 32, batch_size: 8, train_steps: 3, bench_steps: 2, warmup_steps: 1, gen_len: 2}}
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
    from trials.backends.te_compat import import_te

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


def tf_compared() -> list[str]:
    """The teacher-forced fields a BF16 partner's read decides (not its timing, nor whether it was kept)."""
    from trials.record.fields import FIELD_NAMES

    return [name for name in FIELD_NAMES if name.startswith("tf_") and name not in ("tf_s", "tf_partner_reused")]
