"""What a sweep does before its first trial (issue 31 item 6). The driver reads a sweep file without importing
torch. Trial servers the driver starts before Ray (orchestrator/launchers/prestart.py): a launcher adopts one
only when it is the process it would have spawned, runs its trial in it, and spawns its own when the server
died. No Ray: the launcher runs here, as it does in a Tune worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from orchestrator.launchers import LaunchSettings, make_launcher, prestart
from orchestrator.launchers.base import trial_env
from trials.spec import TrialSpec

from .conftest import REPO

SPEC = TrialSpec(d_model=32, n_layers=1, seq_len=32, batch_size=8, train_steps=2, bench_steps=2, warmup_steps=1,
                 gen_len=2, precision="fp32", device="cpu", profile=False).to_dict()
SETTINGS = LaunchSettings("warm", 4)


def test_the_driver_reads_a_sweep_without_importing_torch():
    """torch took seconds of the driver's start (trials/models/minigpt.py imported it to validate nothing)."""
    code = ("import sys; from orchestrator.sweep import load_sweep; load_sweep('examples/seed.yaml'); "
            "load_sweep('examples/quickstart.yaml'); print(sorted(m for m in sys.modules if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


@pytest.fixture
def as_a_worker(monkeypatch):
    """This process stands in for a Ray worker: the niceness and OMP_NUM_THREADS Ray would give it."""
    monkeypatch.setenv("RAY_worker_niceness", str(os.nice(0)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_plan_predicts_what_ray_gives_each_worker(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gpus = prestart.plan(SETTINGS, False, 4, {"gpu": 1, "cpu": 2.5}, ["2", "3"], 16.0, trials=5)
    assert [(name, env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]) for name, env in gpus] == [
        ("gpu2", "2", "2"), ("gpu3", "3", "2")]
    one = prestart.plan(SETTINGS, False, 4, {"gpu": 1, "cpu": 2}, ["0", "1"], 16.0, trials=1)
    assert [name for name, _ in one] == ["gpu0"]
    (name, env), = prestart.plan(SETTINGS, False, 4, {"gpu": 1, "cpu": 1}, [], 6.0, trials=3)  # the CPU fallback
    assert name == "cpu" and env["OMP_NUM_THREADS"] == "6" and "CUDA_VISIBLE_DEVICES" not in env
    assert prestart.plan(SETTINGS, False, 4, {"gpu": 0.5, "cpu": 1}, ["0"], 16.0, 3) == []


def test_only_the_process_a_launcher_would_spawn_is_adopted():
    env = trial_env(SETTINGS)
    offer = prestart.Offer(1, "s", "l", ["python", "-m", "trials.server"], {**env, "RAY_JOB_ID": "x"}, 15)
    ours = {**env, "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace", "RAY_RAYLET_PID": "7"}
    assert prestart.mismatch(offer, offer.command, ours, 15) == []  # what Ray adds to its workers does not count
    # the shell's idea of the working directory: Ray's workers get the driver's real one; neither process reads it
    moved = {**ours, "PWD": "/somewhere/else", "OLDPWD": "/before"}
    assert prestart.mismatch(offer, offer.command, moved, 15) == []
    assert prestart.mismatch(offer, offer.command, {**ours, "OMP_NUM_THREADS": "3"}, 15) == ["$OMP_NUM_THREADS"]
    assert prestart.mismatch(offer, offer.command + ["--fork"], ours, 0) == [
        "its command: -m trials.server", "niceness 15, not 0"]


def test_a_launcher_runs_its_first_trial_in_the_prestarted_server(as_a_worker):
    with prestart.start(SETTINGS, False, 4, {"gpu": 1, "cpu": 1}, [], 1.0, trials=1) as servers:
        (server,) = servers.procs
        launcher = make_launcher(LaunchSettings("warm", 4, servers=servers.directory))
        try:
            first, second = launcher.run(SPEC, 300).record, launcher.run(SPEC, 300).record
        finally:
            launcher.close()
        assert first["status"] == second["status"] == "ok"
        assert first["pid"] == second["pid"] == server.pid  # both trials in the server the driver started
        assert (first["process_trial_index"], second["process_trial_index"]) == (0, 1)
        assert server.wait(30) is not None  # closing the launcher ended the server it adopted


def test_a_server_that_died_before_adoption_is_replaced_by_a_spawned_one(as_a_worker):
    with prestart.start(SETTINGS, False, 4, {"gpu": 1, "cpu": 1}, [], 1.0, trials=1) as servers:
        (server,) = servers.procs
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        launcher = make_launcher(LaunchSettings("warm", 4, servers=servers.directory))
        try:
            record = launcher.run(SPEC, 300).record
        finally:
            launcher.close()
        assert record["status"] == "ok" and record["pid"] != server.pid


def test_a_te_preload_also_imports_what_tes_first_fused_call_would():
    """TE wraps its fusers in torch.compile, whose first call imports Dynamo's frame converter and Inductor:
    0.4-0.5 s of the seed example's first training step on the H200 (more where Python has no bytecode).
    A server that preloads TE imports them while Ray starts. Fails when torch moves a listed module (the
    preload would then skip it silently), when the preload touches CUDA (forked trials need it untouched), or
    when it ignores TE's own switch (NVTE_TORCH_COMPILE=0: TE compiles nothing, nothing to import)."""
    code = ("import os, sys, torch; from trials.backends import te_compat; mods = te_compat.FUSER_COMPILER_MODULES\n"
            "os.environ['NVTE_TORCH_COMPILE'] = '0'; te_compat.import_fuser_compiler()\n"
            "print([m for m in mods if m in sys.modules])\n"
            "os.environ['NVTE_TORCH_COMPILE'] = '1'; te_compat.import_fuser_compiler()\n"
            "print([m for m in mods if m not in sys.modules], torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split("\n")[:2] == ["[]", "[] False"], out.stdout + out.stderr[-2000:]


def test_a_package_compiled_from_source_by_every_process_is_found_and_the_fix_named(tmp_path, monkeypatch):
    """The lent H200 host sets PYTHONDONTWRITEBYTECODE and its torch has no .pyc: every process compiled torch and
    TE from source (11 s + 15.6 s per process; 3 s + 5.9 s with bytecode). doctor and the sweep say so, with the
    fix; where bytecode exists, or the first import can write it, they say nothing."""
    from trials.runtime import bytecode

    package = tmp_path / "jt_bytecode_probe"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bytecode, "CHECKED", ("jt_bytecode_probe", "jt_not_installed"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.compiled_from_source("jt_bytecode_probe") is None  # the first import will write it
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.compiled_from_source("jt_bytecode_probe") == "PYTHONDONTWRITEBYTECODE is set"
    line = bytecode.advice()
    assert line.startswith("jt_bytecode_probe has no bytecode here") and line.endswith(
        f"`python -m compileall -q -j 0 {tmp_path}` once writes it"), line
    import py_compile

    py_compile.compile(str(package / "__init__.py"), doraise=True)  # what compileall does
    assert bytecode.compiled_from_source("jt_bytecode_probe") is None and bytecode.advice() is None
