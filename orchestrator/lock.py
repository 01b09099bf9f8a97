"""One driver per sweep directory.

Two ``juicytalk sweep`` runs on the same directory would both run every pending cell (each cell
twice, two trials per GPU, every timing wrong). The driver holds an exclusive ``flock`` on
``<storage>/.<sweep>.lock`` for its whole run, and writes who it is into the file. The kernel drops
the lock when the driver dies, however it dies, so a lock left by a killed driver is recognised as
stale and taken over; a live one refuses the second driver at once. The lock sits beside the sweep
directory, not in it, so ``--restart`` can move the directory aside while holding it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .store import Store, utc_stamp

log = logging.getLogger(__name__)


class SweepLocked(RuntimeError):
    """Another driver runs this sweep now."""


def lock_path(store: Store) -> Path:
    root = Path(store.root)
    return root.parent / f".{root.name}.lock"


@contextmanager
def sweep_lock(store: Store) -> Iterator[None]:
    if not store.local:
        log.warning("storage %s is not a local path: this sweep cannot be locked against a second driver",
                    store.storage)
        yield
        return
    path = lock_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise SweepLocked(
                f"sweep directory {store.root} is in use by another juicytalk sweep (host {holder.get('host', '?')}, "
                f"pid {holder.get('pid', '?')}, started {holder.get('started_at', '?')}); wait for it or stop it"
            ) from None
        stale = _holder(fd)
        if stale:
            log.warning("took over the lock of a driver that is gone (host %s, pid %s, started %s)",
                        stale.get("host"), stale.get("pid"), stale.get("started_at"))
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started_at": utc_stamp()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        os.fsync(fd)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # an empty lock file is a clean release, not a stale lock
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
