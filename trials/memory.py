"""Peak device memory, three ways: torch's allocator (allocated, reserved) and NVML (the process).

The allocator numbers say what the model needed; NVML sees what the driver charged this process
(CUDA context and library workspaces included), which is what decides an OOM on a shared GPU.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def nvml_process_bytes() -> int | None:
    """Device memory NVML charges to this process on the current GPU, or None where NVML can't tell."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = _nvml_handle(pynvml)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver and container
        log.debug("NVML process memory unavailable: %s", exc)
    return None


def _nvml_handle(pynvml):
    """NVML handle of torch's current device (CUDA_VISIBLE_DEVICES maps indices; UUIDs don't lie)."""
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except Exception:  # noqa: BLE001
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def snapshot(device: str) -> dict[str, int | None]:
    """Peaks since the last :func:`reset` plus allocator OOM counters."""
    if device != "cuda":
        return {"peak_mem_allocated_bytes": None, "peak_mem_reserved_bytes": None,
                "nvml_process_mem_bytes": None, "num_ooms": None, "num_alloc_retries": None}
    stats = torch.cuda.memory_stats()
    return {
        "peak_mem_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_mem_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        "nvml_process_mem_bytes": nvml_process_bytes(),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def release(device: str) -> None:
    """Hand cached device memory back so the next trial in this process starts clean."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
