"""A sweep's lock on a local or mounted path: an exclusive ``flock`` on ``<storage>/.<sweep>.lock`` held for the
driver's whole run, with who it is written into the file. The kernel takes and drops the flock atomically and drops
it when the driver dies, however it dies, so a lock left by a killed driver is taken over at once (no heartbeat to
wait out, unlike an object store's) and a live one refuses a second driver."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..store import Store, utc_stamp
from .base import Lease, in_use, lock_path

log = logging.getLogger(__name__)


@contextmanager
def hold(store: Store) -> Iterator[Lease]:
    path = Path(lock_path(store))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use(store, _holder(fd)) from None
        stale = _holder(fd)
        if stale:
            log.warning("took over the lock of a driver that is gone (host %s, pid %s, started %s)",
                        stale.get("host"), stale.get("pid"), stale.get("started_at"))
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started_at": utc_stamp()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        os.fsync(fd)
        try:
            yield Lease()
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
