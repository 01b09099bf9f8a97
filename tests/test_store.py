"""The Parquet store: one explicit schema, atomic files, one record per key, readable everywhere."""

import re

import duckdb
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest

from orchestrator.store import RECORD_SCHEMA, Store
from trials.record.fields import empty_record


def _record(cell: str, sample: int, status: str = "ok", **extra):
    rec = empty_record()
    rec.update(cell_id=cell, cell_label=f"label-{cell}", sample=sample, status=status, d_model=64, **extra)
    return rec


def test_later_columns_are_not_dropped(tmp_path):
    store = Store(str(tmp_path), "s")
    store.ensure()
    store.write_record(_record("a", 0))  # all optional columns null
    store.write_record(_record("b", 0, loss_curve=[3.0, 2.0], gen_tokens=[1, 2, 3], step_ms_p50=1.5,
                               launch_bound=True))
    table = store.read_records()
    assert table.schema.equals(RECORD_SCHEMA, check_metadata=False)
    rows = {r["cell_id"]: r for r in table.to_pylist()}
    assert rows["b"]["loss_curve"] == [3.0, 2.0] and rows["b"]["gen_tokens"] == [1, 2, 3]
    assert rows["b"]["launch_bound"] is True and rows["a"]["loss_curve"] is None


def test_a_record_file_another_reader_quarantined_after_this_one_listed_it_is_read_past(tmp_path):
    """Two drivers started at once both read the store before one of them holds the lock (issue 54 item 10): one
    quarantines an unreadable record file that the other has just listed. The other reads on without it (it was
    a traceback: the vanished file failed the read, and nothing was left to quarantine)."""
    store = Store(str(tmp_path), "s")
    store.ensure()
    store.write_record(_record("a", 0))
    (tmp_path / "s" / "trials" / "b-s0.parquet").write_bytes(b"PAR1 cut short by a crash")
    listed = [store.record_files()]  # this reader's listing, then the other's read
    assert Store(str(tmp_path), "s").statuses() == {"a-s0": "ok"}
    store.record_files = lambda: listed.pop() if listed else Store.record_files(store)
    assert store.statuses() == {"a-s0": "ok"} and not listed
    assert [p.name.startswith("b-s0.parquet.") for p in (tmp_path / "s" / "quarantine").iterdir()] == [True]


def test_a_plan_reads_past_an_unreadable_record_and_leaves_it_to_the_locks_holder(tmp_path):
    """A plan (a dry run, the fit check before Ray) reads the store before any lock on it: an unreadable record file
    counts as not there and stays where it is; moving it aside is for the run that holds the lock (a driver about to
    be refused printed the quarantine warning before its one line)."""
    from orchestrator.plan import plan_rows
    from orchestrator.sweep import parse_sweep

    sweep = parse_sweep("name: s\ngrid: [{batch_size: [2, 4]}]\nfixed: {d_model: 16, n_layers: 1, device: cpu}\n",
                        source="s.yaml")
    store = Store(str(tmp_path), "s")
    store.ensure()
    kept, cut = (cell.cell_id for cell in sweep.cells)
    store.write_record(_record(kept, 0))
    (tmp_path / "s" / "trials" / f"{cut}-s0.parquet").write_bytes(b"PAR1 cut short by a crash")
    rows = {row["cell_id"]: row["records"] for row in plan_rows(sweep, store)}
    assert rows == {kept: ["ok"], cut: []} and not (tmp_path / "s" / "quarantine").exists()
    assert store.statuses() == {f"{kept}-s0": "ok"} and (tmp_path / "s" / "quarantine").exists()


def test_one_record_per_key_and_temporaries_ignored(tmp_path):
    store = Store(str(tmp_path), "s")
    store.ensure()
    store.write_record(_record("a", 0, status="error"))
    store.write_record(_record("a", 0, status="ok"))
    (tmp_path / "s" / "trials" / ".a-s1.parquet.dead.tmp").write_bytes(b"half a file")
    assert store.statuses() == {"a-s0": "ok"}
    assert store.final_keys() == {"a-s0"}
    assert store.remove_temporaries() == 1
    assert not list((tmp_path / "s" / "trials").glob(".*"))


def test_results_read_in_pandas_polars_duckdb(tmp_path):
    store = Store(str(tmp_path), "s")
    store.ensure()
    for i in range(3):
        store.write_record(_record(f"c{i}", 0, step_ms_p50=float(i + 1), loss_curve=[1.0, 0.5]))
    path, rows = store.collect()
    assert rows == 3 and pq.read_metadata(path).schema.to_arrow_schema().metadata[b"schema_version"] == b"1"
    assert pd.read_parquet(path)["step_ms_p50"].sum() == 6.0
    assert pl.read_parquet(path)["step_ms_p50"].sum() == 6.0
    assert duckdb.sql(f"select sum(step_ms_p50), count(*) from '{path}'").fetchall() == [(6.0, 3)]
    series = store.read_series().to_pandas()
    assert len(series) == 6 and set(series["series"]) == {"loss"}


def test_undeclared_fields_and_wrong_types_are_refused(tmp_path):
    from trials.record.fields import RecordError

    store = Store(str(tmp_path), "v")
    store.ensure()
    with pytest.raises(RecordError) as err:
        store.write_record(_record("a", 0, step_ms_p50_typo=1.0))
    assert err.value.field == "step_ms_p50_typo" and "not a declared record field" in str(err.value)
    with pytest.raises(RecordError) as err:
        store.write_record({**_record("a", 0), "d_model": "768"})
    assert err.value.field == "d_model" and "must be int" in str(err.value)
    with pytest.raises(RecordError):
        store.write_record(_record("a", 0, launch_bound=1))  # an int is not a bool
    assert store.record_files() == []  # nothing half-written
    store.write_record(_record("a", 0, step_ms_p50=3, loss_curve=[1.0, 2]))  # ints are fine as floats
    assert len(store.record_files()) == 1


def test_the_summary_prints_an_error_that_looks_like_console_markup(tmp_path):
    """gloo's errors start with a source path in brackets ("[/__w/pytorch/...]"), which rich reads as a
    closing tag: the sweep's summary once crashed on it after every trial had finished."""
    import pyarrow as pa
    from rich.console import Console

    from orchestrator.progress import summary_table
    from orchestrator.work import WorkItem
    from trials import TrialSpec

    item = WorkItem.of(TrialSpec(), 0)
    error = "RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection closed by peer [bold]"
    records = pa.Table.from_pylist([{"cell_id": item.cell_id, "sample": 0, "step_ms_p50": None, "error": error}])
    console = Console(record=True, width=300)
    console.print(summary_table([item], {item.key: "error"}, records))
    assert "[/__w/pytorch/third_party/gloo/pair.cc:553]" in console.export_text()


def test_the_summary_shows_an_inference_trials_decode_step_and_a_compiled_cells_eager_run(tmp_path):
    """An infer record has no training step: the summary's p50 column read '-' for every served cell on the H200.
    Read back as the sweep reads its records (cli.summary_records): that read named its columns by hand and left
    out the decode p50 and compiled_eager_why, so the CLI's summary still read '-' and never said 'ran eager'."""
    from rich.console import Console

    from orchestrator.cli import summary_records
    from orchestrator.progress import summary_table
    from orchestrator.work import WorkItem
    from trials import TrialSpec

    train, infer = WorkItem.of(TrialSpec(backend="torch", compile=True), 0), WorkItem.of(TrialSpec(workload="infer"), 0)
    store = Store(str(tmp_path), "s")
    store.ensure()
    store.write_record(_record(train.cell_id, 0, step_ms_p50=12.5, compiled_eager_why="ran eager code: 0 graphs"))
    store.write_record(_record(infer.cell_id, 0, decode_ms_per_token_p50=3.365))
    console = Console(record=True, width=300)
    console.print(summary_table([train, infer], {train.key: "ok", infer.key: "ok"}, summary_records(store)))
    text = console.export_text()
    rows = [[c.strip() for c in line.split("│")] for line in text.splitlines() if "-s0" in line]
    p50 = {row[5]: row[4] for row in rows}  # key -> p50 ms
    assert p50 == {train.key: "12.50", infer.key: "3.37/tok"}, rows
    assert "ran eager code: 0 graphs" in text


def test_the_summary_says_a_gpu_cell_whose_steps_spread_is_unsteady(tmp_path):
    """The full-depth TE swap FP8 cell's steps on an H200 (sd 16% of the median): the report flagged it, the sweep's
    summary said nothing; the same rule (trials/measure/steadiness.py) now says it in both. A CPU cell's
    host-clock steps are not judged."""
    from rich.console import Console

    from orchestrator.cli import summary_records
    from orchestrator.progress import summary_table
    from orchestrator.work import WorkItem
    from trials import TrialSpec
    from trials.measure.metrics import step_stats

    gpu, cpu = WorkItem.of(TrialSpec(backend="te", precision="fp8"), 0), WorkItem.of(TrialSpec(device="cpu"), 0)
    spread = step_stats([249.3, 297.1, 315.6, 239.9, 223.8, 203.2, 205.0, 226.3, 280.9, 237.5])
    store = Store(str(tmp_path), "s")
    store.ensure()
    store.write_record(_record(gpu.cell_id, 0, timer="cuda_event", **spread))
    store.write_record(_record(cpu.cell_id, 0, timer="perf_counter", **spread))
    console = Console(record=True, width=300)
    console.print(summary_table([gpu, cpu], {gpu.key: "ok", cpu.key: "ok"}, summary_records(store)))
    unsteady = [line for line in console.export_text().splitlines() if "unsteady steps" in line]
    assert len(unsteady) == 1 and gpu.key in unsteady[0] and "sd 16% of the median" in unsteady[0], unsteady


def test_the_summary_says_an_fp8_trial_that_ran_no_fp8_is_not_an_fp8_result():
    """hf:gpt2 on torchao converts nothing: its trial is ok, and its row says it ran BF16 (issue 44 item 1)."""
    import pyarrow as pa
    from rich.console import Console

    from orchestrator.progress import summary_table
    from orchestrator.work import WorkItem
    from trials import TrialSpec

    item = WorkItem.of(TrialSpec(model="hf:gpt2", backend="torchao", precision="fp8", recipe="tensorwise"), 0)
    records = pa.Table.from_pylist([{"cell_id": item.cell_id, "sample": 0, "step_ms_p50": 12.5, "error": None,
                                     "precision": "fp8", "effective_precision": "bf16", "fp8_flop_share": 0.0}])
    console = Console(record=True, width=300)
    console.print(summary_table([item], {item.key: "ok"}, records))
    assert "ran bf16, not an FP8 result: 0% of its FLOPs in FP8" in console.export_text()


def test_a_second_local_lock_on_a_sweep_is_refused_naming_the_holder(tmp_path):
    """The flock sits at lock_path, beside the sweep directory; a second taker is refused; release empties it."""
    import os
    from pathlib import Path

    from orchestrator.lock import SweepLocked, lock_path, sweep_lock

    store = Store(str(tmp_path), "s")
    assert lock_path(store) == f"{tmp_path.resolve()}/.s.lock"
    with sweep_lock(store):
        with pytest.raises(SweepLocked, match=f"pid {os.getpid()},"), sweep_lock(store):
            pass
    assert Path(lock_path(store)).read_text() == ""


def test_a_sweep_on_an_object_store_without_its_lock_is_refused_in_one_line(tmp_path, capsys):
    """Issue 54 item 10: a sweep is locked only where its storage offers an atomic step (flock, S3's conditional
    writes); on gs:// (untested here) it is refused in one line, exit 2, in the real sweep and its dry run before
    anything asks the store, never run under a lock that two drivers can both hold."""
    from orchestrator.cli import main
    from orchestrator.lock import SweepLocked, sweep_lock

    line = (r"gs://bucket/prefix: a sweep runs on a local or mounted path or on s3://, where juicytalk locks it against "
            r"a second driver; it has no such lock for gs:// \(juicytalk report and collect read a sweep there\)")
    with pytest.raises(SweepLocked, match=f"^storage {line}$"):
        with sweep_lock(Store("gs://bucket/prefix", "s")):
            pass
    (tmp_path / "s.yaml").write_text("name: s\ngrid: {precision: [fp32]}\nfixed: {device: cpu}\n")
    for dry in ([], ["--dry-run"]):
        assert main(["sweep", str(tmp_path / "s.yaml"), "--out", "gs://bucket/prefix", *dry]) == 2
        assert re.fullmatch(f"juicytalk: error: --out: {line}\n", capsys.readouterr().err)


@pytest.mark.parametrize("where,problem", [
    ("bogus://x", "bogus"), ("s3://", "bucket"), ("s3:///x", "bucket"), ("file://", "path"), ("file://x", "relative"),
    ("10://x", "scheme"),
    ("./results", None), ("s3://bucket/prefix", None), ("s3://bucket/p?endpoint_override=localhost:9000", None),
    ("gs://bucket", None), ("file:///tmp/x", None),
])
def test_a_storage_uri_is_checked_before_anything_reads_it(where, problem):
    """Checked by its shape alone: pyarrow asks the network for an S3 bucket's region when it opens one."""
    from orchestrator.store import storage_problem

    found = storage_problem(where)
    assert (found is None) if problem is None else (problem in found and "\n" not in found), found
