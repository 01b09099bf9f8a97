"""The steadiness rule: did a cell's timed steps agree with each other? Torch-free, so that the sweep's summary
(orchestrator/progress.py) and the report's sanity checks (orchestrator/report/render.py) judge stored records by
the same rule without loading torch."""

from __future__ import annotations

UNSTEADY_SPREAD = 0.10
"""A GPU cell's timed steps are unsteady when their standard deviation is over this share of their median. The
full-depth TE swap FP8 cell (Llama-3-8B shape, 32 layers) ran its ten steps in 203-316 ms on an H200 (sd 16% of
the median), and its plain loop read 212-269 ms from run to run on an H100: a launch-bound step follows the host's
pace, which drifts. The other nine cells of that study were under 10%."""


def unsteady_spread(step_ms_std: float | None, step_ms_p50: float | None, timer: str | None) -> float | None:
    """sd / median of a GPU cell's timed steps where it is over :data:`UNSTEADY_SPREAD`, else None. A median of
    steps that spread so moves by about as much from one run to the next. CPU cells (``perf_counter``) are not
    judged: their steps are all host work."""
    if timer != "cuda_event" or not step_ms_std or not step_ms_p50:
        return None
    spread = step_ms_std / step_ms_p50
    return spread if spread > UNSTEADY_SPREAD else None
