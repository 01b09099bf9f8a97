"""Where and with what a trial ran: host, GPU, driver and library versions, code revision."""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
from pathlib import Path

import torch

from . import te_compat


def juicytalk_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("juicytalk")
    except Exception:  # noqa: BLE001 - running from a source tree without installing
        return None


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    """Commit of the source tree this code was imported from (absolute path: Ray workers move cwd)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            value = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - no NVML, no driver
        return None


def fingerprint(device: str) -> dict[str, str | None]:
    cuda = device == "cuda"
    return {
        "hostname": socket.gethostname(),
        "driver_version": driver_version() if cuda else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "torch_version": torch.__version__,
        "te_version": te_compat.te_version(),
        "python_version": platform.python_version(),
        "juicytalk_version": juicytalk_version(),
        "git_sha": git_sha(),
    }
