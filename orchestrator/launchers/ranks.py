"""Multi-rank trials: a Ray Train worker group inside the Tune trial, one rank per worker.

A cell with ``world_size > 1`` is still one Tune trial; the trial itself holds no GPU and runs a
``TorchTrainer`` with ``ScalingConfig(num_workers=world_size, use_gpu=...)`` (the Ray 2.x pattern of
a Train driver inside a Tune trial), so the ranks can sit on several nodes of the cluster and Tune,
through Ray, accounts for every GPU they hold. Ray Train makes the process group (NCCL on GPUs, gloo
on CPU) and sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK); each worker then runs the
ordinary trial (``trials.run_trial``), whose rank seam (``trials/distributed.py``) finds the group
made. Rank 0's record comes back as the run's checkpoint (a directory with one JSON file, on the
sweep's storage). A rank that dies fails the run
(no restarts: a rank that died once would die again), which becomes an ``error`` record; a rank that
hangs makes the others' collectives time out (``trials.distributed.COLLECTIVE_TIMEOUT_S``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from .base import Outcome, failure_record

log = logging.getLogger(__name__)

RANKS_DRIVER_CPU = 0.01  # what the Tune trial of a multi-rank cell holds itself (Ray needs some resource)


RECORD = "record.json"


def _rank_main(config: dict[str, Any]) -> None:
    """One rank: the trial; rank 0 hands its record back as the run's checkpoint (Ray Train V2 keeps
    metrics only with a checkpoint), the others report that they finished."""
    import os
    import tempfile

    os.environ.update(config["env"])
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import ray.train

    from trials import TrialSpec, run_trial
    from trials.distributed import Ranks

    record = run_trial(TrialSpec.from_dict(config["spec"]))
    if not Ranks.from_env().lead:
        ray.train.report({"status": record["status"]})
        return
    with tempfile.TemporaryDirectory() as out:
        with open(os.path.join(out, RECORD), "w") as f:
            json.dump(record, f, allow_nan=True)
        ray.train.report({"status": record["status"]}, checkpoint=ray.train.Checkpoint.from_directory(out))


def run_ranks(spec: dict[str, Any], env: dict[str, str], use_gpu: bool, cpu_per_rank: float, storage_path: str,
              name: str) -> Outcome:
    """Run ``spec`` on ``spec['world_size']`` Ray Train workers; rank 0's record, or why there is none."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trials.distributed import COLLECTIVE_TIMEOUT_S

    t0 = time.perf_counter()
    world = int(spec["world_size"])
    per_rank = {"CPU": cpu_per_rank, **({"GPU": 1} if use_gpu else {})}
    trainer = TorchTrainer(
        _rank_main,
        train_loop_config={"spec": spec, "env": env},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=COLLECTIVE_TIMEOUT_S),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=use_gpu, resources_per_worker=per_rank),
        run_config=RunConfig(name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=0)),
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - TrainingFailedError and whatever a worker group raises
        why = f"a rank failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("multi-rank trial %s: %s", name, why)
        return Outcome(failure_record(spec, "error", why[:4000]), why, time.perf_counter() - t0)
    if result.checkpoint is None:
        return Outcome(None, "", time.perf_counter() - t0, "the ranks reported no record")
    with result.checkpoint.as_directory() as got:
        with open(f"{got}/{RECORD}") as f:
            record = json.load(f)
    return Outcome(record, f"{world} ranks through Ray Train; logs in Ray's session directory",
                   time.perf_counter() - t0)
