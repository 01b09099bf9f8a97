"""run_trial: one cell on one device, returning one flat record. Failures are data, not exceptions."""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import datetime, timezone
from typing import Any

import torch

from . import memory, te_compat
from .bench import benchmark
from .capability import Capability, Resolution, probe, resolve
from .data import ArithmeticSequences
from .fingerprint import fingerprint
from .generation import generation_check
from .metrics import flops_per_step, step_stats, throughput
from .model import ModelConfig, matmul_param_count, param_count
from .record import empty_record
from .spec import TrialSpec
from .train import build_train_step, fp8_state, train

log = logging.getLogger(__name__)

BENCH_BATCHES = 4  # distinct pre-made batches cycled through the timed steps
_OOM_MARKERS = ("out of memory", "can't allocate memory", "not enough memory", "cannot allocate memory")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def run_trial(spec: TrialSpec, capability: Capability | None = None, process_trial_index: int = 0) -> dict[str, Any]:
    """Run ``spec`` and return its record; never raises for a failing trial (see ``status``).

    ``process_trial_index`` says how many trials this process ran before (0: a fresh process).
    """
    t0 = time.perf_counter()
    record = empty_record()
    record.update(spec.to_dict())
    record.update(started_at=_now(), pid=os.getpid(), status="error", process_trial_index=process_trial_index)
    device = "cpu"
    baseline = None
    try:
        cap = capability or probe(spec.device, want_te=spec.backend != "torch")
        record.update(gpu_name=cap.gpu_name, compute_capability=cap.compute_capability,
                      sm_count=cap.sm_count, gpu_total_memory_bytes=cap.total_memory_bytes)
        res = resolve(spec, cap)
        device = res.device
        record.update(fingerprint(device))
        record["te_version"] = cap.te_version or record["te_version"]
        cfg = ModelConfig.from_spec(spec)
        record.update(effective_device=device, n_params=param_count(cfg),
                      n_matmul_params=matmul_param_count(cfg), tokens_per_step=spec.tokens,
                      flops_per_step=flops_per_step(cfg, spec.tokens))
        if res.unsupported:
            record.update(status="unsupported", error=res.unsupported)
            log.info("unsupported: %s", res.unsupported)
        else:
            record.update(effective_backend=res.backend, effective_precision=res.precision,
                          effective_recipe=res.recipe)
            baseline = memory.reset(device)
            _execute(spec, res, cfg, record, t0)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record
        record.update(status="oom" if is_oom(exc) else "error", error=f"{type(exc).__name__}: {exc}"[:4000],
                      error_type=type(exc).__name__)
        log.warning("trial %s: %s", record["status"], record["error"].splitlines()[0], exc_info=log.isEnabledFor(logging.DEBUG))
    finally:
        if baseline is not None:
            record.update(memory.snapshot(baseline))
        te_compat.reset_te_state()  # a process may run more trials: leave nothing of this one behind
        memory.release(device)
        record.update(finished_at=_now(), duration_s=time.perf_counter() - t0)
    return record


def _execute(spec: TrialSpec, res: Resolution, cfg: ModelConfig, record: dict[str, Any], t0: float) -> None:
    """Build, train, benchmark and check one model; fills ``record`` in place."""
    t_setup = time.perf_counter()
    step = build_train_step(spec, res.backend, res.precision, res.device)
    model, te, recipe = step.model, step.te, step.recipe
    if te is not None:
        record["te_torch_compile"] = te_compat.te_torch_compile()
    if recipe is not None:
        record["fp8_recipe_repr"] = repr(recipe)
    data = ArithmeticSequences(spec.vocab, spec.seq_len, res.device, spec.seed)
    if spec.cuda_graphs:
        step.capture(data.batch(spec.batch_size)[0])
    record["setup_s"] = time.perf_counter() - t_setup

    t_train = time.perf_counter()
    record["startup_s"] = t_train - t0
    trained = train(step, data, spec.train_steps, spec.batch_size)
    losses = trained.losses
    record.update(train_s=time.perf_counter() - t_train, first_step_s=trained.first_step_s, loss_first=losses[0],
                  loss_final=losses[-1], loss_curve=losses)
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        record.update(status="diverged", error=f"non-finite training loss at step {bad}")
        return
    if recipe is not None and spec.recipe == "delayed":
        record["fp8_state"] = fp8_state(model)

    t_bench = time.perf_counter()
    batches = [data.batch(spec.batch_size) for _ in range(BENCH_BATCHES)]
    result = benchmark(step, batches, res.device, spec.warmup_steps, spec.bench_steps, spec.repeats)
    record["bench_s"] = time.perf_counter() - t_bench
    stats = step_stats(result.step_ms)
    record.update(stats)
    record.update(throughput(cfg, spec.tokens, stats["step_ms_mean"], record["gpu_name"], res.precision))
    record.update(timer=result.timer, step_times_ms=result.step_ms, repeat_medians_ms=result.repeat_medians_ms,
                  host_ms_per_step=result.host_ms_per_step, launch_bound=result.launch_bound,
                  bench_loss_final=result.last_loss)
    if not math.isfinite(result.last_loss):
        record.update(status="diverged", error="non-finite loss during the benchmark")
        return

    t_gen = time.perf_counter()
    gen = generation_check(model, spec.prompt_len, spec.gen_len, spec.seed + 1, te, recipe)
    record.update(gen_s=time.perf_counter() - t_gen, gen_tokens=gen.tokens,
                  gen_stride_accuracy=gen.stride_accuracy, status="ok", error=None)
