"""The Ray Tune trainable: one (cell, sample) -> one record in the store, on a reused Ray worker.

Tune reuses the worker actor across trials (``reuse_actors=True``, :meth:`TrialTrainable.reset_config`),
so the launcher it holds - and the trial process that launcher keeps ready - outlive a single trial.
Every (cell, sample) is still its own Tune trial: scheduling, retries (``FailureConfig``), timeouts
and callbacks see every cell. A trial process that dies without a record raises
:class:`~orchestrator.launchers.TrialDied` here, which Tune retries on a fresh worker.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import ray
from ray import tune

from trials.measure import nvml
from trials.models import CWD_ENV

from .launchers import LaunchSettings, TrialDied, make_launcher
from .launchers.base import trial_env
from .launchers.ranks import rank_cpu, run_ranks
from .store import StorageFull, Store
from .trackers.base import RESULT_TAGS
from .work import Context, WorkItem

log = logging.getLogger(__name__)

STORAGE_FULL = "juicytalk_storage_full"  # a trial's Tune result when its record could not be written


def gpu_context(own_pids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Memory already used on the trial's GPU(s) and the other processes there, via NVML.

    ``own_pids``: this worker's own trial process (a warm one holds a CUDA context between trials),
    which is not foreign.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out: dict[str, Any] = {"cuda_visible_devices": visible, "gpu_mem_in_use_at_start_bytes": None,
                           "foreign_gpu_processes": None}
    if not visible:
        return out
    with nvml.session() as nv:
        if nv is None:
            return out
        try:
            used, foreign = 0, []
            for token in visible.split(","):
                device = nvml.handle(nv, token)
                used += int(nv.nvmlDeviceGetMemoryInfo(device).used)
                foreign += [{"pid": pid, "used_bytes": b} for pid, b in nvml.compute_processes(nv, device)
                            if pid not in own_pids]
            out.update(gpu_mem_in_use_at_start_bytes=used, foreign_gpu_processes=json.dumps(foreign))
        except Exception as exc:  # noqa: BLE001
            log.debug("NVML query failed: %s", exc)
    return out


def tune_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """Every numeric field of the record, and its status and tags, for Tune's results and trackers."""
    metrics: dict[str, Any] = {k: v for k, v in record.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({k: record.get(k) for k in RESULT_TAGS})
    return metrics


class TrialTrainable(tune.Trainable):
    """Runs the (cell, sample) its config describes through the sweep's launcher.

    The config is what Tune and its callbacks see (the flattened spec, sample, cell id), from the grid
    or from a searcher alike; the item is rebuilt from it (:meth:`WorkItem.from_config`). ``context``
    (``tune.with_parameters``) holds what every trial of the run shares: storage, timeout, launch settings.
    """

    def setup(self, config: dict[str, Any], context: Context) -> None:
        self.context = context
        self.item = WorkItem.from_config(config)
        self.settings = LaunchSettings(**context.launch)
        self._launcher: Any = None  # made on the first single-rank trial (a multi-rank one needs no trial process)

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Take the next trial on this worker, keeping the launcher and its ready trial process."""
        self.item = WorkItem.from_config(new_config)
        return True

    def step(self) -> dict[str, Any]:
        try:
            return self._run_one()
        except StorageFull as exc:  # retrying into a full disk cannot help: the driver stops the sweep
            log.error("storage full: %s", exc)
            return {"done": True, STORAGE_FULL: str(exc)}

    def _run_one(self) -> dict[str, Any]:
        item, ctx = self.item, self.context
        store = Store(ctx.storage, ctx.sweep_name)
        info = {"worker_pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "label": item.label,
                "started_at": time.time(), "trial_id": self.trial_id}
        gpu = gpu_context(self._launcher.own_pids() if self._launcher is not None else frozenset())

        def started(pid: int) -> None:
            store.mark_running(item.key, {**info, "child_pid": pid})

        store.mark_running(item.key, info)
        try:
            if int(item.spec.get("world_size", 1)) > 1:  # the ranks are Ray Train workers, not a trial process
                env = {k: v for k, v in trial_env(self.settings).items() if k.endswith("CACHE_DIR") or k == CWD_ENV}
                train_dir = store.url("ray", "train")
                use_gpu = bool(ctx.resources.get("gpu"))
                outcome = run_ranks(item.spec, env, use_gpu, rank_cpu(ctx.resources), train_dir,
                                    f"{item.key}-{int(time.time())}", ctx.timeout_s)
            else:
                if self._launcher is None:
                    self._launcher = make_launcher(self.settings)
                outcome = self._launcher.run(item.spec, ctx.timeout_s, on_start=started)
        finally:
            store.clear_running(item.key)
        store.write_text(store.path("logs", item.key + ".log"), outcome.log_text)
        if outcome.record is None:
            raise TrialDied(outcome.died)
        record = outcome.record
        record.update(gpu)
        record.update(ctx.run)
        record.update(cell_id=item.cell_id, cell_label=item.label, sample=item.sample,
                      trial_id=self.trial_id, node_id=ray.get_runtime_context().get_node_id(),
                      node_ip=info["node_ip"], worker_pid=os.getpid(), ray_version=ray.__version__,
                      launcher=self.settings.launcher, trial_wall_s=outcome.wall_s)
        store.write_record(record)
        return {**tune_metrics(record), "done": True}

    def cleanup(self) -> None:
        if self._launcher is not None:
            self._launcher.close()
