"""The Parquet store: one file per trial, written atomically, one explicit schema for all of them.

Layout under ``<storage>/<sweep name>/``:

    trials/<cell_id>-s<sample>.parquet    one record (the flat trial record + where it ran)
    series/<cell_id>-s<sample>.parquet    per-step series: loss (training) and step_ms (timed steps)
    running/<cell_id>-s<sample>.json      marker while a trial runs (pids, node, start time)
    logs/<cell_id>-s<sample>.log          the trial process's output
    quarantine/                           record files that could not be read (moved aside, cell rerun)
    results.parquet                       all records, consolidated (``juicytalk collect``)
    sweep.yaml                            the sweep file as run

Every file is written to a dot-prefixed temporary name, fsynced and renamed into place, so a reader
never sees half a file and a crash leaves at most an ignored temporary. A record's file name is its
(cell, sample) key, so a retried or resumed trial replaces its record: never two for one key.
pyarrow takes a dataset's schema from its first file and silently drops later columns; every read
and write here passes the one explicit :data:`RECORD_SCHEMA` instead.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trials.record.atomic import temporary_name, write_atomic
from trials.record.fields import ALL_FIELDS, FINAL_STATUSES, SCHEMA_VERSION, validate

log = logging.getLogger(__name__)

_ARROW = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
    "bool": pa.bool_(),
    "list[float]": pa.list_(pa.float64()),
    "list[int]": pa.list_(pa.int64()),
}

RECORD_SCHEMA = pa.schema(
    [pa.field(f.name, _ARROW[f.type]) for f in ALL_FIELDS],
    metadata={b"schema_version": str(SCHEMA_VERSION).encode(), b"producer": b"juicytalk"},
)
SERIES_SCHEMA = pa.schema([
    ("sweep_name", pa.string()), ("cell_id", pa.string()), ("sample", pa.int64()),
    ("series", pa.string()), ("step", pa.int64()), ("value", pa.float64()),
])


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class StorageFull(Exception):
    """The store's filesystem has no room left: a retry cannot help, so the sweep stops (and resumes later)."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.path = path


def is_full(exc: BaseException) -> bool:
    """An OSError of a full disk or quota, from the OS or from pyarrow (which keeps the errno)."""
    return isinstance(exc, OSError) and (exc.errno in FULL_ERRNOS or "No space left on device" in str(exc))


def utc_stamp(t: float | None = None) -> str:
    """UTC time as the store writes it (``recorded_at``, ``run_started_at``): ISO-8601, seconds, Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def is_uri(where: str) -> bool:
    """An object store's or filesystem's URI (s3://, gs://, file://), not a local path."""
    return "://" in where


# schemes whose filesystem pyarrow opens by asking the network (S3: the bucket's region), so only their shape is
# checked before a sweep starts
_NETWORK_SCHEMES = ("s3",)


def storage_problem(where: str) -> str | None:
    """Why ``where`` (a sweep's storage, ``--out``, a sweep directory given to a command) names no storage pyarrow
    opens, in one line; None for a local path or a URI it takes. Checked before anything reads or writes there:
    pyarrow's own refusal comes later, as a traceback."""
    if not is_uri(where):
        return None
    scheme, _, rest = where.partition("://")
    location = rest.partition("?")[0]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return f"{where!r} has no scheme before '://'; give a local path or a URI such as s3://bucket/prefix"
    if not location.strip("/") or (scheme in _NETWORK_SCHEMES and location.startswith("/")):
        return f"{where!r} names no bucket or path after '{scheme}://' (e.g. {scheme}://bucket/prefix)"
    if scheme in _NETWORK_SCHEMES:
        return None
    try:
        pafs.FileSystem.from_uri(where)
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"{where!r} is no storage pyarrow opens: {detail}"
    return None


# how to make a bucket, per pyarrow filesystem that has them: pyarrow makes a prefix, never a bucket
MAKE_BUCKET = {"s3": "aws s3 mb s3://{}", "gcs": "gcloud storage buckets create gs://{}"}


def missing_bucket(where: str) -> str | None:
    """The one line saying that the bucket of ``where`` (object storage, ``s3://bucket/prefix``) does not exist, else
    None (a local path, a bucket that is there, or a store that cannot be asked: its own failure comes later).
    Asked, over the network, before Ray starts: the sweep's first write into a missing bucket was a traceback."""
    if not is_uri(where):
        return None
    bucket = where.partition("://")[2].partition("?")[0].split("/")[0]
    try:
        fs, _ = pafs.FileSystem.from_uri(where)  # S3 without an endpoint asks the bucket's region here
        if fs.type_name not in MAKE_BUCKET:
            return None
        if fs.get_file_info(bucket).type != pafs.FileType.NotFound:
            return None
        make = MAKE_BUCKET[fs.type_name].format(bucket)
    except OSError as exc:  # pyarrow's region lookup: "Bucket 'x' not found"; any other failure is not this one
        if f"Bucket '{bucket}' not found" not in str(exc):
            return None
        make = MAKE_BUCKET["s3"].format(bucket)
    return f"bucket {bucket!r} does not exist; create it first ({make}) or name an existing bucket"


def trial_key(cell_id: str, sample: int) -> str:
    return f"{cell_id}-s{sample}"


def commit(fs: pafs.FileSystem, final: str, write) -> None:
    """``write(path)`` a file that appears at ``final`` whole or not at all: locally fsynced and renamed
    (``trials.record.atomic``), elsewhere written beside it and moved; a full disk is :class:`StorageFull`."""
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            write_atomic(final, write)
            return
        tmp = temporary_name(final)
        write(tmp)
        fs.move(tmp, final)
    except OSError as exc:
        if is_full(exc):
            raise StorageFull(final, "no space left on device") from None
        raise


class Store:
    """Files of one sweep under ``root`` (a local directory or a pyarrow filesystem URI)."""

    def __init__(self, storage: str, sweep_name: str):
        self.storage = storage
        self.sweep_name = sweep_name
        if is_uri(storage):
            self.fs, base = pafs.FileSystem.from_uri(storage)
            self.local = isinstance(self.fs, pafs.LocalFileSystem)
        else:
            self.fs, base, self.local = pafs.LocalFileSystem(), str(Path(storage).expanduser().resolve()), True
        self.root = f"{base.rstrip('/')}/{sweep_name}"

    @classmethod
    def at(cls, where: str) -> "Store":
        """The store of one sweep directory given whole: a local path or a URI (``s3://bucket/prefix/<sweep>``,
        a query such as ``?endpoint_override=...`` kept for the storage)."""
        head, _, query = where.partition("?")
        if not is_uri(head):
            p = Path(head).expanduser().resolve()
            return cls(str(p.parent), p.name)
        parent, _, name = head.rstrip("/").rpartition("/")
        return cls(parent + (f"?{query}" if query else ""), name)

    # -- paths ----------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path in the store's filesystem (for an object store: bucket/key, without the scheme)."""
        return "/".join((self.root,) + parts)

    def url(self, *parts: str) -> str:
        """A path as the user names it: local, or a URI with the storage's scheme and query (what to print,
        and what Ray Tune's ``storage_path`` takes)."""
        if self.local:
            return self.path(*parts)
        scheme, _, rest = self.storage.partition("://")
        query = rest.partition("?")[2]
        return f"{scheme}://{self.path(*parts)}" + (f"?{query}" if query else "")

    def exists(self, *parts: str) -> bool:
        try:
            return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound
        except OSError:
            return False

    def read_text(self, *parts: str) -> str | None:
        """A text file of the store, or None where there is none."""
        return self.read_at(self.path(*parts))

    def read_at(self, path: str) -> str | None:
        """A text file at a path of the store's filesystem (beside the store too: its lock), or None (absent, or
        the store could not answer)."""
        try:
            return self.read_strict(path)
        except OSError:
            return None

    def read_strict(self, path: str) -> str | None:
        """:meth:`read_at`, but an outage raises OSError: None means the file is not there (the lock's heartbeat
        tells "taken over" from "no answer")."""
        try:
            with self.fs.open_input_stream(path) as fh:
                return fh.read().decode()
        except FileNotFoundError:
            return None

    def ensure(self) -> None:
        for sub in ("trials", "series", "running", "logs"):
            self.fs.create_dir(self.path(sub), recursive=True)

    # -- atomic writes --------------------------------------------------------------------------
    def _write_table(self, final: str, table: pa.Table) -> None:
        commit(self.fs, final, lambda p: pq.write_table(table, p, filesystem=self.fs))

    def write_text(self, final: str, text: str) -> None:
        def write(p: str) -> None:
            with self.fs.open_output_stream(p) as out:
                out.write(text.encode())
        commit(self.fs, final, write)

    def write_record(self, record: dict[str, Any]) -> str:
        """Validate (an undeclared key or a wrong type is an error naming the field) and write atomically."""
        validate(record)
        row = {name: record.get(name) for name in RECORD_SCHEMA.names}
        row["sweep_name"] = self.sweep_name
        row["recorded_at"] = utc_stamp()
        table = pa.Table.from_pylist([row], schema=RECORD_SCHEMA)
        final = self.path("trials", trial_key(row["cell_id"], row["sample"]) + ".parquet")
        self._write_series(record)  # first: a record on disk always has its series
        self._write_table(final, table)
        return final

    def _write_series(self, record: dict[str, Any]) -> None:
        rows = []
        for series, key in (("loss", "loss_curve"), ("step_ms", "step_times_ms")):
            for i, value in enumerate(record.get(key) or []):
                rows.append({"sweep_name": self.sweep_name, "cell_id": record["cell_id"],
                             "sample": record["sample"], "series": series, "step": i, "value": value})
        table = pa.Table.from_pylist(rows, schema=SERIES_SCHEMA)
        self._write_table(self.path("series", trial_key(record["cell_id"], record["sample"]) + ".parquet"), table)

    # -- running markers ------------------------------------------------------------------------
    def mark_running(self, key: str, info: dict[str, Any]) -> None:
        self.write_text(self.path("running", key + ".json"), json.dumps(info))

    def clear_running(self, key: str) -> None:
        try:
            self.fs.delete_file(self.path("running", key + ".json"))
        except (FileNotFoundError, OSError):
            pass

    def running(self) -> dict[str, dict[str, Any]]:
        out = {}
        for info in self._list("running", ".json"):
            try:
                with self.fs.open_input_stream(info.path) as fh:
                    out[info.base_name[:-5]] = json.loads(fh.read().decode())
            except (OSError, ValueError):
                continue  # a marker being replaced right now
        return out

    # -- reads ----------------------------------------------------------------------------------
    def _list(self, sub: str, suffix: str) -> list[pafs.FileInfo]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(sub), allow_not_found=True))
        except (FileNotFoundError, OSError):
            return []
        return [i for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(suffix)
                and not i.base_name.startswith(".")]

    def record_files(self) -> list[str]:
        return sorted(i.path for i in self._list("trials", ".parquet"))

    def read_records(self, columns: Iterable[str] | None = None, quarantine: bool = True) -> pa.Table:
        """Every record; a record file that cannot be read is quarantined (and its cell runs again), or, by a reader
        that holds no lock on the sweep (``quarantine=False``: a plan, a dry run), left where it is and skipped."""
        columns = list(columns) if columns else None
        while True:  # each failed read quarantines at least one file, finds the files changed, or raises
            files = self.record_files()
            if not files:
                return RECORD_SCHEMA.empty_table() if columns is None else RECORD_SCHEMA.empty_table().select(columns)
            try:
                return ds.dataset(files, schema=RECORD_SCHEMA, format="parquet",
                                  filesystem=self.fs).to_table(columns=columns)
            except (pa.ArrowException, OSError) as exc:
                if not quarantine:
                    return self._readable(files, columns)
                # a file listed and gone since: another reader quarantined it (two drivers starting at once)
                if not self._quarantine_unreadable(files) and self.record_files() == files:
                    raise exc

    def read_record(self, key: str, columns: Iterable[str] | None = None) -> dict[str, Any] | None:
        """The record of one (cell, sample) key, or None when there is none (or it is unreadable)."""
        try:
            table = pq.read_table(self.path("trials", key + ".parquet"), schema=RECORD_SCHEMA,
                                  columns=list(columns) if columns else None, filesystem=self.fs)
        except (FileNotFoundError, pa.ArrowException, OSError):
            return None
        rows = table.to_pylist()
        return rows[0] if rows else None

    def _readable(self, files: list[str], columns: list[str] | None) -> pa.Table:
        """The records of those of ``files`` that can be read, one by one."""
        tables = []
        for path in files:
            try:
                tables.append(pq.read_table(path, schema=RECORD_SCHEMA, columns=columns, filesystem=self.fs))
            except (pa.ArrowException, OSError):
                continue
        empty = RECORD_SCHEMA.empty_table() if columns is None else RECORD_SCHEMA.empty_table().select(columns)
        return pa.concat_tables([empty, *tables])

    def _quarantine_unreadable(self, files: list[str]) -> int:
        """Move record files that are not readable Parquet of our schema to ``quarantine/``."""
        moved = 0
        for path in files:
            try:
                pq.read_table(path, schema=RECORD_SCHEMA, filesystem=self.fs)
                continue
            except FileNotFoundError:
                continue  # replaced or quarantined by someone else meanwhile
            except (pa.ArrowException, OSError) as exc:
                reason = str(exc).splitlines()[0][:200]
            name = path.rsplit("/", 1)[1]
            dest = self.path("quarantine", f"{name}.{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:4]}")
            try:
                self.fs.create_dir(self.path("quarantine"), recursive=True)
                self.fs.move(path, dest)
            except (FileNotFoundError, OSError):
                continue
            log.warning("unreadable record file %s (%s): moved to %s; its trial runs again", path, reason, dest)
            moved += 1
        return moved

    def statuses(self, quarantine: bool = True) -> dict[str, str]:
        """(cell, sample) key -> status of its record (``quarantine``: as :meth:`read_records`)."""
        table = self.read_records(["cell_id", "sample", "status"], quarantine)
        return {trial_key(c, s): st for c, s, st in zip(*(table.column(n).to_pylist()
                                                       for n in ("cell_id", "sample", "status")))}

    def final_keys(self) -> set[str]:
        return {k for k, st in self.statuses().items() if st in FINAL_STATUSES}

    def read_series(self) -> pa.Table:
        files = sorted(i.path for i in self._list("series", ".parquet"))
        if not files:
            return SERIES_SCHEMA.empty_table()
        return ds.dataset(files, schema=SERIES_SCHEMA, format="parquet", filesystem=self.fs).to_table()

    def collect(self) -> tuple[str, int]:
        """Consolidate every record into ``results.parquet`` (atomically); returns (path, rows)."""
        table = self.read_records()
        if table.num_rows:
            table = table.sort_by([("cell_label", "ascending"), ("cell_id", "ascending"), ("sample", "ascending")])
        self._write_table(self.path("results.parquet"), table)
        return self.url("results.parquet"), table.num_rows

    def remove_temporaries(self) -> int:
        """Delete temporaries a crash left behind (dot-prefixed ``.tmp`` files)."""
        removed = 0
        for sub in ("trials", "series", "running", ""):
            try:
                infos = self.fs.get_file_info(pafs.FileSelector(self.path(sub) if sub else self.root,
                                                                allow_not_found=True))
            except (FileNotFoundError, OSError):
                continue
            for info in infos:
                if info.type == pafs.FileType.File and info.base_name.startswith(".") and info.base_name.endswith(".tmp"):
                    self.fs.delete_file(info.path)
                    removed += 1
        return removed


def read_results(path: str) -> pa.Table:
    """Records from a sweep directory (its trial files) or from a results.parquet file, local or a URI."""
    if is_uri(path):
        store = Store.at(path)
        if store.exists("trials"):
            return store.read_records()
        if store.exists("results.parquet"):
            return pq.read_table(store.path("results.parquet"), schema=RECORD_SCHEMA, filesystem=store.fs)
        if store.exists() and path.partition("?")[0].endswith(".parquet"):
            return pq.read_table(store.path(), schema=RECORD_SCHEMA, filesystem=store.fs)
        raise FileNotFoundError(f"{path}: no trials/ or results.parquet here")
    p = Path(path)
    if p.is_dir():
        if (p / "trials").is_dir():
            return Store(str(p.parent), p.name).read_records()
        if (p / "results.parquet").is_file():
            return pq.read_table(p / "results.parquet", schema=RECORD_SCHEMA)
        raise FileNotFoundError(f"{path}: no trials/ or results.parquet here")
    return pq.read_table(p, schema=RECORD_SCHEMA)
