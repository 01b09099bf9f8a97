"""run_trial: one cell on one device, returning one flat record. Failures are data, not exceptions.

What the trial measures is its workload (``trials/workloads``): training steps or inference.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from typing import Any

import torch

from .parallel import ranks as distributed
from .measure import memory, memory_plan
from . import models
from .backends import te_compat
from .backends.capability import Capability, probe, resolve, wants_torchao
from .measure.fingerprint import fingerprint
from .measure.metrics import flops_per_step
from .models.minigpt_net import matmul_param_count
from .record.fields import empty_record
from .spec import TrialSpec
from .workloads.teacher_forced import Partners
from .workloads import runner

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "can't allocate memory", "not enough memory", "cannot allocate memory")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def run_trial(spec: TrialSpec, capability: Capability | None = None, process_trial_index: int = 0,
              partners: Partners | None = None) -> dict[str, Any]:
    """Run ``spec`` and return its record; never raises for a failing trial (see ``status``).

    ``process_trial_index`` says how many trials this process ran before (0: a fresh process). ``partners``:
    what a process running trials one after another keeps of the BF16 partners its FP8 cells trained
    (trials/workloads/teacher_forced.py), so that cells sharing one train it once; None: each trains its own.
    """
    t0 = time.perf_counter()
    record = empty_record()
    record.update(spec.to_dict())
    record.update(started_at=_now(), pid=os.getpid(), status="error", process_trial_index=process_trial_index)
    device = "cpu"
    baseline = None
    try:
        # TE's process-wide FP8 state (every delayed-scaling module ever run, reduced at each autocast exit) left by
        # whatever ran TE in this process before: a plain loop, a user's script (benchmarks/te_state_carryover.py)
        te_compat.reset_te_state()
        distributed.select_device(spec.world_size, spec.parallel)
        cap = capability or probe(spec.device, want_te=spec.backend in ("te", "auto"), want_torchao=wants_torchao(spec))
        record.update(gpu_name=cap.gpu_name, compute_capability=cap.compute_capability,
                      sm_count=cap.sm_count, gpu_total_memory_bytes=cap.total_memory_bytes)
        res = resolve(spec, cap)
        device = res.device
        record.update(fingerprint(device))
        record["te_version"] = cap.te_version or record["te_version"]
        facts = models.describe(spec)  # the model's class, resolved config and size (trials/models)
        cfg = facts.analytic  # MiniGPT's ModelConfig where the closed forms apply, else None (FLOPs are counted)
        record.update(effective_device=device, **facts.record())
        # the shape fields the model has, read back from what was built (a type may name or derive them its own way)
        record.update({name: value for name, value in facts.shape.items() if value is not None or record[name] is None})
        if cfg is not None:
            record["n_matmul_params"] = matmul_param_count(cfg)
        if spec.workload == "train":  # the global batch: every rank's micro-batches
            tokens = spec.tokens
            record["tokens_per_step"] = tokens
            if cfg is not None:
                record.update(flops_per_step=flops_per_step(cfg, tokens), flops_method="analytic")
            record.update(memory_plan.record_fields(spec))
        if res.unsupported:
            record.update(status="unsupported", error=res.unsupported)
            log.info("unsupported: %s", res.unsupported)
        else:
            record.update(effective_backend=res.backend, effective_precision=res.precision,
                          effective_recipe=res.recipe)
            baseline = memory.reset(device)
            with distributed.session(spec.world_size, spec.parallel, device) as ranks:
                numerics = runner(spec.workload)(spec, res, cfg, record, t0, ranks)
            if numerics is not None:  # a second model (the BF16 partner) trains: after the cell's own peaks
                record.update(memory.snapshot(baseline, record))
                baseline = None
                memory.release(device)
                record.update(numerics(partners))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record
        status = ("oom" if is_oom(exc) else "unsupported" if isinstance(exc, distributed.Unsupported) else
                  "timeout" if spec.world_size > 1 and distributed.timed_out(exc) else "error")
        record.update(status=status, error=f"{type(exc).__name__}: {exc}"[:4000],
                      error_type=type(exc).__name__)
        log.warning("trial %s: %s", record["status"], record["error"].splitlines()[0], exc_info=log.isEnabledFor(logging.DEBUG))
    finally:
        if baseline is not None:
            record.update(memory.snapshot(baseline, record))
        te_compat.reset_te_state()  # a process may run more trials: leave nothing of this one behind
        memory.release(device)
        record.update(finished_at=_now(), duration_s=time.perf_counter() - t0)
    return record
