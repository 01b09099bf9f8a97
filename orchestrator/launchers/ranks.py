"""Multi-rank trials: a Ray Train worker group inside the Tune trial, one rank per worker.

A cell with ``world_size > 1`` is still one Tune trial; the trial itself holds no GPU and runs a
``TorchTrainer`` with ``ScalingConfig(num_workers=world_size, use_gpu=...)`` (the Ray 2.x pattern of
a Train driver inside a Tune trial), so the ranks can sit on several nodes of the cluster and Tune,
through Ray, accounts for every GPU they hold. The ``fit`` runs in a child process of the trial with a
Ray driver of its own, so that ending the child ends the whole Train run (see :func:`run_ranks`). Ray
Train makes the process group (NCCL on GPUs, gloo on CPU) and sets torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK); each worker then runs the ordinary trial (``trials.run_trial``), whose rank seam
(``trials/parallel/ranks.py``) finds the group made.

Records and faults. Rank 0 writes its record as a JSON file beside the run's directory on the sweep's
storage; a rank whose trial did not end ``ok`` writes its own too, then raises, so that Ray Train fails
the run and tears the worker group down (a rank stuck in a collective, or stopped, is killed with it).
Every rank writes its pid first; a failed rank SIGKILLs the other ranks on its host, because a stopped
rank answers neither a collective nor Ray Train's health check (ten minutes by default). No restarts: a
rank that died once would die again. The one record of the trial is rank 0's when it is
ok; otherwise the root cause: a rank's final status (``oom``, ``diverged``, ``unsupported``), else rank 0's
``timeout`` or ``error`` (a stopped rank makes the others' collectives time out after the group's timeout, at
most the sweep's ``trial_timeout_s``), else an ``error`` naming what Ray Train saw (a rank killed before anyone
wrote).
A rank stopped before its trial starts is caught by neither (Ray Train makes the process group first and
waits on every rank without a timeout): every rank must have started its trial (written its pid) within
Ray Train's start-up, its worker-group start timeout plus the process group's, else the trial ends as
``timeout`` (``benchmarks/rank_fault_start.py`` measures it). Once all have started, ``trial_timeout_s``
(plus a grace for the ranks to write and Ray Train to tear down) bounds the trial; null means no limit, as
for one-rank trials, and a rank that stops still ends it through the collectives' timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from trials.record.fields import FINAL_STATUSES

from .base import Outcome, failure_record

log = logging.getLogger(__name__)

RANKS_DRIVER_CPU = 0.01  # what the Tune trial of a multi-rank cell holds itself (Ray needs some resource)
END_GRACE_S = 60.0  # past trial_timeout_s: time for the ranks to write their records and Ray Train to tear down
POLL_S = 0.5  # how often the trial looks for the ranks' pid files while Ray Train starts


class RankFailed(RuntimeError):
    """Raised by a rank whose trial did not end ok, after writing its record: Ray Train then fails the run."""


def rank_cpu(resources: dict[str, float]) -> float:
    """The CPUs each rank (Ray Train worker) of a multi-rank trial asks: the file's per rank (``rank_cpu``, as
    ``runner.check_resources`` returns it) less the trial's own :data:`RANKS_DRIVER_CPU`, on GPU as on CPU, so
    that the ranks and their trial fit the CPUs ``runner.check_ranks`` counted (world_size x rank_cpu). One node of
    8 GPUs and 128 CPUs, {gpu: 1, cpu: 16}: 8 x 16 + 0.01 CPUs never fit it, and the worker group never started."""
    return max(0.0, resources.get("rank_cpu", resources.get("cpu", 1)) - RANKS_DRIVER_CPU)


def _beside(storage_path: str, leaf: str) -> str:
    """``leaf`` in the run's directory: before a storage URI's query (``?endpoint_override=...``,
    ``Store.url`` keeps it), which stays last, else every rank's file would be one object."""
    head, sep, query = storage_path.partition("?")
    return f"{head.rstrip('/')}/{leaf}{sep}{query}"


def record_path(storage_path: str, name: str, rank: int) -> str:
    return _beside(storage_path, f"{name}.rank{rank}.json")


def pid_path(storage_path: str, name: str, rank: int) -> str:
    return _beside(storage_path, f"{name}.rank{rank}.pid.json")


def _filesystem(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)


def _write_record(path: str, record: dict[str, Any]) -> None:
    from ..store import commit

    fs, where = _filesystem(path)
    fs.create_dir(where.rsplit("/", 1)[0], recursive=True)

    def write(p: str) -> None:
        with fs.open_output_stream(p) as out:
            out.write(json.dumps(record, allow_nan=True).encode())
    commit(fs, where, write)


def _read_record(path: str) -> dict[str, Any] | None:
    fs, where = _filesystem(path)
    try:
        with fs.open_input_stream(where) as f:
            return json.loads(f.read().decode())
    except (FileNotFoundError, OSError, ValueError):
        return None


def _rank_main(config: dict[str, Any]) -> None:
    """One rank: the trial; rank 0 writes its record, and so does any rank whose trial failed (then raises)."""
    os.environ.update(config["env"])
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from trials import TrialSpec, run_trial
    from trials.parallel.ranks import Ranks

    ranks = Ranks.from_env()
    where = config["storage_path"], config["name"]
    _write_record(pid_path(*where, ranks.rank), {"host": socket.gethostname(), "pid": os.getpid()})
    record = run_trial(TrialSpec.from_dict(config["spec"]))
    if ranks.lead or record["status"] != "ok":
        _write_record(record_path(*where, ranks.rank), record)
    if record["status"] != "ok":
        _kill_peers(*where, ranks)
        first_line = (record.get("error") or "").partition("\n")[0]
        raise RankFailed(f"rank {ranks.rank}: {record['status']}: {first_line}")


def _kill_peers(storage_path: str, name: str, ranks: Any) -> None:
    """SIGKILL the other ranks on this host (from the pid files they wrote when they started): a rank that
    stopped (SIGSTOP, a call that never returns) answers neither a collective nor Ray Train's health
    check, which would wait ten minutes for it. Ranks on other hosts are left to Ray Train."""
    host, me = socket.gethostname(), os.getpid()
    for rank in range(ranks.world):
        peer = _read_record(pid_path(storage_path, name, rank)) if rank != ranks.rank else None
        if peer and peer.get("host") == host and peer.get("pid") != me:
            try:
                os.kill(int(peer["pid"]), signal.SIGKILL)
            except OSError:
                pass


def _worker_group_start_timeout_s() -> float:
    """Ray Train's own bound on starting a worker group (its environment variable, else its default; 60 s in
    Ray 2.60, and that figure if a Ray without these constants is installed)."""
    try:
        from ray.train.v2._internal.constants import (DEFAULT_WORKER_GROUP_START_TIMEOUT_S,
                                                      WORKER_GROUP_START_TIMEOUT_S_ENV_VAR)
    except ImportError:
        return float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", 60.0))
    return float(os.environ.get(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, DEFAULT_WORKER_GROUP_START_TIMEOUT_S))


def _all_started(child: subprocess.Popen, storage_path: str, name: str, world: int, deadline: float) -> bool:
    """True once every rank has written its pid file (it runs the trial), or the run ended before; False at
    ``deadline`` (time.monotonic) with the run still going."""
    while child.poll() is None:
        if all(_read_record(pid_path(storage_path, name, r)) for r in range(world)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def one_record(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The trial's record from what the ranks wrote: rank 0's if ok, else the root cause (see above): the first
    rank's final status (oom, diverged, unsupported), which the sweep does not rerun, over rank 0's timeout or error
    (its collective waiting on the rank that failed), which every rerun would repeat."""
    lead = records.get(0)
    if lead is not None and lead["status"] == "ok":
        return lead
    chosen = next((r for _, r in sorted(records.items()) if r["status"] in FINAL_STATUSES), None) or lead
    if chosen is None and records:
        chosen = records[min(records)]
    if chosen is not None and chosen is not lead:
        rank = next(k for k, r in records.items() if r is chosen)
        chosen = {**chosen, "error": f"rank {rank}: {chosen.get('error') or ''}"[:4000]}
    return chosen


def run_ranks(spec: dict[str, Any], env: dict[str, str], use_gpu: bool, cpu_per_rank: float, storage_path: str,
              name: str, timeout_s: float | None = None) -> Outcome:
    """Run ``spec`` on ``spec['world_size']`` Ray Train workers; the trial's one record, or why there is none.
    ``timeout_s`` (the sweep's trial timeout, None for none) bounds how long one collective may wait and,
    once every rank has started, the whole trial (see the module's docstring).

    The Train run has a Ray driver of its own, a child process (:func:`drive`): Ray Train's controller and
    ranks belong to the process that called ``fit``, and a run past a deadline must let go of what it holds
    (a stopped rank's CPU or GPU, its peers') or the sweep's next multi-rank trial waits for it. Killing the
    child ends its Ray job and with it every actor and placement group of the run."""
    import ray

    from trials.spec import COLLECTIVE_TIMEOUT_S

    t0 = time.perf_counter()
    world = int(spec["world_size"])
    collective_s = min(COLLECTIVE_TIMEOUT_S, timeout_s) if timeout_s else COLLECTIVE_TIMEOUT_S
    start_s = _worker_group_start_timeout_s() + collective_s
    with tempfile.TemporaryDirectory(prefix="juicytalk-ranks-") as tmp:
        job = {"address": ray.get_runtime_context().gcs_address, "spec": spec, "env": env, "use_gpu": use_gpu,
               "cpu_per_rank": cpu_per_rank, "storage_path": storage_path, "name": name,
               "collective_s": collective_s, "result": os.path.join(tmp, "result.json")}
        Path(tmp, "job.json").write_text(json.dumps(job))
        with open(os.path.join(tmp, "driver.log"), "wb") as out:
            child = subprocess.Popen([sys.executable, "-m", __name__, os.path.join(tmp, "job.json")], stdout=out,
                                     stderr=subprocess.STDOUT)
        try:
            started = _all_started(child, storage_path, name, world, time.monotonic() + start_s)
            if started:
                try:
                    child.wait(timeout_s + END_GRACE_S if timeout_s else None)
                except subprocess.TimeoutExpired:
                    pass
            hung = child.poll() is None
        finally:
            if child.poll() is None:  # past a deadline, or this trial is being stopped: the Train run goes too
                child.kill()
                child.wait()
        result = _read_record(job["result"]) or {}
        driver_log = Path(tmp, "driver.log").read_text(errors="replace").strip()[-800:]
    if hung and not started:
        why = (f"timed out: not every rank started its trial within Ray Train's start-up ({start_s:g} s: the worker "
               "group's start timeout and the process group's); a rank stopped or could not be placed")
    elif hung:
        why = (f"timed out: the ranks did not end within trial_timeout_s + {END_GRACE_S:g} s of starting their trial "
               f"({timeout_s + END_GRACE_S:g} s)")
    elif "failed" not in result:
        why = f"the Ray Train driver exited {child.returncode} without a result: {driver_log}"
    else:
        why = result["failed"] or ""
    if why:
        log.warning("multi-rank trial %s: %s", name, why)
    wall = time.perf_counter() - t0
    record = one_record({r: rec for r in range(world) if (rec := _read_record(record_path(storage_path, name, r)))})
    if record is None:
        record = failure_record(spec, "timeout" if hung else "error", (why or "the ranks wrote no record")[:4000])
    return Outcome(record, f"{world} ranks through Ray Train ({why or 'all ok'}); logs in Ray's session directory",
                   wall)


def drive(job_path: str) -> None:
    """The child process of :func:`run_ranks`: a Ray driver that runs the ``TorchTrainer`` and writes whether
    it failed. It exits when its parent (the Tune trial) is gone, so that a killed trial leaves no run."""
    job = json.loads(Path(job_path).read_text())
    parent = os.getppid()

    def exit_when_orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=exit_when_orphaned, name="parent-watch", daemon=True).start()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    pythonpath = os.environ.get("PYTHONPATH")  # how the ranks import this package where it is not installed
    ray.init(address=job["address"], log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}} if pythonpath else None)
    use_gpu = job["use_gpu"]
    trainer = TorchTrainer(
        _rank_main,
        train_loop_config={k: job[k] for k in ("spec", "env", "storage_path", "name")},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(max(1, job["collective_s"]))),
        scaling_config=ScalingConfig(num_workers=int(job["spec"]["world_size"]), use_gpu=use_gpu,
                                     resources_per_worker={"CPU": job["cpu_per_rank"], **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(name=job["name"], storage_path=job["storage_path"],
                             failure_config=FailureConfig(max_failures=0)),
    )
    failed = None
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - TrainingFailedError and whatever a worker group raises
        text = str(exc).strip()
        failed = f"a rank failed: {type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
    _write_record(job["result"], {"failed": failed})  # whole or not at all: the trial may kill this process


if __name__ == "__main__":
    from orchestrator.launchers.ranks import drive as _drive  # by the module's name: the ranks import it so

    _drive(sys.argv[1])
