"""Step timing: device time per step from CUDA events, host issue time from a separate probe.

Each timed step is bracketed by two CUDA events recorded on the stream; the host never syncs
inside a timed block, so the numbers are what the GPU timeline shows (idle gaps included when the
host cannot launch fast enough). The block of ``bench_steps`` steps is repeated ``repeats`` times.

Launch-boundness (``launch_bound``, decided by :func:`trials.measure.launch.launch_bound`): the GPU idled at least 20% of
the step waiting on the host. Where the kernel breakdown ran (``profile: true``, trials/measure/kernels.py)
that is read off the profiler directly: ``kernel_gap_ms`` (the step less its kernels' time) >= 20% of
the step (``launch_bound_by: kernel_gap``). Without a profile the fallback is the host issue time of one
step, measured separately from an idle GPU (sync, then time the Python call that enqueues the step):
issuing it takes >= 80% of the step's GPU time (``launch_bound_by: host_issue``). That fallback
over-calls large steps: once the CUDA launch queue fills, the host waits on the GPU inside the call, so
its issue time includes back-pressure (an 8B Llama's TE BF16 step issued in 168 ms of its 207 ms while
the GPU ran kernels 94% of it). On CPU everything is synchronous; the host clock times the step and
launch_bound is not defined (null, and ``launch_bound_by`` null).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .disturbance import Disturbance, watch
from .gc_pauses import GcPauses

HOST_PROBE_STEPS = 10  # untimed steps that measure the host's issue time (CUDA only: on CPU a step is synchronous)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BenchResult:
    step_ms: list[float]  # every timed step, repeat after repeat
    repeat_medians_ms: list[float]
    host_ms_per_step: float | None  # None on CPU, where issuing a step is running it
    last_loss: float
    timer: str  # "cuda_event" or "perf_counter"
    disturbance: Disturbance  # what else ran during the timed blocks
    gc: GcPauses  # Python's garbage collections during the timed blocks


def benchmark(step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]], device: str,
              warmup_steps: int, bench_steps: int, repeats: int) -> BenchResult:
    """Warm up, probe the host issue time, then time ``repeats`` blocks of ``bench_steps`` steps."""
    cuda = device == "cuda"
    loss = None
    for i in range(warmup_steps):
        loss = step(*batches[i % len(batches)])
    host_ms = _host_issue_ms(step, batches) if cuda else None
    all_ms: list[float] = []
    medians: list[float] = []
    with watch(device) as seen, GcPauses() as collected:  # what else ran meanwhile, and the collector
        for _ in range(repeats):
            ms, loss = (_timed_block_cuda if cuda else _timed_block_cpu)(step, batches, bench_steps)
            all_ms.extend(ms)
            medians.append(statistics.median(ms))
    last_loss = float(loss.item()) if loss is not None else float("nan")
    return BenchResult(
        step_ms=all_ms,
        repeat_medians_ms=medians,
        host_ms_per_step=host_ms,
        last_loss=last_loss,
        timer="cuda_event" if cuda else "perf_counter",
        disturbance=seen,
        gc=collected,
    )


def _host_issue_ms(step: Step, batches: list) -> float:
    samples = []
    for i in range(HOST_PROBE_STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        samples.append((time.perf_counter() - t0) * 1000.0)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _timed_block_cuda(step: Step, batches: list, n: int) -> tuple[list[float], torch.Tensor]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    loss = None
    for i in range(n):
        starts[i].record()
        loss = step(*batches[i % len(batches)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)], loss


def _timed_block_cpu(step: Step, batches: list, n: int) -> tuple[list[float], torch.Tensor]:
    out = []
    loss = None
    for i in range(n):
        t0 = time.perf_counter()
        loss = step(*batches[i % len(batches)])
        out.append((time.perf_counter() - t0) * 1000.0)
    return out, loss
