"""What a step costs in energy, and the clock and power cap it ran under.

NVML's board energy counter updates every 20-100 ms, far too coarse for one step, so the energy
window is a run of its own right after timing: the same step repeated for at least
:data:`MIN_WINDOW_S`. The window opens on a tick of the counter (poll until it moves, then start) and
closes on the first tick after the device is synced, so what the window reads is what its steps
drew plus at most one tick of idle tail. A thread samples the SM clock, power draw and clock-event
reasons while the steps run. Energy is board-wide: another process on the GPU during the window
is recorded (``energy_gpu_shared``), never subtracted.

A trial of several ranks runs the window on every rank at once (the same steps: each holds the slowest-rank
timing the window's length comes from): each reads its own board, and the step's energy is their sum
(:meth:`Energy.fields`), over the global batch's tokens; power and clocks are rank 0's board.

On CPU, and where NVML or its energy counter is missing, every field is null and ``energy_why``
says why; on a GPU the window's steps run all the same (:func:`measure`: a rank's peers wait on them).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import nvml

log = logging.getLogger(__name__)

MIN_WINDOW_S = 1.0  # the counter's 20-100 ms ticks are then a few percent of the window at most
SAMPLE_EVERY_S = 0.02
TICK_WAIT_S = 0.25  # longest wait for the counter to move at an edge of the window


@dataclass
class Energy:
    why: str | None = None
    window_s: float | None = None
    calls: int | None = None
    joules: float | None = None
    power_limit_w: float | None = None
    sm_clock_max_mhz: int | None = None
    clocks: list[int] = field(default_factory=list)
    power_mw: list[int] = field(default_factory=list)
    reasons: int = 0
    shared: bool | None = None

    def fields(self, tokens_per_call: int, boards: Sequence[float | None] | None = None) -> dict[str, Any]:
        """The record's energy fields. ``tokens_per_call``: what one call of the window's step produced, all ranks
        together (a training step's global batch). ``boards``: the joules each rank's board drew over the window
        (rank 0's, this one, first; every rank runs the window's ``calls`` steps at once), whose sum is the step's
        energy; None: this board alone (one GPU). A rank whose board was not read leaves the step's energy, and
        so tokens per joule, unknown. Power and clocks are this board's (rank 0's: the record kept)."""
        if self.why is not None or not self.joules or not self.calls:
            return {"energy_why": self.why or "the energy counter did not move"}
        boards = [self.joules] if boards is None else list(boards)
        unread = [rank for rank, joules in enumerate(boards) if not joules]
        per_call = None if unread else sum(boards) / self.calls  # type: ignore[arg-type] - all read
        return {
            "energy_window_s": self.window_s, "energy_window_calls": self.calls, "energy_j_per_step": per_call,
            "tokens_per_j": tokens_per_call / per_call if per_call else None,
            "power_mean_w": self.joules / self.window_s,
            "power_max_w": max(self.power_mw) / 1000.0 if self.power_mw else None,
            "sm_clock_mean_mhz": statistics.fmean(self.clocks) if self.clocks else None,
            "sm_clock_min_mhz": min(self.clocks) if self.clocks else None,
            "sm_clock_max_mhz": self.sm_clock_max_mhz, "power_limit_w": self.power_limit_w,
            "clock_limits": ",".join(nvml.clock_event_names(self.reasons)), "energy_gpu_shared": self.shared,
            "energy_why": (f"the energy counter of rank {', '.join(map(str, unread))} was not read: the step's "
                           "energy is every rank's board") if unread else None,
        }

    def drawn(self) -> float | None:
        """The joules this board drew over the window, None where it was not read (for the other ranks' sum)."""
        return self.joules if self.why is None and self.joules else None


def calls_for(ms_per_call: float, min_s: float = MIN_WINDOW_S) -> int:
    """How many calls of ``ms_per_call`` fill a window of ``min_s`` (10% over, so a fast start still fills it)."""
    return max(1, math.ceil(1.1 * min_s * 1000.0 / max(ms_per_call, 1e-3)))


def measure(run: Callable[[], Any], calls: int, device: str) -> Energy:
    """Energy of ``calls`` calls of ``run`` on the current CUDA device, and the clocks they ran at.

    On a GPU the ``calls`` run whether or not the board can be read: the ranks of a multi-rank trial run the window
    together, and a rank that skipped its steps (its NVML or counter failing alone) would leave the others waiting
    in their collectives; the model after the window is then the same too. Only the reading is skipped, and
    ``why`` says why. CPU trials (every rank on CPU alike) run no window."""
    if device != "cuda":
        return Energy(why="CPU trial: NVML measures GPU boards only")
    import torch

    with nvml.session() as nv:
        if nv is None:
            return _unread(run, calls, "NVML unavailable (no NVIDIA driver here)")
        torch.cuda.synchronize()
        try:
            handle = nvml.torch_device_handle(nv)
            limit, top = nvml.limits(nv, handle)
            e0, t0 = _tick(nv, handle)
        except Exception as exc:  # noqa: BLE001 - a GPU without an energy counter, MIG, old drivers
            return _unread(run, calls, f"NVML: {type(exc).__name__}: {exc}")
        out = Energy(power_limit_w=limit, sm_clock_max_mhz=top, calls=calls)
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(nv, handle, out, stop), daemon=True)
        sampler.start()
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        try:
            e1, t1 = _tick(nv, handle)
        except Exception as exc:  # noqa: BLE001 - the steps ran: the reading alone is lost
            out.why = f"NVML: {type(exc).__name__}: {exc}"
            return out
        finally:
            stop.set()
            sampler.join()
        out.window_s, out.joules = t1 - t0, (e1 - e0) / 1000.0
        me = os.getpid()
        try:
            out.shared = any(pid != me for pid, _ in nvml.compute_processes(nv, handle))
        except Exception as exc:  # noqa: BLE001 - a container may not list processes: unknown, not a failure
            log.debug("NVML processes: %s", exc)
    return out


def _unread(run: Callable[[], Any], calls: int, why: str) -> Energy:
    """The window's ``calls`` run without a reading (see :func:`measure`)."""
    for _ in range(calls):
        run()
    return Energy(why=why)


def _tick(nv: Any, handle: Any) -> tuple[int, float]:
    """Wait for the energy counter to move; its new value and the time it was seen."""
    first = nvml.energy_mj(nv, handle)
    deadline = time.perf_counter() + TICK_WAIT_S
    while True:
        now, value = time.perf_counter(), nvml.energy_mj(nv, handle)
        if value != first or now > deadline:
            return value, now
        time.sleep(0.001)


def _sample(nv: Any, handle: Any, out: Energy, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            clock, power, reasons = nvml.clock_sample(nv, handle)
        except Exception as exc:  # noqa: BLE001 - keep the window's energy even if sampling fails
            log.debug("NVML sample: %s", exc)
            return
        out.clocks.append(clock)
        out.power_mw.append(power)
        out.reasons |= reasons
        stop.wait(SAMPLE_EVERY_S)
