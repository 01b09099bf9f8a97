"""NVML in one place: a session that is None (never a crash) where NVML or its driver is missing.

JuicyTalk asks NVML about the GPUs a trial ran on: memory charged to a process, other processes on
the device, the driver version. ``nvidia-ml-py`` (imported as ``pynvml``) is the package the GPU
hosts carry; on CPU machines it imports but ``nvmlInit`` fails, and every answer here is None.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def session() -> Iterator[Any]:
    """``pynvml`` initialised for the block, or None where NVML cannot start here."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - missing library, no driver, a container without devices
        log.debug("NVML unavailable: %s", exc)
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def handle(nv: Any, token: str) -> Any:
    """A device handle from a CUDA_VISIBLE_DEVICES token: an index or a GPU-/MIG- UUID."""
    token = token.strip()
    if token.startswith(("GPU-", "MIG-")):
        return nv.nvmlDeviceGetHandleByUUID(token)
    return nv.nvmlDeviceGetHandleByIndex(int(token))


def torch_device_handle(nv: Any) -> Any:
    """The handle of torch's current CUDA device (found by UUID: CUDA_VISIBLE_DEVICES remaps indices)."""
    import torch

    index = torch.cuda.current_device()
    try:
        return nv.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
    except Exception:  # noqa: BLE001 - older drivers, MIG
        return nv.nvmlDeviceGetHandleByIndex(index)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version() -> str | None:
    with session() as nv:
        if nv is None:
            return None
        try:
            return _text(nv.nvmlSystemGetDriverVersion())
        except Exception as exc:  # noqa: BLE001
            log.debug("NVML driver version: %s", exc)
            return None


def compute_processes(nv: Any, device: Any) -> list[tuple[int, int | None]]:
    """(pid, bytes used) of every compute process on ``device``."""
    return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in nv.nvmlDeviceGetComputeRunningProcesses(device)]


def power_and_clocks(index: int = 0) -> dict[str, Any]:
    """The power limit in force and the SM clock (now and its maximum) of GPU ``index``; ``why`` says why
    they are missing where NVML cannot tell (no GPU, no driver). A number without its cap and clock
    cannot be compared with anyone else's: a power-capped H200 runs a long BF16 GEMM loop well below
    its maximum clock."""
    out: dict[str, Any] = {"power_limit_w": None, "sm_clock_mhz": None, "sm_clock_max_mhz": None, "why": None}
    with session() as nv:
        if nv is None:
            out["why"] = "NVML unavailable (no NVIDIA driver here)"
            return out
        try:
            device = nv.nvmlDeviceGetHandleByIndex(index)
            out.update(power_limit_w=nv.nvmlDeviceGetEnforcedPowerLimit(device) / 1000.0,
                       sm_clock_mhz=int(nv.nvmlDeviceGetClockInfo(device, nv.NVML_CLOCK_SM)),
                       sm_clock_max_mhz=int(nv.nvmlDeviceGetMaxClockInfo(device, nv.NVML_CLOCK_SM)))
        except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver, container and MIG mode
            out["why"] = f"NVML: {type(exc).__name__}: {exc}"
    return out
