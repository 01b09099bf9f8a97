"""A run over three models (MiniGPT, hf:llama, a py: factory), as a new user's sweep has it (issue 44, items 9 and
11): which model each row of the bound table is, whole cell labels in the step breakdown, a crossover table without
None, the fastest cell of each model in the headline, and the sweep summary's reasons whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.report import build_report
from orchestrator.report.analysis import prepare
from orchestrator.report.charts import breakdown_chart
from orchestrator.report.analysis import TRAIN_STEP
from orchestrator.report.why import breakdown
from orchestrator.store import Store
from orchestrator.sweep import cell_id, distinct_labels
from trials import TrialSpec
from trials.measure.kernels import CLASSES
from trials.record.fields import empty_record

# model -> its BF16 step in ms; FP8 takes 0.7 of it (GEMMs halved, casts added), two samples 1% apart
MODELS = {"minigpt": 100.0, "hf:llama": 110.0, "py:/home/me/src/nanogpt/model.py:build": 90.0}
BF16 = dict(kernel_ms_gemm_bf16=60.0, kernel_ms_elementwise=20.0, kernel_ms_attention=15.0)
FP8 = dict(kernel_ms_gemm_bf16=1.0, kernel_ms_gemm_fp8=29.0, kernel_ms_fp8_cast=5.0, kernel_ms_elementwise=18.0,
           kernel_ms_attention=15.0)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    store = Store(str(tmp_path_factory.mktemp("three")), "three")
    store.ensure()
    specs = [TrialSpec(model=model, d_model=64, n_layers=2, n_heads=4, vocab=96, seq_len=32, batch_size=8,
                       backend=backend, precision=precision, recipe=recipe, device="cpu")
             for model in MODELS for backend, precision, recipe in (("torch", "bf16", "delayed"),
                                                                    ("torchao", "fp8", "tensorwise"))]
    for spec, label in zip(specs, distinct_labels(specs)):
        fp8 = spec.precision == "fp8"
        kernels = {f"kernel_ms_{c}": 0.0 for c in CLASSES} | (FP8 if fp8 else BF16)
        for s in range(2):
            ms = MODELS[spec.model] * (0.7 if fp8 else 1.0) * (1 + 0.01 * s)
            rec = empty_record()
            rec.update(spec.to_dict())
            rec.update(kernels, status="ok", effective_backend=spec.backend, effective_precision=spec.precision,
                       effective_recipe=spec.recipe if fp8 else None, cell_id=cell_id(spec), cell_label=label,
                       sample=s, n_params=100_000, step_ms_p50=ms, step_times_ms=[ms] * 4, loss_curve=[4.0, 2.0],
                       loss_final=2.0, kernel_ms_total=sum(kernels.values()), kernel_gap_ms=ms - sum(kernels.values()))
            store.write_record(rec)
    return store, build_report(store.root)


def _section(md: str, title: str) -> list[str]:
    return [line for line in md.split(f"## {title}")[1].split("\n## ")[0].splitlines() if line.startswith("| ")]


def test_the_bound_table_says_which_model_each_row_is(three):
    _, report = three
    header, *rows = _section(Path(report.md_path).read_text(), "The bound")
    assert header.split("|")[1].strip() == "model"
    assert sorted(row.split("|")[1].strip() for row in rows) == sorted(MODELS)


def test_the_crossover_table_says_where_the_crossing_lies_not_none(three):
    _, report = three
    assert "<td>None</td>" not in Path(report.html_path).read_text()
    rows = _section(Path(report.md_path).read_text(), "Crossover size")[1:]
    assert len(rows) == 3 and all("| <= 0.100 | FP8 faster at every size measured; 1 of 1 sizes faster beyond noise |" in row
                                  for row in rows), rows


def test_the_headline_names_each_models_fastest_cell(three):
    _, report = three
    fastest = [line for line in report.headline if line.startswith("Fastest cell of ")]
    assert [line.split(":")[0] for line in fastest] == [f"Fastest cell of {m.split(':')[0]}" for m in sorted(MODELS)]
    llama = next(line for line in fastest if line.startswith("Fastest cell of hf:llama:"))
    assert "torchao-fp8-tensorwise eager at d_model 64 x 2 layers, 77.4 ms per step, 1.43x [" in llama
    assert "faster than the next of its 2 cells, torch-bf16 eager (beyond noise)" in llama


def test_the_step_breakdown_keeps_every_cell_label_whole(three):
    """Upright labels under the bars overlapped each other and the legend and were cut ('py:na'): the cells now
    run down the y axis, each label wrapped between its parts, none cut."""
    store, _ = three
    table = breakdown(prepare(store.read_records().to_pandas()), TRAIN_STEP)
    bars = breakdown_chart(table, "where").data[0]
    assert bars.orientation == "h"
    shown = [label.replace("<br>", "") for label in bars.y]
    assert shown == [f"{label} b8" for label in table["cell_label"]]
    assert all(len(line) <= 36 for label in bars.y for line in label.split("<br>"))
    assert any(label.startswith("py:/home/me/src/nanogpt/model.py:<br>build-d64") for label in bars.y)


def test_the_summary_says_see_below_and_prints_a_long_reason_whole():
    import pyarrow as pa
    from rich.console import Console

    from orchestrator.progress import WHY_CHARS, reasons_below, summary_table
    from orchestrator.work import WorkItem

    long, short = WorkItem.of(TrialSpec(d_model=64), 0), WorkItem.of(TrialSpec(d_model=128), 0)
    reason = "torchao float8 needs " + "a GPU of compute capability 8.9 or newer, " * 4 + "and this is a CPU."
    assert len(reason) > WHY_CHARS
    records = pa.Table.from_pylist([{"cell_id": long.cell_id, "sample": 0, "step_ms_p50": None, "error": reason},
                                    {"cell_id": short.cell_id, "sample": 0, "step_ms_p50": None, "error": "OOM"}])
    statuses = {long.key: "unsupported", short.key: "oom"}
    console = Console(record=True, width=300)
    console.print(summary_table([long, short], statuses, records))
    rows = {row[5]: row[6] for row in ([c.strip() for c in line.split("│")] for line in console.export_text().splitlines()
                                       if "-s0" in line)}
    assert rows == {long.key: "see below", short.key: "OOM"}, rows
    assert reasons_below([long, short], statuses, records) == [f"why {long.label} s0: {reason}"]
