"""Where and with what a trial ran: host, GPU, driver and library versions, code revision."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from . import nvml, te_compat


def juicytalk_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("juicytalk")
    except Exception:  # noqa: BLE001 - running from a source tree without installing
        return None


def git_revision(path: str | Path) -> str | None:
    """HEAD of the git tree holding ``path``, with ``-dirty`` when tracked files differ from it.

    A benchmark number is only as reproducible as the code that made it: an edited tree must not
    pass for the commit it started from.
    """
    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=5,
                                  check=False)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status is None or status.returncode != 0 or bool(status.stdout.strip())
    return head.stdout.strip() + ("-dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    """Revision of the source tree this code was imported from (absolute path: Ray workers move cwd)."""
    return git_revision(Path(__file__).resolve().parent)


def fingerprint(device: str) -> dict[str, str | None]:
    cuda = device == "cuda"
    return {
        "hostname": socket.gethostname(),
        "driver_version": nvml.driver_version() if cuda else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "torch_version": torch.__version__,
        "te_version": te_compat.te_version(),
        "python_version": platform.python_version(),
        "juicytalk_version": juicytalk_version(),
        "git_sha": git_sha(),
        "compile_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }
