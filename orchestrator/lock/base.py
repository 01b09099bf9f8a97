"""What every scheme's sweep lock shares: where it sits, how a refusal reads, the lease its holder watches, and the
seam of the object-store locks (:class:`Slot`): one object, read with its version, and written only where it is
(still) the version read, so that of two drivers writing at once exactly one succeeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..store import Store


class SweepLocked(RuntimeError):
    """Another driver runs this sweep now."""


class LockUnavailable(SweepLocked):
    """The sweep's storage offers no conditional write to lock it with (or not here: a package is missing)."""


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


def in_use(store: Store, holder: dict) -> SweepLocked:
    return SweepLocked(
        f"sweep directory {store.url()} is in use by another juicytalk sweep (host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')}, started {holder.get('started_at', '?')}); wait for it or stop it")


@dataclass(frozen=True)
class Held:
    """The lock object as read: its bytes, and the version a conditional write names (S3's ETag, GCS's
    generation)."""
    data: bytes
    version: str


class Slot(Protocol):
    """One object store's lock object, written only conditionally. Every method raises OSError (one line) where the
    store does not answer: an outage is no answer, never "absent" or "changed"."""

    def read(self) -> Held | None:
        """The object and its version; None where there is none."""

    def create(self, data: bytes) -> str | None:
        """Write the object where there is none: its version, or None where one exists (another driver's)."""

    def replace(self, data: bytes, version: str) -> str | None:
        """Overwrite the object where it is still ``version``: its new version, or None where it changed or went."""

    def delete(self, version: str) -> bool:
        """Delete the object where it is still ``version``: whether it did (False: it changed or went)."""
