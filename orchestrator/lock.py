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
time, overwrote it, and the first sees that; one that checks after sees a live lock and stops). A driver that
could not refresh its lock for longer than :data:`LEASE_S` (a write outage) may find it taken over when the store
answers again: each heartbeat reads the lock back first, and one that is no longer this driver's is never
rewritten; the :class:`Lease` says so, the runner stops its trials and the sweep ends in one line
(:class:`SweepLocked`), leaving the lock to its new holder.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .store import Store, utc_stamp

LEASE_S = 60.0  # an object-store lock not refreshed for this long is a gone driver's
HEARTBEAT_S = 10.0
SETTLE_S = 1.0  # between writing the lock object and reading it back

log = logging.getLogger(__name__)


class SweepLocked(RuntimeError):
    """Another driver runs this sweep now."""


@dataclass
class Lease:
    """The sweep lock as its holder sees it while it runs: ``lost`` says why it is this driver's no more (another
    driver took an object-store lock over), None while it holds. A local flock is never lost."""
    lost: str | None = None

    def check(self) -> None:
        """Raise :class:`SweepLocked` (its one line) once the lock is lost."""
        if self.lost:
            raise SweepLocked(self.lost)


def lock_path(store: Store) -> str:
    """``<storage>/.<sweep>.lock``: beside the sweep directory, in the store's filesystem (local or an object)."""
    parent, _, name = store.root.rpartition("/")
    return f"{parent}/.{name}.lock"


def _in_use(store: Store, holder: dict) -> SweepLocked:
    return SweepLocked(
        f"sweep directory {store.url()} is in use by another juicytalk sweep (host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')}, started {holder.get('started_at', '?')}); wait for it or stop it")


@contextmanager
def sweep_lock(store: Store) -> Iterator[Lease]:
    if not store.local:
        with _object_lock(store) as lease:
            yield lease
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


def _read_object(store: Store, path: str) -> dict:
    try:
        return _holder_now(store, path)
    except OSError:
        return {}


def _holder_now(store: Store, path: str) -> dict:
    """The lock object's holder, {} where there is none; raises OSError where the store cannot answer (an outage
    is no answer: the next heartbeat asks again)."""
    data = store.read_strict(path)
    try:
        return json.loads(data) if data and data.strip() else {}
    except ValueError:
        return {}


def _ours(store: Store, path: str, token: str, lease: Lease) -> bool:
    """Whether the lock object is still this driver's (``token``); where not, ``lease`` says why, logged once.
    Raises OSError where the store cannot answer."""
    holder = _holder_now(store, path)
    if holder.get("token") == token:
        return True
    if holder:
        who = (f"another driver took it over (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
               f"started {holder.get('started_at', '?')}), seeing no heartbeat of this one for {LEASE_S:g} s")
    else:
        who = "its lock object is gone (deleted, or taken over by another driver that has ended)"
    lease.lost = (f"sweep lock lost: {store.url()}: {who}; this driver stops here so that two drivers do not run "
                  "the same cells at once")
    log.error("%s", lease.lost)
    return False


def _write_object(store: Store, path: str, holder: dict) -> None:
    with store.fs.open_output_stream(path) as out:
        out.write(json.dumps({**holder, "heartbeat": time.time()}).encode())


@contextmanager
def _object_lock(store: Store) -> Iterator[Lease]:
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
    stop, lease = threading.Event(), Lease()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                if not _ours(store, path, me["token"], lease):  # never rewrite a lock taken over meanwhile
                    return
                _write_object(store, path, me)
            except OSError as exc:  # the next beat tries again; LEASE_S allows several misses
                log.warning("could not refresh the sweep lock %s: %s", path, exc)

    thread = threading.Thread(target=beat, name="juicytalk-sweep-lock", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join()
        try:  # a clean release, no lock object left: where it is still this driver's
            if not lease.lost and _ours(store, path, me["token"], lease):
                store.fs.delete_file(path)
        except OSError:  # the store does not answer: the lease runs out on its own
            pass
    lease.check()  # lost while the sweep ended: it still ends in that one line
