"""The launch-bound rule: did a GPU step idle waiting on the host? (trials/measure/bench.py says how each input
is measured.) Torch-free, so the report judges stored records by the same rule (orchestrator/report/analysis.py)."""

from __future__ import annotations

import math

LAUNCH_BOUND_GAP_SHARE = 0.2
"""A step is launch-bound when the GPU idled at least this share of it: ``kernel_gap_ms >= 0.2 * step_ms_p50``.

The profiler's gap (the timed step less the time at least one of its kernels ran: kernels on overlapping streams,
a DDP/FSDP all-reduce beside the compute, count once; trials/measure/kernels.py) is the GPU waiting on the host,
measured directly. 20% sits between the two groups a real H200 run of an 8B Llama (32 layers) gave: the GPU-bound
steps idled 2-8% (TE BF16 swap 12.9 of 206.5 ms, TE BF16 transformer_layer 15.6 of 197.1, torch BF16 8.9
of 223.7, torch BF16 compiled with full checkpointing 12.2 of 519.0), the FP8 steps the host held back
idled 25-33% (TE FP8 delayed transformer_layer 46.6 of 188.8, swap 78.6 of 238.7). The host-issue rule
(:data:`LAUNCH_BOUND_RATIO`) called TE BF16 swap and the compiled torch step launch-bound there: their
issue times (167.7 and 430.3 ms) held back-pressure from a full launch queue, not launch overhead."""
LAUNCH_BOUND_RATIO = 0.8
"""Fallback without a profile: host issue time >= 80% of the step's GPU time -> the GPU waits on the host
(large steps over-call it: see :data:`LAUNCH_BOUND_GAP_SHARE`)."""


def launch_bound(step_ms_p50: float, host_ms_per_step: float | None,
                 kernel_gap_ms: float | None = None) -> tuple[bool | None, str | None]:
    """(launch_bound, launch_bound_by) of a step: did the GPU idle waiting on the host?

    ``kernel_gap_ms`` known (a GPU step profiled): the gap is >= :data:`LAUNCH_BOUND_GAP_SHARE` of the step,
    by ``"kernel_gap"``. Else the host issue time is >= :data:`LAUNCH_BOUND_RATIO` of it, by ``"host_issue"``.
    ``host_ms_per_step`` None (CPU: issuing a step is running it): (None, None), whatever the gap (on CPU it is
    host time outside aten operators, never GPU idle)."""
    if host_ms_per_step is None:
        return None, None
    if kernel_gap_ms is not None and math.isfinite(kernel_gap_ms):
        return bool(kernel_gap_ms >= LAUNCH_BOUND_GAP_SHARE * step_ms_p50), "kernel_gap"
    return bool(host_ms_per_step >= LAUNCH_BOUND_RATIO * step_ms_p50), "host_issue"
