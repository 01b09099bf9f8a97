"""One driver per sweep directory.

Two ``juicytalk sweep`` runs on the same directory would both run every pending cell (each cell twice, two trials
per GPU, every timing wrong). The driver holds the sweep's lock, ``<storage>/.<sweep>.lock``, for its whole run: a
second driver is refused in one line before Ray or any trial starts, and a lock left by a driver that is gone is
taken over. The lock sits beside the sweep directory, not in it, so ``--restart`` can move the directory aside while
holding it. Each scheme takes it with its own atomic step, chosen by :func:`sweep_lock` alone: a local or mounted
path with ``flock`` (:mod:`.local`), S3 with conditional writes (:mod:`.s3`, behind :mod:`.heartbeat`'s heartbeat).

Other object stores are refused: GCS has the conditional writes too (generation preconditions), but no GCS server
runs here to test a lock on them, and a lock that two drivers can both hold is what this package exists to prevent.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import pyarrow.fs as pafs

from ..store import Store, is_uri
from . import heartbeat, local
from .base import Lease, LockUnavailable, SweepLocked, lock_path
from .heartbeat import HEARTBEAT_S, LEASE_S
from .s3 import S3Slot

SLOTS = {"s3": S3Slot}  # object-store schemes whose lock this package takes, each with its conditional writes


def lock_problem(storage: str) -> str | None:
    """Why a sweep on ``storage`` (a sweep's ``storage`` or ``--out``, a valid one) cannot be locked against a second
    driver, in one line; None where it can. Asks no network: the CLI checks it before anything reads the store."""
    scheme = storage.partition("://")[0].lower() if is_uri(storage) else ""
    if not scheme or scheme in SLOTS or isinstance(pafs.FileSystem.from_uri(storage)[0], pafs.LocalFileSystem):
        return None
    return (f"{storage}: a sweep runs on a local or mounted path or on {' or '.join(f'{s}://' for s in SLOTS)}, where "
            f"juicytalk locks it against a second driver; it has no such lock for {scheme}:// (juicytalk report and "
            "collect read a sweep there)")


def sweep_lock(store: Store) -> AbstractContextManager[Lease]:
    """The sweep's lock, held while the ``with`` block runs; raises :class:`SweepLocked` (one line) where another
    driver holds it or the storage cannot be locked (:func:`lock_problem`)."""
    if store.local:
        return local.hold(store)
    if why := lock_problem(store.storage):
        raise LockUnavailable(f"storage {why}")
    return heartbeat.hold(store, SLOTS[store.storage.partition("://")[0].lower()](store))


__all__ = ["HEARTBEAT_S", "LEASE_S", "Lease", "LockUnavailable", "SweepLocked", "lock_path", "lock_problem",
           "sweep_lock"]
