"""One driver per sweep directory.

Two ``juicytalk sweep`` runs on the same directory would both run every pending cell (each cell
twice, two trials per GPU, every timing wrong). The driver holds an exclusive ``flock`` on
``<storage>/.<sweep>.lock`` for its whole run, and writes who it is into the file. The kernel drops
the lock when the driver dies, however it dies, so a lock left by a killed driver is recognised as
stale and taken over; a live one refuses the second driver at once. The lock sits beside the sweep
directory, not in it, so ``--restart`` can move the directory aside while holding it.

An object store (``s3://``) has no flock: there the lock is an object, ``<prefix>/.<sweep>.lock``, holding
who took it and a heartbeat the driver rewrites every :data:`HEARTBEAT_S`. A lock whose heartbeat is older
than :data:`LEASE_S` belongs to a driver that is gone and is taken over. Two drivers starting at once both
write it; each reads it back after :data:`SETTLE_S` and only the one whose write is there runs (S3 reads are
strongly consistent after a write: a driver that checked before the other wrote, and wrote within the settle
time, overwrote it, and the first sees that; one that checks after sees a live lock and stops).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .store import Store, utc_stamp

LEASE_S = 60.0  # an object-store lock not refreshed for this long is a gone driver's
HEARTBEAT_S = 10.0
SETTLE_S = 1.0  # between writing the lock object and reading it back

log = logging.getLogger(__name__)


class SweepLocked(RuntimeError):
    """Another driver runs this sweep now."""


def lock_path(store: Store) -> str:
    """``<storage>/.<sweep>.lock``: beside the sweep directory, in the store's filesystem (local or an object)."""
    parent, _, name = store.root.rpartition("/")
    return f"{parent}/.{name}.lock"


def _in_use(store: Store, holder: dict) -> SweepLocked:
    return SweepLocked(
        f"sweep directory {store.url()} is in use by another juicytalk sweep (host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')}, started {holder.get('started_at', '?')}); wait for it or stop it")


@contextmanager
def sweep_lock(store: Store) -> Iterator[None]:
    if not store.local:
        with _object_lock(store):
            yield
        return
    path = Path(lock_path(store))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(store, _holder(fd)) from None
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


def _read_object(store: Store, path: str) -> dict:
    data = store.read_at(path) or ""
    try:
        return json.loads(data) if data.strip() else {}
    except ValueError:
        return {}


def _write_object(store: Store, path: str, holder: dict) -> None:
    with store.fs.open_output_stream(path) as out:
        out.write(json.dumps({**holder, "heartbeat": time.time()}).encode())


@contextmanager
def _object_lock(store: Store) -> Iterator[None]:
    """The lock as an object with a heartbeat (the module's doc says why it holds)."""
    path = lock_path(store)
    held = _read_object(store, path)
    if held and time.time() - float(held.get("heartbeat", 0)) < LEASE_S:
        raise _in_use(store, held)
    if held:
        log.warning("took over the lock of a driver that is gone (host %s, pid %s, started %s; no heartbeat for "
                    "%.0f s)", held.get("host"), held.get("pid"), held.get("started_at"),
                    time.time() - float(held.get("heartbeat", 0)))
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": utc_stamp(), "token": uuid.uuid4().hex}
    _write_object(store, path, me)
    time.sleep(SETTLE_S)
    now = _read_object(store, path)
    if now.get("token") != me["token"]:
        raise _in_use(store, now)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                _write_object(store, path, me)
            except OSError as exc:  # the next beat tries again; LEASE_S allows several misses
                log.warning("could not refresh the sweep lock %s: %s", path, exc)

    thread = threading.Thread(target=beat, name="juicytalk-sweep-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        try:
            store.fs.delete_file(path)  # a clean release: no lock object left
        except (FileNotFoundError, OSError):
            pass
