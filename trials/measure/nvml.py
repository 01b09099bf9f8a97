"""NVML in one place: a session that is None (never a crash) where NVML or its driver is missing.

JuicyTalk asks NVML about the GPUs a trial ran on: memory charged to a process, other processes on
the device, the driver version, the energy counter, power draw, clocks and why they are held down. ``nvidia-ml-py`` (imported as ``pynvml``) is the package the GPU
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
            limit, top = limits(nv, device)
            out.update(power_limit_w=limit, sm_clock_mhz=clock_sample(nv, device)[0], sm_clock_max_mhz=top)
        except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver, container and MIG mode
            out["why"] = f"NVML: {type(exc).__name__}: {exc}"
    return out


# Clock-event reasons (NVML's bitmask) -> (name, group). The groups are what the record reports:
# "power" (a power cap or brake), "thermal", and "other" (sync boost, application clocks, ...).
# GPU idle is left out: every window's edges see it.
CLOCK_EVENTS: tuple[tuple[int, str, str], ...] = (
    (0x2, "applications_clocks", "other"),
    (0x4, "sw_power_cap", "power"),
    (0x8, "hw_slowdown", "other"),
    (0x10, "sync_boost", "other"),
    (0x20, "sw_thermal", "thermal"),
    (0x40, "hw_thermal", "thermal"),
    (0x80, "hw_power_brake", "power"),
    (0x100, "display_clocks", "other"),
)


def clock_event_names(mask: int) -> list[str]:
    """The clock-event reasons set in ``mask``, as ``group:name`` (e.g. ``power:sw_power_cap``)."""
    return [f"{group}:{name}" for bit, name, group in CLOCK_EVENTS if mask & bit]


def energy_mj(nv: Any, device: Any) -> int:
    """The board's energy counter since the driver loaded, mJ (updates every 20-100 ms)."""
    return int(nv.nvmlDeviceGetTotalEnergyConsumption(device))


def clock_sample(nv: Any, device: Any) -> tuple[int, int, int]:
    """(SM clock MHz, power draw mW, clock-event reason mask) now."""
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return (int(nv.nvmlDeviceGetClockInfo(device, nv.NVML_CLOCK_SM)), int(nv.nvmlDeviceGetPowerUsage(device)),
            int(reasons(device)))


def limits(nv: Any, device: Any) -> tuple[float, int]:
    """(power limit in force W, maximum SM clock MHz)."""
    return (nv.nvmlDeviceGetEnforcedPowerLimit(device) / 1000.0,
            int(nv.nvmlDeviceGetMaxClockInfo(device, nv.NVML_CLOCK_SM)))
