"""Peak memory of one trial: torch's allocator (allocated, reserved), NVML (the process) and host RSS.

The allocator numbers say what the model needed; NVML sees what the driver charged this process
(CUDA context and library workspaces included), which is what decides an OOM on a shared GPU.
A process may run several trials (the warm launcher): :func:`reset` starts every counter afresh (the
peaks, and the OOM and retry counts, which torch accumulates over the process until they are reset on
their own) and :func:`release` hands back what the last trial left, so each trial's figures are its own.
The allocator keeps one high-water mark: a part of a trial that wants a peak of its own (the timed
decode) takes it through :func:`phase`, which keeps the trial's peak so far in the record for :func:`snapshot`.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from . import nvml

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Baseline:
    """Where a trial's memory counters started."""

    device: str
    allocated_bytes: int  # device memory still allocated at the start (0 in a fresh process)
    rss_reset: bool  # the host RSS high-water mark could be reset (else peak_rss_bytes stays unknown)


@dataclass(frozen=True)
class Peaks:
    """The allocator's high-water marks, bytes."""

    allocated: int
    reserved: int

    @classmethod
    def now(cls) -> "Peaks":
        """Since the allocator's last reset."""
        return cls(int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved()))

    @classmethod
    def of(cls, record: dict) -> "Peaks | None":
        """The trial's peaks so far that a :func:`phase` wrote into its record (None: no phase yet)."""
        if record.get(PEAK_FIELDS[0]) is None:
            return None
        return cls(*(int(record[f]) for f in PEAK_FIELDS))


PEAK_FIELDS = ("peak_mem_allocated_bytes", "peak_mem_reserved_bytes")  # Peaks' two, as the record names them


def over_both(earlier: Peaks | None, since: Peaks) -> Peaks:
    """The peaks over a whole trial: those kept before the allocator's last reset (None: no reset since the
    trial began) and those since."""
    if earlier is None:
        return since
    return Peaks(max(earlier.allocated, since.allocated), max(earlier.reserved, since.reserved))


def reset(device: str) -> Baseline:
    """Start this trial's peaks and counters."""
    rss_reset = _reset_peak_rss()
    allocated = 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()  # num_ooms, num_alloc_retries: an earlier trial's otherwise
        allocated = int(torch.cuda.memory_allocated())
    return Baseline(device, allocated, rss_reset)


@dataclass
class PhasePeak:
    """A phase's own peak allocated device memory, bytes: None until the phase ends, and on CPU."""

    allocated: int | None = None


@contextmanager
def phase(device: str, record: dict) -> Iterator[PhasePeak]:
    """Measure the peak of the code inside (the timed generations) without losing the trial's: the allocator
    keeps one high-water mark, so the trial's peaks so far go into ``record``'s peak fields before it is reset,
    and :func:`snapshot` (given the record) takes the larger of those and the allocator's."""
    out = PhasePeak()
    if device != "cuda":
        yield out
        return
    kept = over_both(Peaks.of(record), Peaks.now())
    record.update(zip(PEAK_FIELDS, (kept.allocated, kept.reserved)))
    torch.cuda.reset_peak_memory_stats()
    yield out
    out.allocated = int(torch.cuda.max_memory_allocated())


def _reset_peak_rss() -> bool:
    """Linux: set the process's resident high-water mark (VmHWM) back to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """VmHWM of this process since the last :func:`reset`, or None where Linux's /proc can't tell."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def nvml_process_bytes() -> int | None:
    """Device memory NVML charges to this process on the current GPU, or None where NVML can't tell."""
    with nvml.session() as nv:
        if nv is None:
            return None
        try:
            for pid, used in nvml.compute_processes(nv, nvml.torch_device_handle(nv)):
                if pid == os.getpid():
                    return used
        except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver and container
            log.debug("NVML process memory unavailable: %s", exc)
    return None


def snapshot(baseline: Baseline, record: dict) -> dict[str, int | None]:
    """Peaks and allocator OOM counters since :func:`reset`: the whole trial's, the peaks a :func:`phase` kept
    in ``record`` folded in."""
    host = {"peak_rss_bytes": peak_rss_bytes() if baseline.rss_reset else None,
            "mem_at_start_bytes": baseline.allocated_bytes}
    if baseline.device != "cuda":
        return {**dict.fromkeys(PEAK_FIELDS), "nvml_process_mem_bytes": None, "num_ooms": None, "num_alloc_retries": None, **host}
    stats = torch.cuda.memory_stats()
    peaks = over_both(Peaks.of(record), Peaks.now())
    return {
        **host,
        **dict(zip(PEAK_FIELDS, (peaks.allocated, peaks.reserved))),
        "nvml_process_mem_bytes": nvml_process_bytes(),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def graph_pools() -> tuple[int, int] | None:
    """(held, free): bytes the allocator holds in CUDA graphs' private memory pools (segments of a pool other than
    the default, (0, 0)), what captured graphs keep for their replays, and of those the bytes free to the allocator.
    Free ones were freed during the capture (what a graphed forward saved for its backward, temporaries) and are
    written again by every replay: torch's allocated counters never count them, while the pool keeps them from any
    other use. None where this torch's snapshot does not say which pool a segment is of."""
    segments = torch.cuda.memory_snapshot()
    if any("segment_pool_id" not in s for s in segments):
        return None
    pools = [s for s in segments if tuple(s["segment_pool_id"]) != (0, 0)]
    held = sum(int(s["total_size"]) for s in pools)
    return held, held - sum(int(s["allocated_size"]) for s in pools)


def release(device: str) -> None:
    """Hand cached memory back so the next trial in this process starts clean."""
    import ctypes
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # cuBLAS workspaces live in the allocator
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
    try:  # glibc keeps freed heap pages; give them back so the next trial's RSS peak is its own
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
