"""The Ray Tune driver: pending (cell, sample) pairs -> one Tune trial each -> one record each.

Each Tune trial runs in a fresh Ray worker (``reuse_actors=False``), and the worker runs the trial
itself in a child process (``python -m trials``): a CUDA context, a crash or a hang never outlives its
trial, ``trial_timeout_s`` can kill a stuck trial, and a worker killed from outside is retried by
Tune's ``FailureConfig``. A trial that fails on its own (OOM, divergence, an exception) still
produces a record and is not retried: an OOM would only happen again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trials.record import FINAL_STATUSES, empty_record

from .store import Store, trial_key, utc_stamp
from .sweep import Sweep

log = logging.getLogger(__name__)

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
MAX_FAILURES = 2  # Tune retries of a trial whose worker or trial process died


class SweepInputError(ValueError):
    """The sweep cannot run here as given (unschedulable resources, storage not shared); exit 2."""


@dataclass
class SweepOutcome:
    total: int
    ran: int
    already_done: int
    run_id: str = ""
    statuses: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    results_path: str | None = None

    @property
    def failed(self) -> list[str]:
        return sorted(k for k, s in self.statuses.items() if s not in FINAL_STATUSES)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.failed


def work_items(sweep: Sweep, storage: str) -> list[dict[str, Any]]:
    items = []
    for cell in sweep.cells:
        for sample in range(sweep.samples):
            spec = cell.spec.to_dict()
            spec["seed"] = cell.spec.seed + sample  # independent samples, same across the cells they pair with
            items.append({"key": trial_key(cell.cell_id, sample), "cell_id": cell.cell_id, "sample": sample,
                          "label": cell.label, "spec": spec, "storage": storage, "sweep_name": sweep.name,
                          "timeout_s": sweep.trial_timeout_s})
    return items


# ---------------------------------------------------------------------------------------------
# Ray session
# ---------------------------------------------------------------------------------------------
@contextmanager
def ray_session(address: str | None, dashboard: bool = False, verbose: bool = False) -> Iterator[Any]:
    """Connect to ``address`` (or RAY_ADDRESS), else start a local embedded Ray; shut it down after."""
    import ray

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    if address:
        ray.init(address=address, **kwargs)
    else:
        pythonpath = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        # address="local": always a new embedded instance, never some cluster started earlier on this host.
        ray.init(address="local", include_dashboard=dashboard, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                 **kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


def check_resources(ray: Any, resources: dict[str, float]) -> dict[str, float]:
    """Fail fast when no node can ever hold one trial; without GPUs anywhere, fall back to CPU."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total_gpu = sum(n["Resources"].get("GPU", 0) for n in nodes)
    wanted = dict(resources)
    if wanted.get("gpu", 0) > 0 and total_gpu == 0:
        log.warning("no GPUs in this Ray cluster: trials run on CPU (torch backend); te/fp8 cells are unsupported")
        wanted["gpu"] = 0
    fits = [n for n in nodes if n["Resources"].get("CPU", 0) >= wanted["cpu"]
            and n["Resources"].get("GPU", 0) >= wanted.get("gpu", 0)]
    if not fits:
        best = ", ".join(f"{n['NodeManagerAddress']}: cpu={n['Resources'].get('CPU', 0):g} "
                         f"gpu={n['Resources'].get('GPU', 0):g}" for n in nodes)
        raise SweepInputError(f"resources: no node can run a trial needing cpu={wanted['cpu']:g} "
                              f"gpu={wanted.get('gpu', 0):g} (nodes: {best}); lower resources in the sweep file")
    return wanted


def _probe_storage(path: str, marker: str) -> tuple[str, bool]:
    import ray

    return ray.util.get_node_ip_address(), os.path.exists(os.path.join(path, marker))


def check_shared_storage(ray: Any, store: Store) -> None:
    """A multi-node sweep needs storage every node sees; a node-local path would lose records."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    if len(nodes) < 2 or not store.local:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = f".probe-{os.getpid()}-{int(time.time() * 1000)}"
    Path(store.root, marker).write_text("juicytalk storage probe")
    try:
        probe = ray.remote(num_cpus=0)(_probe_storage)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(store.root, marker) for n in nodes]
        blind = [ip for ip, seen in ray.get(refs, timeout=120) if not seen]
    finally:
        Path(store.root, marker).unlink(missing_ok=True)
    if blind:
        raise SweepInputError(
            f"storage: {store.root} is node-local: node(s) {', '.join(sorted(set(blind)))} cannot see it. A "
            "multi-node sweep needs shared storage (an NFS/EFS mount on every node, or an s3:// / gs:// URI)")


# ---------------------------------------------------------------------------------------------
# Inside a Ray worker
# ---------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Child-side: get SIGKILLed when the supervising worker dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def gpu_context() -> dict[str, Any]:
    """Memory already used on the trial's GPU(s) and the other processes there, via NVML."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out: dict[str, Any] = {"cuda_visible_devices": visible, "gpu_mem_in_use_at_start_bytes": None,
                           "foreign_gpu_processes": None}
    if not visible:
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here
        return out
    try:
        used, foreign = 0, []
        for token in visible.split(","):
            token = token.strip()
            handle = (pynvml.nvmlDeviceGetHandleByUUID(token) if token.startswith(("GPU-", "MIG-"))
                      else pynvml.nvmlDeviceGetHandleByIndex(int(token)))
            used += int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                foreign.append({"pid": proc.pid, "used_bytes": proc.usedGpuMemory})
        out.update(gpu_mem_in_use_at_start_bytes=used, foreign_gpu_processes=json.dumps(foreign))
    except Exception as exc:  # noqa: BLE001
        log.debug("NVML query failed: %s", exc)
    finally:
        pynvml.nvmlShutdown()
    return out


def _failure_record(spec: dict[str, Any], status: str, error: str) -> dict[str, Any]:
    record = empty_record()
    record.update(spec)
    record.update(status=status, error=error)
    return record


def run_trial_process(item: dict[str, Any], store: Store, on_start=None) -> dict[str, Any]:
    """Run one trial in a child process; returns its record (a timeout becomes a record too).

    Raises RuntimeError when the child died without a record (killed, crashed): Tune retries that.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="juicytalk-") as tmp:
        out_json = Path(tmp, "record.json")
        log_path = Path(tmp, "trial.log")
        cmd = [sys.executable, "-m", "trials", "--spec-json", json.dumps(item["spec"]), "--json", str(out_json), "-q"]
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                    preexec_fn=_die_with_parent)
            if on_start:
                on_start(proc.pid)
            try:
                rc = proc.wait(timeout=item.get("timeout_s"))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
        log_text = log_path.read_text(errors="replace")
        store.write_text(store.path("logs", item["key"] + ".log"), log_text)
        if rc is None:
            record = _failure_record(item["spec"], "timeout", f"exceeded trial_timeout_s={item['timeout_s']}")
        elif out_json.exists():
            record = json.loads(out_json.read_text())
        else:
            tail = log_text.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"trial process exited with {rc} and no record: {tail[0][:500]}")
        record["trial_wall_s"] = time.perf_counter() - t0
        return record


def trial_trainable(config: dict[str, Any]) -> None:
    """The Tune function trainable: one (cell, sample) -> one record in the store."""
    import ray
    from ray import tune

    item = config["item"]
    store = Store(item["storage"], item["sweep_name"])
    ctx = tune.get_context()
    info = {"worker_pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "label": item["label"],
            "started_at": time.time(), "trial_id": ctx.get_trial_id()}
    gpu = gpu_context()

    def started(pid: int) -> None:
        store.mark_running(item["key"], {**info, "child_pid": pid})

    store.mark_running(item["key"], info)
    try:
        record = run_trial_process(item, store, on_start=started)
    finally:
        store.clear_running(item["key"])
    record.update(gpu)
    record.update(item["run"])
    record.update(cell_id=item["cell_id"], cell_label=item["label"], sample=item["sample"],
                  trial_id=ctx.get_trial_id(), node_id=ray.get_runtime_context().get_node_id(),
                  node_ip=info["node_ip"], worker_pid=os.getpid(), ray_version=ray.__version__)
    store.write_record(record)
    tune.report({"status": record["status"], "step_ms_p50": record.get("step_ms_p50") or float("nan")})


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
def fit(ray: Any, sweep: Sweep, store: Store, items: list[dict[str, Any]], resources: dict[str, float],
        max_concurrent: int | None, verbose: bool) -> None:
    from ray import tune

    trainable = tune.with_resources(trial_trainable, {"cpu": resources["cpu"], "gpu": resources.get("gpu", 0)})
    tuner = tune.Tuner(
        trainable,
        param_space={"item": tune.grid_search(items)},
        tune_config=tune.TuneConfig(
            num_samples=1,
            max_concurrent_trials=max_concurrent,
            reuse_actors=False,
            trial_name_creator=lambda t: t.config["item"]["key"],
            trial_dirname_creator=lambda t: t.config["item"]["key"],
        ),
        run_config=tune.RunConfig(
            name=f"{sweep.name}-{time.strftime('%Y%m%dT%H%M%S')}",
            storage_path=store.path("ray") if store.local else f"{store.storage.rstrip('/')}/{sweep.name}/ray",
            failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
            verbose=1 if verbose else 0,
            log_to_file=True,
        ),
    )
    tuner.fit()


def prepare_store(sweep: Sweep, storage: str, restart: bool) -> Store:
    """Open the sweep's directory; ``restart`` moves an existing one aside (nothing is deleted)."""
    store = Store(storage, sweep.name)
    if restart and store.local and Path(store.root).exists():
        aside = f"{store.root}-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(store.root, aside)
        log.warning("--restart: previous results moved to %s", aside)
    store.ensure()
    store.remove_temporaries()
    for key in store.running():  # one driver per sweep: markers at start are from a crashed run
        store.clear_running(key)
    store.write_text(store.path("sweep.yaml"), sweep.source_text)
    return store


def run_sweep(sweep: Sweep, storage: str, address: str | None = None, restart: bool = False,
              max_concurrent: int | None = None, verbose: bool = False, dashboard: bool = False,
              progress: Any = None) -> SweepOutcome:
    """Run every (cell, sample) without a final record; consolidate; report what is missing."""
    t0 = time.perf_counter()
    started = utc_stamp()
    run = {"run_id": f"{started.replace('-', '').replace(':', '')}-{uuid.uuid4().hex[:6]}",
           "run_started_at": started, "run_gpus": None}
    store = prepare_store(sweep, storage, restart)
    items = work_items(sweep, storage if "://" in storage else str(Path(storage).expanduser().resolve()))
    done = store.final_keys()
    pending = [it for it in items if it["key"] not in done]
    log.info("%d trials, %d already have a final record, %d to run", len(items), len(items) - len(pending), len(pending))
    if pending:
        with ray_session(address, dashboard=dashboard, verbose=verbose) as ray:
            resources = check_resources(ray, sweep.resources)
            check_shared_storage(ray, store)
            run["run_gpus"] = int(ray.cluster_resources().get("GPU", 0)) if resources.get("gpu") else 0
            for it in pending:
                it["run"] = run
            if progress is not None:
                progress.start(store, items, done)
            try:
                fit(ray, sweep, store, pending, resources, max_concurrent or sweep.max_concurrent, verbose)
            finally:
                if progress is not None:
                    progress.stop()
    statuses = store.statuses()
    keys = {it["key"] for it in items}
    path, _ = store.collect()
    return SweepOutcome(total=len(items), ran=len(pending), already_done=len(items) - len(pending),
                        run_id=run["run_id"], statuses={k: v for k, v in statuses.items() if k in keys},
                        missing=sorted(keys - statuses.keys()), wall_s=time.perf_counter() - t0,
                        results_path=path)
