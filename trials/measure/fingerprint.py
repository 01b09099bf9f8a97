"""Where and with what a trial ran: host, GPU, driver and library versions, code revision."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from . import nvml
from ..backends import te_compat


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # trials/ (absolute: Ray workers move cwd); this is trials/measure/


@functools.lru_cache(maxsize=1)
def juicytalk_version() -> str | None:
    """The installed package's version, else, run from a source tree on PYTHONPATH (as on the GPU hosts, where
    no record named its version before), the version the tree's pyproject.toml declares."""
    try:
        from importlib.metadata import version

        return version("juicytalk")
    except Exception:  # noqa: BLE001 - running from a source tree without installing
        return declared_version(PACKAGE_DIR.parent)


def declared_version(root: Path) -> str | None:
    """The version JuicyTalk's pyproject.toml under ``root`` declares; None where there is none (or another's)."""
    import tomllib

    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    except (OSError, KeyError, ValueError):
        return None
    return project.get("version") if project.get("name") == "juicytalk" else None


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


SOURCE_PACKAGES = ("trials", "orchestrator")  # JuicyTalk's own code, beside each other under one root


def source_hash(root: Path) -> str:
    """sha256 (12 hex digits) of JuicyTalk's Python sources under ``root``: their paths and contents."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def source_identity(package_dir: str | Path) -> str:
    """What code ran: the git revision of the checkout ``package_dir`` (``trials/``) belongs to, only when
    that checkout is JuicyTalk's own (its top level is the package's parent); else, run from an unpacked
    archive or a site-packages install that may sit inside some other repository, the package version plus
    a hash of its sources (``0.3.0+src.1a2b3c4d5e6f``), never the enclosing repository's sha."""
    package_dir = Path(package_dir).resolve()
    root = package_dir.parent
    try:
        top = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=5, check=False)
        own = top.returncode == 0 and Path(top.stdout.strip()).resolve() == root
    except (OSError, subprocess.SubprocessError):
        own = False
    revision = git_revision(root) if own else None
    return revision or f"{juicytalk_version() or 'unversioned'}+src.{source_hash(root)}"


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    """Source identity of the code this was imported from. (Given this module's own folder, trials/measure/,
    it hashed no file: every record from its move (b0f18bb) to this fix says ``...+src.e3b0c44298fc``, sha256 of
    nothing, in place of the commit.)"""
    return source_identity(PACKAGE_DIR)


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
