"""A sweep's lock on an object store, which has no flock: an object, ``<prefix>/.<sweep>.lock``, naming its driver
and a heartbeat the driver rewrites every :data:`HEARTBEAT_S`. A lock whose heartbeat is older than :data:`LEASE_S`
belongs to a driver that is gone and is taken over.

Every write is conditional (a :class:`~.base.Slot`): the lock is created only where there is none, and rewritten
(heartbeat, take-over) or deleted only where it is still the version this driver last read. Of two drivers that
start at once, or take over the same stale lock at once, exactly one write succeeds; the other driver reads the
winner's lock and is refused. A driver that could not refresh its lock for longer than :data:`LEASE_S` (a write
outage) may find it taken over when the store answers again: its heartbeat's write then fails, it never overwrites
the new holder's lock, and the :class:`~.base.Lease` says so; the runner stops its trials and the sweep ends in one
line (:class:`~.base.SweepLocked`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from ..store import Store, utc_stamp
from .base import Held, Lease, Slot, in_use

LEASE_S = 60.0  # an object-store lock not refreshed for this long is a gone driver's
HEARTBEAT_S = 10.0
TAKE_TRIES = 5  # each failed conditional write means another driver wrote first: the next read finds its lock

log = logging.getLogger(__name__)


def _holder(held: Held | None) -> dict:
    try:
        return json.loads(held.data) if held and held.data.strip() else {}
    except ValueError:
        return {}


def _body(me: dict) -> bytes:
    return json.dumps({**me, "heartbeat": time.time()}).encode()


def _take(store: Store, slot: Slot, me: dict) -> str:
    """The version of the lock object this driver now holds; raises :class:`SweepLocked` naming a live holder."""
    held = slot.read()
    for _ in range(TAKE_TRIES):
        holder = _holder(held)
        if held is None:
            version = slot.create(_body(me))
        elif holder.get("token") == me["token"]:
            return held.version  # this driver's own write, though its answer was lost (and the SDK retried it)
        else:
            age = time.time() - float(holder.get("heartbeat", 0))
            if age < LEASE_S:
                raise in_use(store, holder)
            version = slot.replace(_body(me), held.version)
            if version and holder:
                log.warning("took over the lock of a driver that is gone (host %s, pid %s, started %s; no heartbeat "
                            "for %.0f s)", holder.get("host"), holder.get("pid"), holder.get("started_at"), age)
        if version:
            return version
        log.debug("another driver wrote the sweep lock %s first", store.url())
        held = slot.read()
    raise in_use(store, _holder(held))


def _lose(store: Store, holder: dict, lease: Lease) -> None:
    if holder:
        who = (f"another driver took it over (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
               f"started {holder.get('started_at', '?')}), seeing no heartbeat of this one for {LEASE_S:g} s")
    else:
        who = "its lock object is gone (deleted, or taken over by another driver that has ended)"
    lease.lost = (f"sweep lock lost: {store.url()}: {who}; this driver stops here so that two drivers do not run "
                  "the same cells at once")
    log.error("%s", lease.lost)


def _renew(store: Store, slot: Slot, me: dict, version: str, lease: Lease) -> str | None:
    """One heartbeat: the lock object's new version, or None once it is this driver's no more (``lease`` says why).
    Raises OSError where the store does not answer (the next heartbeat tries again)."""
    new = slot.replace(_body(me), version)
    if new:
        return new
    held = slot.read()
    if _holder(held).get("token") == me["token"]:
        return held.version  # this driver's own write, though its answer was lost: the next heartbeat goes on from it
    _lose(store, _holder(held), lease)
    return None


@contextmanager
def hold(store: Store, slot: Slot) -> Iterator[Lease]:
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": utc_stamp(), "token": uuid.uuid4().hex}
    version = _take(store, slot, me)
    stop, lease = threading.Event(), Lease()

    def beat() -> None:
        nonlocal version
        while not stop.wait(HEARTBEAT_S):
            try:
                renewed = _renew(store, slot, me, version, lease)
            except OSError as exc:  # the next beat tries again; LEASE_S allows several misses
                log.warning("could not refresh the sweep lock %s: %s", store.url(), exc)
                continue
            if renewed is None:
                return
            version = renewed

    thread = threading.Thread(target=beat, name="juicytalk-sweep-lock", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join()
        try:  # a clean release, no lock object left: where it is still this driver's
            if not lease.lost and not slot.delete(version):
                held = slot.read()  # this driver's own last heartbeat, whose answer was lost, or another driver's
                if _holder(held).get("token") == me["token"]:
                    slot.delete(held.version)
        except OSError:  # the store does not answer: the lease runs out on its own
            pass
    lease.check()  # lost while the sweep ended: it still ends in that one line
