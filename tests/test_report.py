"""Report numbers against a synthetic dataset whose speedups are known in advance."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from orchestrator.report import build_report, side_names
from orchestrator.report.analysis import compare_runs, prepare
from orchestrator.report.charts import compare_chart
from orchestrator.report.render import export_pngs
from orchestrator.store import Store
from trials import TrialSpec
from trials.models.minigpt_net import ModelConfig, param_count
from trials.record.fields import empty_record

JITTER = [1.00, 1.02, 0.99, 1.05, 0.97, 1.01, 1.03, 0.98, 1.00, 1.04]
FP8_SPEEDUP = {("delayed", 256): 0.8, ("delayed", 512): 1.1, ("delayed", 1024): 1.4,
               ("current", 256): 0.9, ("current", 512): 1.2, ("current", 1024): 1.5}
TE_GAIN = 1.3


def _rec(d_model, backend, precision, recipe, base_ms, status="ok", sample=0):
    spec = TrialSpec(d_model=d_model, n_layers=2, backend=backend, precision=precision, recipe=recipe or "delayed")
    rec = empty_record()
    rec.update(spec.to_dict())
    steps = [base_ms * j for j in JITTER]
    rec.update(status=status, effective_backend=backend if status == "ok" else None,
               effective_precision=precision if status == "ok" else None,
               effective_recipe=recipe if status == "ok" else None,
               cell_id=f"{backend}-{precision}-{recipe}-{d_model}", cell_label=f"d{d_model}-{backend}-{precision}-{recipe}",
               sample=sample, n_params=param_count(ModelConfig.from_spec(spec)), gpu_name="NVIDIA H200",
               peak_tflops_bf16=989.0, peak_tflops_precision=1979.0 if precision == "fp8" else 989.0)
    if status == "ok":
        rec.update(step_times_ms=steps, step_ms_p50=float(pd.Series(steps).median()), loss_curve=[4.0, 2.0, 1.0],
                   loss_first=4.0, loss_final=1.0, tokens_per_s=1e6 / base_ms, model_tflops=100.0 / base_ms,
                   mfu_bf16_peak=0.1 / base_ms, mfu_precision_peak=0.05 / base_ms,
                   peak_mem_allocated_bytes=int(d_model * 1e6), est_peak_mem_bytes=int(d_model * 1.1e6))
    else:
        rec["error"] = "CUDA out of memory" if status == "oom" else "x"
    return rec


def synthetic(root, slow_cell: str | None = None, samples: int = 1, scale: float = 1.0):
    """The known grid; ``samples`` records per cell, every time times ``scale`` (another run of it)."""
    store = Store(str(root), "synth")
    store.ensure()
    for d, s in ((d, s) for d in (256, 512, 1024) for s in range(samples)):
        bf16 = 10.0 * d / 256 * scale
        store.write_record(_rec(d, "te", "bf16", None, bf16, sample=s))
        store.write_record(_rec(d, "torch", "bf16", None, bf16 * TE_GAIN, sample=s))
        for recipe in ("delayed", "current"):
            ms = bf16 / FP8_SPEEDUP[(recipe, d)]
            if slow_cell == f"te-fp8-{recipe}-{d}":
                ms *= 1.5
            store.write_record(_rec(d, "te", "fp8", recipe, ms, sample=s))
    store.write_record(_rec(2048, "te", "bf16", None, 80.0, status="oom"))  # partner oom
    store.write_record(_rec(2048, "te", "fp8", "delayed", 60.0 * scale))
    store.write_record(_rec(4096, "te", "fp8", "delayed", 90.0 * scale))  # partner never ran
    return store


def test_report_numbers_equal_the_known_ones(tmp_path):
    store = synthetic(tmp_path)
    report = build_report(store.root)
    csv = pd.read_csv(report.csv_path)
    fp8 = csv[csv["kind"] == "fp8_speedup"]
    assert len(fp8) == 6
    for row in fp8.itertuples():
        want = FP8_SPEEDUP[(row.candidate.replace("te-fp8-", ""), row.d_model)]
        assert row.ratio == pytest.approx(want, rel=1e-12)
        assert row.ci_low <= want <= row.ci_high and row.ci_method == "steps"
    gain = csv[csv["kind"] == "te_gain"]
    assert len(gain) == 3 and gain["ratio"].tolist() == pytest.approx([TE_GAIN] * 3, rel=1e-12)
    md = open(report.md_path).read()
    assert "te-bf16 is oom: CUDA out of memory" in md and "no te-bf16 cell" in md
    # crossover of the delayed line lies between the 256 and 512 cells (0.8 -> 1.1)
    n256, n512 = (param_count(ModelConfig.from_spec(TrialSpec(d_model=d, n_layers=2))) for d in (256, 512))
    line = next(l for l in md.splitlines() if l.startswith("| te-fp8-delayed | 2 | False |"))
    crossing = float(line.split("|")[4]) * 1e6
    assert n256 < crossing < n512
    assert "Sanity checks" not in md  # all synthetic speedups are plausible
    cells = md[md.index("## All cells"):].split("\n## ")[0]
    header = [c.strip() for c in next(l for l in cells.splitlines() if l.startswith("| cell_label")).split("|")]
    row = dict(zip(header, (c.strip() for c in next(l for l in cells.splitlines() if l.startswith("| d512-te-bf16"))
                            .split("|"))))
    assert float(row["est_over_peak"]) == pytest.approx(1.1)  # the memory plan's estimate over the measured peak
    html = open(report.html_path).read()
    assert html.count('class="plotly-graph-div"') == 8 and html.count("plotly.js v") <= 2


def test_compare_flags_only_changes_beyond_noise(tmp_path):
    a = prepare(synthetic(tmp_path / "a", samples=2).read_records().to_pandas())
    b = prepare(synthetic(tmp_path / "b", slow_cell="te-fp8-current-512", samples=2).read_records().to_pandas())
    cmp = compare_runs(a, b)
    changed = cmp[cmp["changed"]]
    assert changed["cell_id"].tolist() == ["te-fp8-current-512"]
    assert changed["ratio_b_over_a"].iloc[0] == pytest.approx(1.5)
    assert set(cmp.loc[cmp["n_a"] == 2, "verdict"]) == {"changed", "within noise"}
    report = build_report(str(tmp_path / "a" / "synth"), out_html=str(tmp_path / "cmp.html"),
                          compare_dir=str(tmp_path / "b" / "synth"))
    assert "Comparison" in open(report.md_path).read()
    assert (pd.read_csv(report.csv_path)["kind"] == "compare").sum() == len(cmp)
    # both sides are folders named "synth": the chart names them by path, and says which is A and which B
    names = side_names(str(tmp_path / "a" / "synth"), str(tmp_path / "b" / "synth"))
    assert names == (str(tmp_path / "a" / "synth"), str(tmp_path / "b" / "synth"))
    assert f"A = {names[0]}, B = {names[1]}" in compare_chart(cmp, *names).layout.title.text


def test_compare_of_two_one_sample_runs_calls_no_change(tmp_path):
    """Two runs of one 1-sample sweep, the second 3% slower throughout (another process, another clock):
    the steps of one trial are tight around that 3%, but say nothing of run-to-run noise."""
    a = prepare(synthetic(tmp_path / "a").read_records().to_pandas())
    b = prepare(synthetic(tmp_path / "b", scale=1.03).read_records().to_pandas())
    cmp = compare_runs(a, b)
    assert not cmp["changed"].any() and (cmp["verdict"] == "one sample: run-to-run noise unknown, use samples >= 2").all()
    assert cmp["ratio_b_over_a"].tolist() == pytest.approx([1.03] * len(cmp))
    report = build_report(str(tmp_path / "a" / "synth"), out_html=str(tmp_path / "cmp.html"),
                          compare_dir=str(tmp_path / "b" / "synth"))
    assert any("use samples >= 2" in w for w in report.warnings)


def test_implausible_speedup_is_flagged(tmp_path):
    store = Store(str(tmp_path), "fast")
    store.ensure()
    store.write_record(_rec(512, "te", "bf16", None, 20.0))
    store.write_record(_rec(512, "te", "fp8", "delayed", 10.0))  # 2.0x end to end
    md = open(build_report(store.root).md_path).read()
    assert "Sanity checks" in md and "| fp8 speedup | 2.0 |" in md


def test_a_gpu_cell_whose_timed_steps_spread_is_flagged_and_a_steady_one_is_not(tmp_path):
    """The full-depth TE swap FP8 cell's steps on an H200 (its record's step_times_ms): sd 16% of the median."""
    from trials.measure.metrics import step_stats

    store = Store(str(tmp_path), "spread")
    store.ensure()
    spread = [249.3, 297.1, 315.6, 239.9, 223.8, 203.2, 205.0, 226.3, 280.9, 237.5]
    for rec, steps in ((_rec(512, "te", "bf16", None, 20.0), [20.0 * j for j in JITTER]),
                       (_rec(512, "te", "fp8", "delayed", 15.0), spread)):
        rec.update(timer="cuda_event", step_times_ms=steps, **step_stats(steps))
        store.write_record(rec)
    md = open(build_report(store.root).md_path).read()
    flagged = [line for line in md.splitlines() if "| unsteady steps |" in line]
    assert len(flagged) == 1 and "te-fp8-delayed" in flagged[0], flagged


def test_a_compiled_cell_whose_steps_ran_eager_is_flagged_in_the_report_and_the_summary(tmp_path):
    """compiled_eager_why (trials/measure/kernels.py) becomes a sanity check and the summary's why: the
    full-depth study's compiled cells timed eager code and nothing said so."""
    import pyarrow as pa
    from rich.console import Console

    from orchestrator.progress import summary_table
    from orchestrator.work import WorkItem

    store = Store(str(tmp_path), "eager")
    store.ensure()
    why = "ran eager code: 0 compiled graph(s) per profiled step, 2 expected (one per compiled unit)"
    for d, calls, said in ((256, 2.0, None), (512, 0.0, why)):
        rec = _rec(d, "torch", "bf16", None, 10.0)
        rec.update(compile=True, compiled_calls_per_step=calls, compiled_eager_why=said)
        store.write_record(rec)
    md = open(build_report(store.root).md_path).read()
    flagged = [line for line in md.splitlines() if "| compiled, ran eager |" in line]
    assert len(flagged) == 1 and flagged[0].split("|")[1].strip() == "d512-torch-bf16-None", flagged
    item = WorkItem.of(TrialSpec(backend="torch", precision="bf16", compile=True), 0)
    records = pa.Table.from_pylist([{"cell_id": item.cell_id, "sample": 0, "step_ms_p50": 12.5, "error": None,
                                     "compiled_eager_why": why}])
    console = Console(record=True, width=300)
    console.print(summary_table([item], {item.key: "ok"}, records))
    assert why in console.export_text()


def test_launch_bound_cells_timed_beside_another_trial_are_flagged(tmp_path):
    store = Store(str(tmp_path), "busy")
    store.ensure()
    times = {256: ("04:00:00", "04:00:30"), 512: ("04:00:10", "04:00:40"), 1024: ("04:01:00", "04:01:30")}
    for d, (start, end) in times.items():
        rec = _rec(d, "te", "bf16", None, 10.0)
        rec.update(hostname="gpu-host", started_at=f"2026-11-30T{start}+00:00",
                   finished_at=f"2026-11-30T{end}+00:00", launch_bound=True, host_ms_per_step=9.5)
        store.write_record(rec)
    md = open(build_report(store.root).md_path).read()
    shared = [line for line in md.splitlines() if "| shared host |" in line]
    assert [line.split("|")[1].strip() for line in shared] == ["d256-te-bf16-None", "d512-te-bf16-None"]
    assert sum("| launch-bound |" in line for line in md.splitlines()) == 3


def test_cpu_ranks_on_one_host_are_flagged_shared_host(tmp_path):
    """A two-rank gloo cell on one host (issue 31): its ranks timed each other on the host's cores."""
    store = Store(str(tmp_path), "gloo")
    store.ensure()
    for d, world, where in ((256, 2, "same host"), (512, 2, "2 hosts"), (1024, 1, None)):
        rec = _rec(d, "torch", "fp32", None, 10.0)
        rec.update(world_size=world, parallel="ddp" if world > 1 else "none", interconnect=where, timer="perf_counter")
        store.write_record(rec)
    md = open(build_report(store.root).md_path).read()
    shared = [line for line in md.splitlines() if "| shared host |" in line]
    assert [line.split("|")[1].strip() for line in shared] == ["d256-torch-fp32-None"], shared
    assert "2 ranks timed on one host's CPU cores" in shared[0]


KNOB_SPEEDUP = {  # (fp8 settings, d_model, batch_size) -> FP8 speedup built into the records
    **{(("hybrid", 16), d, b): s for (d, b), s in {(256, 32): 0.9, (512, 32): 1.2, (256, 64): 1.0, (512, 64): 1.3}.items()},
    **{(("e4m3", 16), d, b): s for (d, b), s in {(256, 32): 0.95, (512, 32): 1.25, (256, 64): 1.05, (512, 64): 1.35}.items()},
    **{(("hybrid", 1024), d, b): s for (d, b), s in {(256, 32): 0.8, (512, 32): 1.1, (256, 64): 0.85, (512, 64): 1.15}.items()},
}


def _knob_rec(spec: TrialSpec, ms: float) -> dict:
    from orchestrator.sweep import cell_id, cell_label

    rec = empty_record()
    rec.update(spec.to_dict())
    steps = [ms * j for j in JITTER]
    rec.update(status="ok", effective_backend="te", effective_precision=spec.precision,
               effective_recipe=spec.recipe if spec.precision == "fp8" else None, cell_id=cell_id(spec),
               cell_label=cell_label(spec), sample=0, n_params=param_count(ModelConfig.from_spec(spec)),
               step_times_ms=steps, step_ms_p50=float(pd.Series(steps).median()), loss_curve=[4.0, 2.0, 1.0],
               loss_first=4.0, loss_final=1.0, tokens_per_s=1e6 / ms, gpu_name="NVIDIA H200")
    return rec


def test_fp8_variants_that_differ_in_one_knob_are_never_merged(tmp_path):
    """FP8 cells differing only in fp8_format, amax_history_len or batch_size: one pair each, right ratios,
    in results.csv, results.md and every chart."""
    store = Store(str(tmp_path), "knobs")
    store.ensure()
    base = dict(n_layers=2, backend="te")
    for d in (256, 512):
        for b in (32, 64):
            bf16_ms = 10.0 * d / 256 * b / 32
            store.write_record(_knob_rec(TrialSpec(d_model=d, batch_size=b, precision="bf16", **base), bf16_ms))
            for (fmt, hist), dd, bb in KNOB_SPEEDUP:
                if (dd, bb) == (d, b):
                    spec = TrialSpec(d_model=d, batch_size=b, precision="fp8", fp8_format=fmt, amax_history_len=hist,
                                     **base)
                    store.write_record(_knob_rec(spec, bf16_ms / KNOB_SPEEDUP[((fmt, hist), d, b)]))
    report = build_report(str(tmp_path / "knobs"), out_html=str(tmp_path / "r.html"))
    csv = pd.read_csv(tmp_path / "results.csv")
    sp = csv[csv["kind"] == "fp8_speedup"]
    assert len(sp) == len(KNOB_SPEEDUP) == 12
    names = {"te-fp8-delayed": ("hybrid", 16), "te-fp8-delayed-e4m3": ("e4m3", 16),
             "te-fp8-delayed-hist1024": ("hybrid", 1024)}
    for row in sp.itertuples():
        assert row.ratio == pytest.approx(KNOB_SPEEDUP[(names[row.candidate], row.d_model, row.batch_size)], rel=1e-9)
    md = (tmp_path / "results.md").read_text()
    assert "| batch_size |" in md and "delayed-e4m3" in md and "delayed-hist1024" in md
    from orchestrator.report import charts

    df = prepare(Store(str(tmp_path), "knobs").read_records().to_pandas())
    speedup_traces = [t.name for t in charts.speedup_chart(report.pairs).data]
    assert len(speedup_traces) == len(set(speedup_traces)) == 6  # 3 FP8 variants x 2 batch sizes, 2 points each
    assert all(len(t.x) == 2 for t in charts.speedup_chart(report.pairs).data)
    for chart in (charts.step_time_chart, charts.throughput_chart):
        names_ = [t.name for t in chart(df).data]
        assert len(names_) == len(set(names_)) == 8 and any("batch_size=64" in n for n in names_)
    loss_names = {t.name for t in charts.loss_chart(df).data}
    assert len(loss_names) == 8
    status_rows = charts.status_chart(df).data[0].y
    assert len(status_rows) == 8


def test_recipes_and_formats_section_says_which_knob_moved_speed_or_loss(tmp_path):
    """Three samples per cell: e4m3 is faster beyond noise, a 1024-long amax history is not, and
    neither moves the loss; the report's sentences say exactly that."""
    store = Store(str(tmp_path), "rf")
    store.ensure()
    base = dict(d_model=512, n_layers=2, backend="te")
    cells = [(TrialSpec(precision="bf16", **base), 10.0, 1.00),
             (TrialSpec(precision="fp8", **base), 10.0 / 1.2, 1.01),
             (TrialSpec(precision="fp8", fp8_format="e4m3", **base), 10.0 / 1.5, 1.01),
             (TrialSpec(precision="fp8", amax_history_len=1024, **base), 10.0 / 1.2, 1.01)]
    for spec, ms, loss in cells:
        for sample, jitter in enumerate((0.99, 1.0, 1.01)):
            rec = _knob_rec(spec, ms * jitter)
            rec.update(sample=sample, loss_final=loss * jitter)
            store.write_record(rec)
    build_report(str(tmp_path / "rf"), out_html=str(tmp_path / "r.html"))
    md = (tmp_path / "results.md").read_text()
    assert "## Recipes and formats" in md
    findings = md.split("## Recipes and formats: what changed")[1]
    e4m3 = next(line for line in findings.splitlines() if "fp8_format e4m3 vs hybrid" in line)
    hist = next(line for line in findings.splitlines() if "amax_history_len 1024 vs 16" in line)
    assert "speedup 1.5x" in e4m3 and e4m3.count("beyond noise") == 1 and "final loss" in e4m3
    assert "within noise; final loss" in hist and hist.rstrip(" |").endswith("within noise.")


def test_per_layer_cost_and_module_granularity_pairing(tmp_path):
    """Llama cells at depths 2 and 4 with step = rest + L * layer: the split, the per-layer FP8 speedup and the
    full-depth estimate come out exactly; modules-built FP8 pairs with modules-built BF16; nothing merges with gpt."""
    store = Store(str(tmp_path), "layers")
    store.ensure()
    shape = dict(arch="llama", d_model=512, n_heads=8, n_kv_heads=2, vocab=32000, seq_len=512, tokens_per_step=4096,
                 backend="te")
    split = {"bf16": (4.0, 10.0), "fp8": (3.0, 10.5)}  # (per layer ms, rest ms)
    for layers in (2, 4):
        for te_layer, slower in (("transformer_layer", 1.0), ("modules", 1.1)):
            for precision, (layer, rest) in split.items():
                spec = TrialSpec(n_layers=layers, precision=precision, te_layer=te_layer, **shape)
                store.write_record(_knob_rec(spec, (rest + layers * layer) * slower))
    store.write_record(_knob_rec(TrialSpec(d_model=512, n_layers=2, backend="te", precision="bf16"), 7.0))  # gpt
    report = build_report(str(tmp_path / "layers"), out_html=str(tmp_path / "r.html"))
    sp = report.pairs.rows[report.pairs.rows["kind"] == "fp8_speedup"]
    assert sorted(zip(sp["reference"], sp["candidate"])) == [("te-bf16", "te-fp8-delayed")] * 2 + [
        ("te-bf16-modules", "te-fp8-delayed-modules")] * 2
    assert sp["ratio"].tolist() == pytest.approx([(10 + L * 4.0) / (10.5 + L * 3.0) for L in sp["n_layers"]])
    md = (tmp_path / "results.md").read_text()
    assert "## Per-layer cost" in md
    estimate = (10 + 32 * 4.0) / (10.5 + 32 * 3.0)
    section = md.split("## Per-layer cost: full-depth estimates")[1].split("\n## ")[0]
    lines = [l for l in section.splitlines() if "te-fp8-delayed" in l]
    assert len(lines) == 2 and all(f"{estimate:.2f}x at 32 layers" in l and "per-layer FP8 speedup 1.33x" in l
                                   for l in lines)
    assert "estimate" in lines[0] and "llama d_model 512, ffn 1536, 8/2 heads" in lines[0]
    gpt = prepare(Store(str(tmp_path), "layers").read_records().to_pandas())
    assert gpt.groupby("cell_id")["series"].first().str.contains("arch=").all()  # arch varies: every series says it


def _infer_rec(spec: TrialSpec, decode_ms: float, prefill_ms: float, weight_bytes: int, match: float | None) -> dict:
    from orchestrator.sweep import cell_id, cell_label

    rec = empty_record()
    rec.update(spec.to_dict())
    decode = [decode_ms * j for j in JITTER]
    prefill = [prefill_ms * j for j in JITTER]
    rec.update(status="ok", effective_backend=spec.backend, effective_precision=spec.precision,
               effective_recipe=spec.recipe if spec.precision == "fp8" else None, cell_id=cell_id(spec),
               cell_label=cell_label(spec), sample=0, n_params=param_count(ModelConfig.from_spec(spec)),
               decode_times_ms=decode, decode_ms_per_token_p50=float(pd.Series(decode).median()),
               prefill_times_ms=prefill, prefill_ms_p50=float(pd.Series(prefill).median()),
               decode_tokens_per_s=spec.batch_size / decode_ms * 1000, weight_bytes=weight_bytes,
               kv_cache_bytes=1 << 20, gen_match_rate=match, loss_final=1.0, gpu_name="NVIDIA H200")
    return rec


def test_inference_section_pairs_fp8_weights_with_bf16_and_shows_where_fp8_is_slower(tmp_path):
    """Decode and prefill speedups come out as built, against TE BF16 and against the fastest BF16 decode of
    the shape (here the twin's at 4096 x batch 32); FP8 slower at batch 1 is a finding, not dropped; the
    training sections and charts never see inference records."""
    store = Store(str(tmp_path), "inf")
    store.ensure()
    want = {(768, 1): 0.8, (768, 32): 1.1, (4096, 1): 1.3, (4096, 32): 1.4}
    for sample, j in enumerate((1.0, 1.01)):  # two samples: verdicts are judged over samples
        for (d, b), speedup in want.items():
            base = dict(workload="infer", d_model=d, n_layers=4, batch_size=b, backend="te", cuda_graphs=True,
                        prompt_len=32, gen_len=32)
            store.write_record({**_infer_rec(TrialSpec(precision="bf16", **base), j * d / 768, 5.0 * j, 2000, None),
                                "sample": sample})
            store.write_record({**_infer_rec(TrialSpec(precision="fp8", weights="fp8", **base), j * d / 768 / speedup,
                                             j * 5.0 / 1.25, 1000 + 50, 0.97), "sample": sample})
        twin = dict(workload="infer", d_model=4096, n_layers=4, batch_size=32, cuda_graphs=True, prompt_len=32,
                    gen_len=32)
        store.write_record({**_infer_rec(TrialSpec(backend="torch", precision="bf16", **twin), j * 4096 / 768 / 1.25,
                                         5.0 * j, 2000, None), "sample": sample})  # decodes 1.25x faster than TE BF16
    store.write_record(_knob_rec(TrialSpec(d_model=768, n_layers=4, backend="te", precision="bf16"), 20.0))  # training
    report = build_report(str(tmp_path / "inf"), out_html=str(tmp_path / "r.html"))
    md = (tmp_path / "results.md").read_text()
    table = md.split("## Inference: FP8 vs BF16")[1].split("\n## ")[0]
    lines = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    head = [h.strip() for h in lines[0]]
    rows = [dict(zip(head, (v.strip() for v in r))) for r in lines[1:]]
    got = {(int(r["d_model"]), int(r["batch"])): float(r["decode speedup"]) for r in rows}
    assert got == pytest.approx(want, rel=1e-3)
    # a decode step yields a token for each row (32 at batch 32): its time is per step, not per token
    assert "BF16 ms/decode step" in head and "fastest BF16 ms/decode step" in head
    assert "ms/token" not in md and "ms per token" not in md
    assert all(float(r["prefill speedup"]) == pytest.approx(1.25, rel=1e-3) and
               float(r["weights FP8/BF16"]) == pytest.approx(0.525) and float(r["greedy agreement (secondary)"]) == pytest.approx(0.97)
               and r["tf top-1 agreement"] == "-"
               for r in rows)
    vs = {(int(r["d_model"]), int(r["batch"])): (r["fastest BF16"], float(r["vs fastest BF16"])) for r in rows}
    assert vs[(4096, 32)] == ("torch-bf16 graphs", pytest.approx(1.4 / 1.25, rel=1e-3))
    assert vs[(4096, 1)] == ("te-bf16 graphs", pytest.approx(1.3, rel=1e-3))
    findings = md.split("## Inference: where FP8 pays off")[1].split("\n## ")[0]
    slow = next(line for line in findings.splitlines() if "d_model 768 x 4, batch 1," in line)
    assert "FP8 decode slower than the fastest BF16 (te-bf16 graphs: 0.8x" in slow and "prefill faster" in slow
    fastest = md.split("## Inference: the fastest BF16 decode per shape")[1].split("\n## ")[0]
    assert "| 4096 | 4 | 32 | True | torch |" in fastest and "| 4096 | 4 | 1 | True | te |" in fastest
    assert report.pairs.rows.empty  # the one training cell has no partner; inference never pairs with training
    html = open(report.html_path).read()
    assert "FP8 decode speedup over BF16 of the same stack" in html and "KV-cached decode throughput" in html


def _stack_rec(d_model, backend, precision, recipe, ms, compile_=False, sample=0):
    rec = _rec(d_model, backend, precision, recipe, ms, sample=sample)
    rec.update(compile=compile_, cell_id=f"{rec['cell_id']}-{compile_}", cell_label=f"{rec['cell_label']}-{compile_}")
    return rec


def test_two_stacks_pair_within_their_stack_and_mode_and_against_the_fastest_bf16(tmp_path):
    """torchao FP8 (compiled) pairs with the compiled twin, TE FP8 with TE BF16, never by name; every cell is
    also set against the fastest BF16 of its shape, and each stack's fastest FP8 against the other's."""
    store = Store(str(tmp_path), "stacks")
    store.ensure()
    ms = {("te", "bf16", None, False): 10.0, ("te", "fp8", "delayed", False): 8.0,
          ("torch", "bf16", None, False): 12.0, ("torch", "bf16", None, True): 9.0,
          ("torchao", "fp8", "tensorwise", True): 7.5, ("torchao", "fp8", "rowwise", True): 8.2,
          ("torchao", "fp8", "tensorwise", False): 15.0}
    for (backend, precision, recipe, compiled), t in ms.items():
        for sample, j in enumerate((1.0, 1.01)):
            store.write_record(_stack_rec(1024, backend, precision, recipe, t * j, compiled, sample))
    report = build_report(store.root)
    csv = pd.read_csv(report.csv_path)
    sp = csv[csv["kind"] == "fp8_speedup"].set_index(["candidate", "compile"])
    assert sp.loc[("te-fp8-delayed", False), "reference"] == "te-bf16"
    assert sp.loc[("te-fp8-delayed", False), "ratio"] == pytest.approx(10.0 / 8.0)
    assert sp.loc[("torchao-fp8-tensorwise", True), "reference"] == "torch-bf16"
    assert sp.loc[("torchao-fp8-tensorwise", True), "ratio"] == pytest.approx(9.0 / 7.5)  # compiled vs compiled
    assert sp.loc[("torchao-fp8-tensorwise", False), "ratio"] == pytest.approx(12.0 / 15.0)  # eager vs eager
    md = (tmp_path / "stacks" / "results.md").read_text()
    assert "## Against the fastest BF16" in md and "## FP8 stacks head to head" in md

    from orchestrator.report.analysis import against_fastest_bf16

    rows, heads = against_fastest_bf16(prepare(store.read_records().to_pandas()))
    assert set(rows["fastest BF16"]) == {"torch-bf16 compiled"}  # 9.0 ms beats TE's 10.0
    by_cell = rows.set_index("cell")
    assert by_cell.loc["torchao-fp8-tensorwise compiled", "ratio"] == pytest.approx(9.0 / 7.5)
    assert by_cell.loc["te-fp8-delayed eager", "ratio"] == pytest.approx(9.0 / 8.0)
    assert by_cell.loc["te-bf16 eager", "ratio"] == pytest.approx(9.0 / 10.0)
    [head] = heads.to_dict("records")
    assert (head["a"], head["b"]) == ("te-fp8-delayed eager", "torchao-fp8-tensorwise compiled")
    assert head["a/b time"] == pytest.approx(8.0 / 7.5) and head["CI low"] <= head["a/b time"] <= head["CI high"]


def _md_section(md: str, title: str) -> list[dict[str, str]]:
    """The rows of one results.md table, as column name -> cell text."""
    table = md.split(f"## {title}\n")[1].split("\n## ")[0]
    lines = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    head = [h.strip() for h in lines[0]]
    return [dict(zip(head, (v.strip() for v in r))) for r in lines[1:]]


def test_fp8_numerics_show_teacher_forced_median_and_interval_over_samples(tmp_path):
    """Two samples of a torchao FP8 cell with teacher-forced fields: the FP8 numerics section shows their
    median and a 95% interval over samples, results.csv the same numbers. A TE FP8 cell whose BF16 partner is
    undecided (a nearly flat distribution, as after 12 steps on a 128k vocabulary) shows that in words instead of
    an agreement that reads as FP8 being broken; a cell without the fields (older records) shows '-'."""
    store = Store(str(tmp_path), "tf")
    store.ensure()
    # per sample: (tf_top1_agreement, tf_kl_mean, tf_bf16_top1_prob, tf_decided_share, tf_top1_agreement_decided)
    tf = {"torchao": [(0.98, 0.010, 0.81, 0.92, 0.99), (0.96, 0.014, 0.79, 0.90, 0.99)],
          "te": [(0.0, 0.48, 0.0003, 0.0, None), (0.0, 0.51, 0.0003, 0.0, None)]}
    for sample in range(2):
        for backend, precision, recipe, ms in (("torch", "bf16", None, 10.0), ("torchao", "fp8", "tensorwise", 8.0),
                                               ("te", "bf16", None, 10.0), ("te", "fp8", "delayed", 8.0),
                                               ("te", "fp8", "current", 8.0)):
            rec = _rec(512, backend, precision, recipe, ms * (1 + sample / 100), sample=sample)
            if precision == "fp8" and recipe != "current":
                rec.update(zip(("tf_top1_agreement", "tf_kl_mean", "tf_bf16_top1_prob", "tf_decided_share",
                                "tf_top1_agreement_decided"), tf[backend][sample]), tf_s=1.0)
            store.write_record(rec)
    report = build_report(store.root)
    md = (tmp_path / "tf" / "results.md").read_text()
    rows = {r["variant"]: r for r in _md_section(md, "FP8 numerics")}
    ao, te = rows["torchao-fp8-tensorwise"], rows["te-fp8-delayed"]

    def two(a: float, b: float, top: float = 1.0) -> str:
        """median [95% t-interval] of two samples (t(1) = 12.706 from the tables), clipped to [0, top]"""
        mid, half = (a + b) / 2, 12.706 * abs(a - b) / 2
        return f"{mid:.3g} [{max(mid - half, 0.0):.3g}, {min(mid + half, top):.3g}]"

    assert ao["tf top-1 agreement"] == two(0.98, 0.96) == "0.97 [0.843, 1]"
    assert ao["tf KL (nats)"] == two(0.010, 0.014, math.inf)
    assert (ao["tf top-1 agreement where BF16 decided"], ao["BF16 decided share"]) == ("0.99 [0.99, 0.99]",
                                                                                      two(0.92, 0.90))
    assert te["tf top-1 agreement"] == ("BF16 itself is undecided here (top-1 p=0.0003, decided at 0% of positions): "
                                        "agreement not meaningful; KL stands")
    assert te["tf KL (nats)"] == two(0.48, 0.51, math.inf) and te["tf top-1 agreement where BF16 decided"] == "-"
    assert rows["te-fp8-current"]["tf top-1 agreement"] == rows["te-fp8-current"]["tf KL (nats)"] == "-"
    sp = pd.read_csv(report.csv_path).set_index("candidate")
    assert sp.loc["torchao-fp8-tensorwise", "tf_top1"] == pytest.approx(0.97)
    assert sp.loc["torchao-fp8-tensorwise", "tf_kl_ci_high"] == pytest.approx(0.012 + 12.706 * 0.002, rel=1e-3)
    assert sp.loc["te-fp8-delayed", "tf_top1"] == 0 and sp.loc["te-fp8-delayed", "tf_bf16_p"] == pytest.approx(3e-4)
    assert pd.isna(sp.loc["te-fp8-current", "tf_top1"])


BF16_OVER_FP32 = {64: 1.25, 128: 1.6}  # fp32 step time / bf16 step time built into the CPU records below


def _cpu_rec(d_model: int, precision: str, sample: int) -> dict:
    """A CPU trial (no GPU name) of a run without FP8, with a kernel breakdown that sums to its step."""
    spec = TrialSpec(d_model=d_model, n_layers=2, backend="torch", precision=precision, device="cpu")
    ms = d_model / 10 * (BF16_OVER_FP32[d_model] if precision == "fp32" else 1.0)
    rec = empty_record()
    rec.update(spec.to_dict())
    steps = [ms * j * (1 + 0.01 * sample) for j in JITTER]
    rec.update(status="ok", effective_backend="torch", effective_precision=precision, effective_device="cpu",
               cell_id=f"torch-{precision}-{d_model}", cell_label=f"d{d_model}-L2-torch-{precision}", sample=sample,
               n_params=param_count(ModelConfig.from_spec(spec)), step_times_ms=steps,
               step_ms_p50=float(pd.Series(steps).median()), loss_curve=[4.0, 2.0], loss_final=2.0,
               tokens_per_s=1e5 / ms, model_tflops={64: 0.054, 128: 0.130}[d_model] * (1 + 0.01 * sample),
               kernel_ms_gemm_bf16=0.6 * ms, kernel_ms_elementwise=0.2 * ms, kernel_ms_total=0.8 * ms,
               kernel_gap_ms=0.2 * ms)
    return rec


def test_run_without_fp8_reports_bf16_over_fp32_with_its_own_titles(tmp_path):
    """34.8, 34.13, 34.14: the comparison a bf16/fp32 run makes is in the csv, the headline and a table;
    charts say what they show; small numbers keep their significant figures; nothing says GPU on CPU."""
    store = Store(str(tmp_path), "nofp8")
    store.ensure()
    for d, precision, s in ((d, p, s) for d in (128, 64) for p in ("fp32", "bf16") for s in range(2)):
        store.write_record(_cpu_rec(d, precision, s))
    report = build_report(store.root)
    csv = pd.read_csv(report.csv_path)
    bf16 = csv[csv["kind"] == "bf16_speedup"].sort_values("d_model")
    assert bf16["d_model"].tolist() == [64, 128] and set(bf16["candidate"]) == {"torch-bf16"}
    assert bf16["ratio"].tolist() == pytest.approx([BF16_OVER_FP32[64], BF16_OVER_FP32[128]], rel=1e-9)
    assert (bf16["ci_low"] <= bf16["ratio"]).all() and (bf16["ratio"] <= bf16["ci_high"]).all()
    assert (bf16["ci_method"] == "samples").all()
    assert "compare bf16 and fp32" in " ".join(report.headline)
    assert any(line.startswith("torch-bf16 vs torch-fp32: best 1.60x [") for line in report.headline)
    md = open(report.md_path).read()
    assert "## BF16 speedup over FP32 of the same stack" in md
    cells = md[md.index("## All cells"):]
    assert "| 0.0543 |" in cells and "| 0.131 |" in cells  # was 0.1 for both
    html = open(report.html_path).read()
    assert "GPU idle" not in html and "GPU idle" not in md
    assert "Unpaired cells" not in html  # no such section here, so nothing points to it
    assert "Training loss per size, FP32 vs BF16" in html and "BF16 vs FP8" not in html
    assert html.count('id="chart-bf16_speedup"') == 1 and 'id="chart-fp8_speedup"' not in html
    steps = md[md.index("## Where the training step goes"):].split("\n## ")[0]
    assert steps.index("d64-L2") < steps.index("d128-L2")  # by size, not by label text
    header = [c.strip() for c in next(l for l in steps.splitlines() if l.startswith("| cell_label")).split("|")]
    fp32 = dict(zip(header, (c.strip() for c in next(l for l in steps.splitlines()
                                                      if l.startswith("| d64-L2-torch-fp32 |")).split("|"))))
    assert (fp32["gemm_fp32"], fp32["gemm_bf16"], fp32["device"]) == ("4.8", "-", "CPU")  # fp32 GEMMs named so


def test_fp8_headline_says_when_launch_bound_steps_set_the_ratio(tmp_path):
    """31.4d: a launch-bound FP8 comparison is the host's pace, not FP8's, and the headline says what takes it out."""
    store = Store(str(tmp_path), "bound")
    store.ensure()
    for d in (256, 512):
        for backend, precision, recipe, ms in (("te", "bf16", None, 10.0), ("te", "fp8", "delayed", 13.0)):
            rec = _rec(d, backend, precision, recipe, ms)
            rec.update(launch_bound=d == 256, host_ms_per_step=9.5 if d == 256 else 2.0)
            store.write_record(rec)
    lines = build_report(store.root).headline
    line = next(l for l in lines if l.startswith("te-fp8-delayed vs te-bf16: best 0.769x"))
    assert "launch-bound at d_model 256 x 2 layers:" in line and "d_model 512" not in line.split("launch-bound")[1]
    assert "not the GPU (nor FP8)" in line and "cuda_graphs: true or a larger model" in line
    assert sum("launch-bound" in l for l in lines) == 1
    # the best (d256) was the host's pace: the best that was not follows it, before the launch-bound note
    assert "; where the host did not set the steps: 0.769x [" in line.split("launch-bound")[0], line
    assert "] at d_model 512 x 2 layers; launch-bound at d_model 256" in line, line


def test_stored_records_are_judged_launch_bound_by_the_profilers_gap(tmp_path):
    """A record written under the host-issue rule alone (an 8B Llama's TE steps on an H200, 2026-12-05: the host
    issued the BF16 step in 167.7 of 206.5 ms while the GPU idled 12.9 ms) is judged again by the gap: the GPU-bound
    pair is no longer called launch-bound, the one that idled 25% still is."""
    store = Store(str(tmp_path), "gap")
    store.ensure()
    for d, (bf16, fp8) in {256: ((206.5, 167.7, 12.9), (238.7, 220.7, 78.6)),
                           512: ((206.5, 167.7, 12.9), (206.0, 180.0, 10.0))}.items():
        for (backend, precision, recipe), (ms, host, gap) in ((("te", "bf16", None), bf16),
                                                            (("te", "fp8", "delayed"), fp8)):
            rec = _rec(d, backend, precision, recipe, ms)
            rec.update(launch_bound=True, host_ms_per_step=host, kernel_gap_ms=gap)  # as the host rule had it
            store.write_record(rec)
    line = next(l for l in build_report(store.root).headline if l.startswith("te-fp8-delayed vs te-bf16"))
    assert "launch-bound at d_model 256 x 2 layers:" in line, line
    assert "d_model 512" not in line.split("launch-bound")[1], line


def test_numbers_keep_three_significant_figures_everywhere():
    """34.14: one helper rounds every number shown; fixed decimals read 0.054..0.130 as 0.1, a CPU trial's 0.0."""
    from trials.cli import summary
    from trials.numbers import fmt_sig, round_sig

    assert [fmt_sig(v) for v in (0.054, 0.12987, 12.79, 1.5, 12345.6, None)] == ["0.0540", "0.130", "12.8", "1.50",
                                                                                "12300", "-"]
    assert [round_sig(v) for v in (0.054, 0.12987, float("nan"))][:2] == [0.054, 0.13]
    rec = empty_record() | {"model_tflops": 0.0412, "tokens_per_s": 1234.5, "n_params": 1000}
    assert "0.0412 TFLOP/s" in summary(rec) and "1230 tok/s" in summary(rec)


def test_per_layer_cost_with_unset_shape_fields(tmp_path):
    """Found while vectorising shape keys: n_kv_heads and tokens_per_step unset (null, read as NaN) kept the
    per-layer section out, since NaN never equals NaN and no shape was found at two depths."""
    store = Store(str(tmp_path), "plain")
    store.ensure()
    for layers in (2, 4):
        for precision, layer in (("bf16", 4.0), ("fp8", 3.0)):
            store.write_record(_knob_rec(TrialSpec(d_model=256, n_layers=layers, backend="te", precision=precision),
                                         10.0 + layers * layer))
    md = open(build_report(store.root).md_path).read()
    assert "## Per-layer cost" in md and "per-layer FP8 speedup 1.33x" in md


def test_cells_of_a_factory_that_sets_no_shape_fields_are_charted_paired_and_reported(tmp_path):
    """A py: factory that takes no d_model or n_layers (its records hold null there): the report crashed on the
    loss chart's size labels ('nan'), and the line charts' groupby dropped the unset depth, so no line."""
    from orchestrator.report import charts
    from orchestrator.report.analysis import pair_cells

    store = Store(str(tmp_path), "own")
    store.ensure()
    for backend, precision, ms in (("torch", "bf16", 10.0), ("torchao", "fp8", 8.0)):
        for s in range(2):
            rec = _rec(256, backend, precision, "tensorwise" if precision == "fp8" else None, ms, sample=s)
            rec.update(model="py:my_models:build", d_model=None, n_layers=None, n_heads=None, ffn=None,
                       n_params=123_456, cell_id=f"own-{precision}", cell_label=f"own-{backend}-{precision}")
            store.write_record(rec)
    report = build_report(store.root)
    df = prepare(store.read_records().to_pandas())
    [row] = pair_cells(df).rows.to_dict("records")
    assert row["candidate"] == "torchao-fp8-tensorwise" and row["ratio"] == pytest.approx(1.25)
    assert "torchao-fp8-tensorwise vs torch-bf16: best 1.25x [1.25, 1.25] at 0.123M parameters" in report.headline[0]
    assert {t.name for t in charts.step_time_chart(df).data} == {"torch-bf16", "torchao-fp8-tensorwise"}
    assert [t.name for t in charts.speedup_chart(pair_cells(df)).data if t.y is not None][:1] == ["torchao-fp8-tensorwise"]
    assert "d_model x layers = ?x?" in open(report.html_path).read()
    assert charts.series_name("torch-bf16", float("nan"), True, "") == "torch-bf16 graphs"  # depth unset, graphed
    assert charts.series_name("te-fp8", 2, True, "d_model=64") == "te-fp8 L2 graphs d_model=64"


def test_an_auto_fp8_cell_that_could_not_run_names_no_phantom_partner(tmp_path):
    """On a CPU machine the auto fp8 cell is unsupported and the auto bf16 cell ran as torch: 'Unpaired
    cells' says why the fp8 cell did not run, and names no te-bf16 'not in this run'."""
    from orchestrator.report.analysis import pair_cells

    store = Store(str(tmp_path), "cpu")
    store.ensure()
    ran = _rec(64, "auto", "bf16", None, 10.0)
    ran.update(effective_backend="torch", cell_id="bf16-64")
    failed = _rec(64, "auto", "fp8", "delayed", 10.0, status="unsupported")
    failed.update(error="fp8 on backend auto needs Transformer Engine (no CUDA device)", cell_id="fp8-64")
    for rec in (ran, failed):
        store.write_record(rec)
    pairs = pair_cells(prepare(store.read_records().to_pandas()))
    [row] = pairs.unpaired.to_dict("records")
    assert row["partner"] == "-" and "needs Transformer Engine" in row["reason"], row


def test_te_cells_of_your_model_pair_within_their_te_layer(tmp_path):
    """On an hf: model TE's default te_layer is swap (MiniGPT's is transformer_layer): each FP8 cell pairs with
    the BF16 cell of its own te_layer. On the H200 the report read the model's default as MiniGPT's, named the
    swap cells te-*-swap and paired swap FP8 with the transformer_layer BF16 (1.14x instead of 1.16x)."""
    from orchestrator.sweep import cell_id, cell_label

    store = Store(str(tmp_path), "yours")
    store.ensure()
    ms = {("swap", "bf16"): 193.0, ("swap", "fp8"): 166.0, ("transformer_layer", "bf16"): 190.0,
          ("transformer_layer", "fp8"): 163.0}
    # a second model of the same d_model, FP8 worth more there: the headline answers per model, never the best of both
    cells = [(model, layer, precision, t * scale) for model, scale in (("hf:llama", 1.0), ("hf:mistral", 0.5))
             for (layer, precision), t in ms.items() if model == "hf:llama" or precision == "bf16" or layer == "swap"]
    for model, layer, precision, t in cells:
        if model == "hf:mistral" and precision == "fp8":
            t = 0.5 * 193.0 / 1.3  # 1.3x over its own swap BF16
        spec = TrialSpec(model=model, d_model=64, n_layers=2, n_heads=4, vocab=96, backend="te", te_layer=layer,
                         precision=precision)
        rec = empty_record()
        rec.update(spec.to_dict())
        steps = [t * j for j in JITTER]
        rec.update(status="ok", effective_backend="te", effective_precision=precision,
                   effective_recipe=spec.recipe if precision == "fp8" else None, cell_id=cell_id(spec),
                   cell_label=cell_label(spec), sample=0, n_params=1000, step_times_ms=steps,
                   step_ms_p50=float(pd.Series(steps).median()), loss_curve=[4.0, 1.0], loss_first=4.0,
                   loss_final=1.0, tokens_per_s=1e6 / t, gpu_name="NVIDIA H200")
        store.write_record(rec)
    report = build_report(str(tmp_path / "yours"), out_html=str(tmp_path / "r.html"))
    csv = pd.read_csv(tmp_path / "results.csv")
    sp = {(r.candidate, r.reference): r.ratio for r in csv[(csv["kind"] == "fp8_speedup") & (csv["model"] == "hf:llama")]
          .itertuples()}
    swap = [line for line in report.headline if "te-fp8-delayed vs te-bf16" in line]
    assert [line.split(": te-")[0] for line in swap] == ["hf:llama", "hf:mistral"], report.headline
    assert "best 1.16x" in swap[0] and "best 1.30x" in swap[1]
    assert all("0 of 1 sizes faster beyond noise, 1 not judged (one sample a side)" in line for line in swap)
    assert sp == {("te-fp8-delayed", "te-bf16"): pytest.approx(193.0 / 166.0, rel=1e-9),
                  ("te-fp8-delayed-transformer_layer", "te-bf16-transformer_layer"): pytest.approx(190.0 / 163.0,
                                                                                               rel=1e-9)}


class _RacedOnce(go.Figure):
    """A real figure that kaleido fails to draw the first time, as when it runs a chart before its tab's page loaded."""

    def to_dict(self):
        if not getattr(self, "_raced", False):
            object.__setattr__(self, "_raced", True)
            raise RuntimeError("{'description': 'ReferenceError: kaleido_scopes is not defined'}")
        return super().to_dict()


class _Broken(go.Figure):
    def to_dict(self):
        raise RuntimeError("chart cannot be drawn")


def test_png_export_draws_again_in_a_fresh_browser_after_kaleidos_page_race_and_nothing_else(tmp_path, caplog):
    raced = _RacedOnce(go.Scatter(x=[1, 2], y=[2, 1]))
    with pytest.raises(RuntimeError, match="chart cannot be drawn"):
        export_pngs([("raced", raced), ("broken", _Broken())], str(tmp_path))
    assert (tmp_path / "raced.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by kaleido the second time
    assert "raced.png before its page had loaded" in caplog.text and "broken" not in caplog.text


def test_an_fp8_cell_that_ran_no_fp8_is_never_paired_as_fp8():
    """hf:gpt2 on torchao: its GEMMs are Conv1D, nothing converts, the trial records effective_precision bf16 and
    fp8_flop_share 0. The headline says so; no FP8 speedup, no bound row ("GEMMs 0.98x faster in FP8"). A cell
    that ran part of its FLOPs in FP8 keeps its speedup, with its share beside it."""
    from orchestrator.report.analysis import pair_cells
    from orchestrator.report.headline import headline
    from orchestrator.report.why import bounds
    from orchestrator.report.analysis import TRAIN_STEP
    from trials.measure.kernels import CLASSES

    kernels = {f"kernel_ms_{c}": 1.0 for c in CLASSES}
    recs = []
    for d, share, converted in ((256, 0.0, 0), (512, 0.4, 6)):
        fp8 = _rec(d, "torchao", "fp8", "tensorwise", 9.9)
        fp8.update(kernels, fp8_flop_share=share, fp8_converted_modules=converted)
        if not converted:  # as trials/workloads/training.py records it (trials.measure.metrics.fp8_ran)
            fp8.update(effective_precision="bf16", effective_recipe=None)
        bf16 = _rec(d, "torch", "bf16", None, 10.0)
        bf16.update(kernels, fp8_flop_share=0.0)
        recs += [fp8, bf16]
    recs.append(_rec(256, "torchao", "bf16", None, 20.0))  # a BF16 cell of that stack: a cell of its own
    df = prepare(pd.DataFrame(recs))
    assert sorted(df.loc[df["d_model"] == 256, "variant"]) == ["torch-bf16", "torchao-bf16",
                                                               "torchao-bf16-asked-fp8-tensorwise"]
    pairs = pair_cells(df)
    speedups = pairs.rows[pairs.rows["kind"] == "fp8_speedup"]
    assert list(speedups["d_model"]) == [512]  # the 256 cell is paired as nothing FP8
    assert list(bounds(df, pairs.rows, TRAIN_STEP)["d_model"]) == [512]
    lines = headline(df, pairs)
    assert any("torchao fp8 tensorwise ran no FP8 worth the name (0 modules converted, 0% of the step's FLOPs in "
               "FP8" in line and "not an FP8 result" in line for line in lines), lines
    assert any("at d_model 512" in line and "40% of its step's FLOPs ran in FP8" in line for line in lines), lines
    # eager torchao: the line says its casts fuse only under torch.compile (main: a bare "slower beyond noise")
    assert any("at d_model 512" in line and "eager: torchao's FP8 casts are fused only under torch.compile" in line
               for line in lines), lines
    df.loc[df["backend"].isin(["torchao", "torch"]), "compile"] = True
    compiled = headline(df, pair_cells(df))
    assert any("at d_model 512" in line for line in compiled) and not any("eager:" in line for line in compiled)
    only = headline(df[df["d_model"] == 256], pair_cells(df[df["d_model"] == 256]))
    assert "No cell ran in FP8." in only and "This run has no FP8 cells." not in only, only


def test_per_layer_fp8_reads_are_stored_charted_and_a_layer_under_its_floor_is_flagged(tmp_path):
    """Two FP8 cells' per-layer reads (trials/fp8_layers.record_fields, as a trial writes them) through the store:
    the report draws SQNR per layer forward and backward and the outlier trend, tabulates each cell's worst, and
    lists exactly the layer read under its floor (delayed's blocks.1.fc2 input gradient, 12 dB < 17 dB in one of
    its two samples, the median of the two over it: the lowest read is the one to see), with a layer FP8 left
    exact (inf dB) stored and read back as such."""
    from trials.measure.fp8_layers import CastHealth, LayerRead, OutlierTrend, record_fields

    store = Store(str(tmp_path), "numerics")
    store.ensure()
    modules = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    health = {cls: CastHealth(0.0, 0.0) for cls in ("act", "weight", "grad")}
    for recipe, dgrad, sample in (("delayed", [25.0, 24.0, 23.0, 12.0], 0), ("delayed", [25.0, 24.0, 23.0, 30.0], 1),
                                  ("current", [25.0, 24.0, 23.0, 22.0], 0)):
        reads = [LayerRead(m, {"fwd": 28.0 - i if i else float("inf"), "dgrad": dgrad[i], "wgrad": 24.0},
                           {**health, "grad": CastHealth(0.001 * i, 0.0)}) for i, m in enumerate(modules)]
        trend = OutlierTrend([0, 4, 9], {m: [3.0, 4.0 + i, 5.0 + i] for i, m in enumerate(modules)},
                             {m: [3.0, 3.5, 4.0 + i] for i, m in enumerate(modules)})
        rec = _rec(256, "te", "fp8", recipe, 8.0, sample=sample)
        rec.update(record_fields(reads, trend), fp8_layers_s=0.5, outliers_s=0.25)
        store.write_record(rec)
    store.write_record(_rec(256, "te", "bf16", None, 10.0))
    report = build_report(store.root)
    html = open(report.html_path).read()
    for chart in ("fp8_sqnr_forward", "fp8_sqnr_backward", "fp8_outliers"):
        assert html.count(f'id="chart-{chart}"') == 1, chart
    md = open(report.md_path).read()
    table = md[md.index("## FP8 numerics per layer"):].split("\n## ")[0]
    row = next(line for line in table.splitlines() if line.startswith("| d256-te-fp8-delayed"))
    assert "| 12.0 | blocks.1.fc2 |" in row and "| 0.003 |" in row and "| 0.75 |" in row  # dgrad min, grad underflow, cost
    low = md[md.index("## FP8 layers below the SQNR floor"):].split("\n## ")[0]
    flagged = [line for line in low.splitlines() if line.startswith("| d256")]
    assert flagged == ["| d256-te-fp8-delayed | blocks.1.fc2 | dgrad | 12.0 | 1 of 2 | 17.0 |"]
    from orchestrator.report.numerics import below_floor, layer_frame

    layers = layer_frame(prepare(store.read_records().to_pandas()))
    assert layers[(layers["module"] == "blocks.0.fc1") & (layers["direction"] == "fwd")]["sqnr_db"].tolist() == \
        [float("inf")] * 2
    [median] = layers[(layers["cell"] == "d256-te-fp8-delayed") & (layers["module"] == "blocks.1.fc2")
                      & (layers["direction"] == "dgrad")]["sqnr_db"]
    assert median == 21.0  # the chart's line: the median of 12 and 30
    # every layer over its floor: none listed (an H100 study's report listed all 168 of its reads, empty)
    assert below_floor(layers[layers["under"] == 0]).empty


def test_loss_gap_per_learning_rate_against_the_references_seed_noise(tmp_path):
    """Issue 46 item 4 over real CPU trials (BF16 against FP32: no FP8 runs on this CPU cheaply): two learning
    rates, two seeds each. The gap is the median over seeds of the per-seed loss difference (the cells share each
    seed's init and batches), and the verdict follows the stated rule: within the reference's seed noise when
    |gap| <= SEED_NOISE_SDS x the reference's seed sd, else outside by the excess."""
    import gc

    import numpy as np

    from orchestrator.report.analysis import SEED_NOISE_SDS
    from trials.trial import run_trial

    store = Store(str(tmp_path), "gap")
    store.ensure()
    tiny = dict(d_model=32, n_layers=1, seq_len=16, batch_size=4, train_steps=3, warmup_steps=1, bench_steps=1,
                repeats=1, gen_len=1, device="cpu", profile=False, backend="torch")
    losses = {}
    gc.freeze()  # each trial ends in gc.collect (trials/measure/memory.py): of the trials' objects, not this process's 300k
    try:
        for lr in (1e-3, 1e-2):
            for precision in ("fp32", "bf16"):
                for sample, seed in enumerate((11, 12)):
                    rec = run_trial(TrialSpec(precision=precision, lr=lr, seed=seed, **tiny))
                    assert rec["status"] == "ok", rec["error"]
                    losses[lr, precision, seed] = rec["loss_final"]
                    store.write_record({**rec, "cell_id": f"{precision}-{lr}", "cell_label": f"{precision}-{lr}",
                                        "sample": sample})
    finally:
        gc.unfreeze()
    report = build_report(store.root)
    rows = _md_section(open(report.md_path).read(), "Loss gap against seed noise")
    assert sorted(float(r["lr"]) for r in rows) == [1e-3, 1e-2]  # one row per learning rate
    for r in rows:
        lr = float(r["lr"])
        diffs = [losses[lr, "bf16", s] - losses[lr, "fp32", s] for s in (11, 12)]
        gap, sd = float(np.median(diffs)), float(np.std([losses[lr, "fp32", s] for s in (11, 12)], ddof=1))
        assert (r["variant"], r["vs"], r["seeds"]) == ("torch-bf16", "torch-fp32", "2")
        assert float(r["gap"]) == pytest.approx(gap, rel=5e-3)  # three significant figures
        assert float(r["seed sd"]) == pytest.approx(sd, rel=5e-3)
        assert float(r["gap CI low"]) <= float(r["gap"]) <= float(r["gap CI high"])
        excess = abs(gap) - SEED_NOISE_SDS * sd
        assert r["verdict"] == ("within FP32's seed noise" if excess <= 0 else f"outside by {excess:.3g} nats")
    html = open(report.html_path).read()
    assert html.count('id="chart-loss_gap"') == 1


def test_a_headline_over_cells_of_one_size_names_what_tells_them_apart():
    """Full depth at seq 256 and at seq 4096 (batch 1, full checkpointing): two pairs at one d_model x n_layers.
    The sentence names the best one's seq_len, batch_size and checkpointing (main: "at d_model 4096 x 32 layers",
    either cell) and counts "settings", not sizes; over sizes alone it names none of them."""
    from orchestrator.report.analysis import pair_cells
    from orchestrator.report.headline import headline

    recs = []
    for seq, batch, ac, fp8_ms in ((256, 8, "none", 12.0), (4096, 1, "full", 8.0)):
        for backend, precision, recipe, ms in (("te", "fp8", "delayed", fp8_ms), ("te", "bf16", None, 10.0)):
            rec = _rec(512, backend, precision, recipe, ms)
            rec.update(seq_len=seq, batch_size=batch, tokens_per_step=seq * batch, activation_checkpointing=ac,
                       cell_id=f"{rec['cell_id']}-{seq}")
            recs.append(rec)
    df = prepare(pd.DataFrame(recs))
    line = next(x for x in headline(df, pair_cells(df)) if "te-fp8-delayed vs te-bf16" in x)
    assert "best 1.25x" in line and "at d_model 512 x 2 layers, seq_len 4096, batch_size 1, activation_checkpointing " \
        "full (" in line and "0 of 2 settings faster beyond noise, 2 not judged" in line and "tokens_per_step" not in \
        line, line
    one = df[df["seq_len"] == 256]
    line = next(x for x in headline(one, pair_cells(one)) if "te-fp8-delayed vs te-bf16" in x)
    assert "at d_model 512 x 2 layers (" in line and "0 of 1 sizes faster beyond noise" in line, line


def test_a_minigpt_only_field_names_no_other_model_source():
    """An hf:llama record keeps the spec's arch default ("gpt"): beside a MiniGPT-llama row it made the series
    "arch=gpt model=hf:llama" in the H100 numerics study's report."""
    rows = []
    for spec in (TrialSpec(model="minigpt", arch="llama", d_model=64, n_layers=2),
                 TrialSpec(model="hf:llama", d_model=64, n_layers=2)):
        rows.append({**empty_record(), **spec.to_dict()})
    df = prepare(pd.DataFrame(rows))
    assert list(df["arch"]) == ["llama", None]
    assert not any("arch=gpt" in s for s in df["series"]), list(df["series"])


# -- what the report's answers may claim (crossover, intervals, pairing keys) --------------------------------------

def test_the_crossover_is_where_fp8_stays_above_one_not_its_first_upward_crossing():
    """The H200 eager grid read 0.88, 1.08, 0.99, 0.94, 1.41 over five sizes: the first crossing (sizes 1-2) was
    reported as "FP8 faster from here on" beside two sizes below 1.0 after it; it crosses for good after its
    last dip (sizes 4-5). A line that ends below 1.0 has no crossover."""
    from orchestrator.report.analysis import crossover

    xs, ys = [1e8, 1.5e8, 2e8, 2.5e8, 3.2e8], [0.88, 1.08, 0.99, 0.94, 1.41]
    t = (1.0 - 0.94) / (1.41 - 0.94)
    want = math.exp(math.log(2.5e8) + t * (math.log(3.2e8) - math.log(2.5e8)))
    assert crossover(xs, ys) == pytest.approx(want, rel=1e-12)
    assert crossover(xs[:4], ys[:4]) is None  # ends below 1.0
    assert crossover(xs[:2], ys[:2]) == pytest.approx(
        math.exp(math.log(1e8) + (0.12 / 0.20) * (math.log(1.5e8) - math.log(1e8))), rel=1e-12)


def test_sizes_count_as_faster_only_where_the_interval_clears_one():
    """Point estimates all >= 1.0, one interval holding 1 and one over steps: the headline counted 3 of 3 sizes
    faster and the crossover table said "FP8 faster at every size measured"."""
    from orchestrator.report.headline import best_of_each

    g = pd.DataFrame({"n_params": [1e8, 2e8, 3e8], "ratio": [1.01, 1.2, 1.3], "ci_low": [0.95, 1.1, 1.25],
                      "ci_high": [1.07, 1.3, 1.35], "ci_method": ["samples", "samples", "steps"],
                      "candidate": "te-fp8-delayed", "reference": "te-bf16", "candidate_stack": "te",
                      "d_model": [512, 768, 1024], "n_layers": 2, "cuda_graphs": False, "compile": False})
    [line] = best_of_each(g, "BF16")
    assert "1 of 3 sizes faster beyond noise, 1 within noise, 1 not judged (one sample a side)" in line, line

    from orchestrator.report.render import crossover_note

    note = crossover_note(None, g)
    assert "faster at every size" not in note
    assert note.endswith("1 of 3 sizes faster beyond noise, 1 within noise, 1 not judged (one sample a side)"), note
    assert crossover_note(None, g.assign(ci_method="samples", ci_low=[1.005, 1.1, 1.25])).startswith(
        "FP8 faster at every size measured")


def _coverage_misses(n_num: int, n_den: int, runs: int = 400, noise: float = 0.03) -> float:
    """Share of runs whose 95% interval excludes the true ratio 1: both sides drawn alike, lognormal noise."""
    import numpy as np

    from orchestrator.report.analysis import bootstrap_ratio

    rng = np.random.default_rng(7)
    misses = 0
    for _ in range(runs):
        a, b = 10 * np.exp(rng.normal(0, noise, n_num)), 10 * np.exp(rng.normal(0, noise, n_den))
        lo, hi = bootstrap_ratio(list(a), list(b), 1000, rng)
        misses += not lo <= 1.0 <= hi
    return misses / runs


def test_a_95_percent_interval_over_few_samples_holds_the_true_ratio_about_95_percent_of_the_time():
    """With 2 samples a side the percentile bootstrap's interval is [min/max, max/min]: it excluded a true ratio of
    1 in about a third of runs (3% noise). The stated 95% must hold about 95% at the sample counts sweeps run."""
    assert _coverage_misses(2, 2) <= 0.08
    assert _coverage_misses(3, 3) <= 0.08
    assert _coverage_misses(1, 3) <= 0.10  # one sample against several: the pooled spread stands for both


def test_the_t_quantile_matches_the_tables():
    from orchestrator.report.analysis import _t975

    assert [round(_t975(df), 3) for df in (1, 2, 10)] == [12.706, 4.303, 2.228]


def test_one_sample_a_side_is_never_called_faster_beyond_noise(tmp_path):
    """One sample per cell: the interval is one trial's steps, which says nothing of run-to-run noise (as
    compare_runs says); the headline shows it and calls no side."""
    import numpy as np

    from orchestrator.report.analysis import pair_cells
    from orchestrator.report.headline import fastest_per_model, headline

    df = prepare(synthetic(tmp_path).read_records().to_pandas())
    pairs = pair_cells(df)
    lines = headline(df, pairs)
    fp8 = [line for line in lines if line.startswith("te-fp8-")]
    assert len(fp8) == 2 and not any("beyond noise)" in line for line in fp8), fp8
    assert all("not judged" in line and "0 of 3 sizes faster beyond noise" in line for line in fp8), fp8
    two = df.assign(model=np.where(df["d_model"] == 256, "hf:llama", "minigpt"))
    assert not any("(beyond noise)" in line for line in fastest_per_model(two))


def test_uneven_sample_counts_get_an_interval_over_samples_that_holds_the_ratio(tmp_path):
    """BF16 with one sample left (the other timed out), FP8 with two: the ratio is over both FP8 samples, so its
    interval is too; the first FP8 sample's steps alone (12 ms) gave [0.81, 0.86] around a ratio of 1.0."""
    from orchestrator.report.analysis import pair_cells

    recs = [_rec(512, "te", "bf16", None, 10.0), _rec(512, "te", "bf16", None, 10.0, status="timeout", sample=1),
            _rec(512, "te", "fp8", "delayed", 12.0), _rec(512, "te", "fp8", "delayed", 8.0, sample=1)]
    rows = pair_cells(prepare(pd.DataFrame(recs))).rows
    [row] = rows[rows["kind"] == "fp8_speedup"].to_dict("records")
    assert row["ratio"] == pytest.approx(10.0 / 10.0)
    assert row["ci_method"] == "samples" and row["ci_low"] <= row["ratio"] <= row["ci_high"]


def _fp32_rec(spec: TrialSpec, ms: float) -> dict:
    """A te record of an hf: model (no MiniGPT parameter count for it)."""
    from orchestrator.sweep import cell_id, cell_label

    steps = [ms * j for j in JITTER]
    return {**empty_record(), **spec.to_dict(), "status": "ok", "effective_backend": "te",
            "effective_precision": spec.precision, "cell_id": cell_id(spec), "cell_label": cell_label(spec),
            "sample": 0, "n_params": 1000, "step_times_ms": steps, "step_ms_p50": float(pd.Series(steps).median())}


def test_an_hf_models_bf16_cells_pair_with_their_own_builds_fp32_and_a_missing_one_is_listed():
    """On hf: models TE's te_layer default is swap: te-bf16 (swap) is over te-fp32 (swap). Read with MiniGPT's
    default, te-bf16-transformer_layer paired with te-fp32 (swap) and te-bf16 vanished without a word."""
    from orchestrator.report.analysis import pair_cells
    from orchestrator.sweep import cell_id

    base = dict(model="hf:llama", d_model=64, n_layers=2, n_heads=4, vocab=96, backend="te")
    ms = {("swap", "bf16"): 10.0, ("swap", "fp32"): 15.0, ("transformer_layer", "bf16"): 8.0}
    specs = {key: TrialSpec(te_layer=key[0], precision=key[1], **base) for key in ms}
    df = prepare(pd.DataFrame([_fp32_rec(specs[key], t) for key, t in ms.items()]))
    variant = {key: df.loc[df["cell_id"] == cell_id(spec), "variant"].iloc[0] for key, spec in specs.items()}
    pairs = pair_cells(df)
    got = pairs.rows[pairs.rows["kind"] == "bf16_speedup"]
    assert [(r.candidate, r.reference) for r in got.itertuples()] == [(variant[("swap", "bf16")],
                                                                      variant[("swap", "fp32")])]
    assert got["ratio"].iloc[0] == pytest.approx(15.0 / 10.0)
    missing = pairs.unpaired[pairs.unpaired["kind"] == "bf16_speedup"]
    assert list(missing["cell"]) == [variant[("transformer_layer", "bf16")]]


def test_a_knob_comparison_never_sets_one_stacks_recipe_against_anothers():
    """torchao rowwise (over the twin's BF16) beside TE delayed (over TE BF16) at one shape: the recipes compared
    are within a stack (te current vs delayed), never rowwise vs delayed across stacks."""
    from orchestrator.report.analysis import knob_effects, pair_cells

    ms = {("te", "bf16", None): 10.0, ("te", "fp8", "delayed"): 8.0, ("te", "fp8", "current"): 8.5,
          ("torch", "bf16", None): 12.0, ("torchao", "fp8", "rowwise"): 25.0, ("torchao", "fp8", "tensorwise"): 24.0}
    recs = [_stack_rec(1024, backend, precision, recipe, t * j, sample=s)
            for (backend, precision, recipe), t in ms.items() for s, j in enumerate((1.0, 1.01))]
    table, findings = knob_effects(pair_cells(prepare(pd.DataFrame(recs))).rows)
    said = [f.split(" — ")[0] for f in findings]
    assert len(said) == 2 and any("te FP8" in f and "recipe current vs delayed" in f for f in said), said
    assert any("torchao FP8" in f and "recipe tensorwise vs rowwise" in f for f in said), said
    assert set(zip(table["value"], table["BF16 partner"])) == {("delayed", "te-bf16"), ("current", "te-bf16"),
                                                               ("rowwise", "torch-bf16"), ("tensorwise", "torch-bf16")}


def test_compare_of_inference_runs_reads_the_decode_step(tmp_path):
    """Infer records have no step_ms_p50: a comparison read it and called every shared cell 'within noise' on NaN."""
    def run(root: str, slow: float, drop: bool) -> pd.DataFrame:
        recs = []
        for precision, ms in (("bf16", 2.0), ("fp8", 1.5)):
            spec = TrialSpec(workload="infer", d_model=256, n_layers=2, batch_size=8, backend="te", precision=precision,
                             prompt_len=16, gen_len=16)
            for s, j in enumerate((1.0, 1.01)):
                rec = _infer_rec(spec, ms * j * (slow if precision == "fp8" else 1.0), 5.0, 1000, None)
                if drop and precision == "bf16":
                    rec["decode_ms_per_token_p50"] = None
                recs.append({**rec, "sample": s})
        return prepare(pd.DataFrame(recs))

    cmp = compare_runs(run("a", 1.0, False), run("b", 1.5, False)).set_index("variant")
    assert cmp.loc["te-fp8-delayed", "ratio_b_over_a"] == pytest.approx(1.5)
    assert bool(cmp.loc["te-fp8-delayed", "changed"]) and cmp.loc["te-bf16", "verdict"] == "within noise"
    assert cmp.loc["te-bf16", "ratio_b_over_a"] == pytest.approx(1.0)
    none = compare_runs(run("a", 1.0, False), run("b", 1.0, True)).set_index("variant")
    assert none.loc["te-bf16", "verdict"].startswith("no timing") and not none.loc["te-bf16", "changed"]


def test_cells_of_other_world_sizes_are_never_the_fastest_bf16_of_a_shape():
    """batch_size is per rank: a 2-rank FSDP step does twice the work of a 1-rank one. Set against each other
    under one shape, the 2-rank FP8 cell read 10/9.6 over a 1-rank BF16 instead of 12/9.6 over its own."""
    from orchestrator.report.analysis import against_fastest_bf16
    from orchestrator.report.headline import fastest_per_model

    recs = []
    for world, parallel, bf16, fp8 in ((1, "none", 10.0, 9.0), (2, "fsdp", 12.0, 9.6)):
        for precision, ms in (("bf16", bf16), ("fp8", fp8)):
            for s, j in enumerate((1.0, 1.01)):
                rec = _rec(512, "te", precision, "delayed" if precision == "fp8" else None, ms * j, sample=s)
                rec.update(world_size=world, parallel=parallel, cell_id=f"{rec['cell_id']}-w{world}")
                recs.append(rec)
    df = prepare(pd.DataFrame(recs))
    rows, _ = against_fastest_bf16(df)
    by = rows.set_index(["world_size", "variant"])
    assert by.loc[(2, "te-fp8-delayed"), "ratio"] == pytest.approx(12.0 / 9.6)
    assert by.loc[(1, "te-fp8-delayed"), "ratio"] == pytest.approx(10.0 / 9.0)
    two = pd.concat([df, df.assign(model="hf:llama", cell_id=df["cell_id"] + "-hf")], ignore_index=True)
    [line] = [x for x in fastest_per_model(two) if x.startswith("Fastest cell of minigpt")]
    assert "world_size 1" in line and "world_size 2" in line and "next of its 2 cells" in line, line


def test_a_median_over_two_seeds_gets_a_t_interval_inside_what_the_field_can_be():
    """The loss gap over two seeds and the teacher-forced fields over two samples: the bootstrap of two values is
    [min, max] whatever they are (as the ratio's was); under SMALL_SAMPLE values the interval is Student's t,
    clipped to the field's range (a share in [0, 1], KL >= 0). From SMALL_SAMPLE values on it stays the
    bootstrap's, inside the values' range."""
    from orchestrator.report.analysis import SMALL_SAMPLE, bootstrap_median

    rng = np.random.default_rng(0)
    gaps = [-0.011494, 0.06545]  # fp8-numerics-shapes' MiniGPT torchao gap over two seeds
    lo, hi = bootstrap_median(gaps, 2000, rng)
    assert lo < min(gaps) and hi > max(gaps)  # before: exactly [min, max]
    lo, hi = bootstrap_median([0.97, 1.0], 2000, rng, (0.0, 1.0))
    assert lo < 0.97 and hi == 1.0  # a share never above 1
    lo, hi = bootstrap_median([0.001, 0.02], 2000, rng, (0.0, math.inf))
    assert lo == 0.0 and hi > 0.02  # a KL never below 0
    many = list(np.linspace(1.0, 2.0, SMALL_SAMPLE))
    lo, hi = bootstrap_median(many, 2000, rng)
    assert min(many) <= lo < hi <= max(many)


def test_the_reports_medians_and_intervals_are_numpys_to_the_bit():
    """The report takes its medians, each bootstrap resample's, and the 2.5/97.5 percentiles of the resamples in
    plain Python or from one sort (numpy's per-call cost was most of a 10k-record report's time): every interval
    and table value must stay numpy's, at odd and even lengths, ties, an inf, a NaN (then NaN) and none."""
    from orchestrator.report.analysis import _median, _middle_95, _resampled_medians

    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 4, 5, 10, 11, 30, 100):
        values = rng.lognormal(size=n) * 10.0 ** rng.integers(-3, 4)
        values[n // 2] = values[0]  # a tie at the middle
        assert _median(list(values)) == float(np.median(values))
        draws = np.random.default_rng(n).integers(0, n, (400, n))  # the draws the resamples take, in order
        assert (_resampled_medians(values, 400, np.random.default_rng(n)) == np.median(values[draws], axis=1)).all()
    for n in (1, 2, 3, 17, 200, 399, 400, 1000, 1337, 2000):  # resample counts run from 200 to 2000
        ratios = rng.lognormal(size=n)
        ratios[-1] = np.inf if n > 3 else ratios[-1]  # a median of zero below a ratio
        with np.errstate(invalid="ignore"):  # numpy's own inf - inf on the way
            assert np.array_equal(_middle_95(ratios), np.percentile(ratios, [2.5, 97.5]), equal_nan=True)
    assert math.isnan(_median([1.0, float("nan"), 2.0])) and math.isnan(_median([]))
    with_nan = np.array([1.0, np.nan, 2.0])
    assert all(math.isnan(v) for v in _middle_95(with_nan))
    draws = np.random.default_rng(0).integers(0, 3, (50, 3))
    assert np.array_equal(_resampled_medians(with_nan, 50, np.random.default_rng(0)),
                          np.median(with_nan[draws], axis=1), equal_nan=True)


def test_graphed_cells_against_their_eager_twins_speed_cost_and_loss_at_the_same_seed(tmp_path):
    """Issue 56 item 2 from records: each cuda_graphs cell beside its eager twin. The speedup is the eager median over
    the graphed one's; the loss curves are compared step by step at each seed both ran (a graphed cell whose curve
    moved at one step of one seed shows that step's relative difference); a graphed cell that ran eager says why."""
    store = Store(str(tmp_path), "graphs")
    store.ensure()
    eager_ms, graphed_ms, moved = [10.0, 10.4, 9.8], [7.0, 7.3, 6.9], 0.004
    curve = lambda seed: [4.0, 2.5, 2.0 + 0.01 * (seed - 1234)]  # noqa: E731

    def rec(spec: TrialSpec, sample: int, ms: float, **extra):
        seed = spec.seed + sample
        r = empty_record() | spec.to_dict() | dict(
            status="ok", effective_backend=spec.backend, effective_precision=spec.precision, seed=seed, sample=sample,
            cell_id=f"{spec.backend}-{spec.precision}-{spec.cuda_graphs}", step_ms_p50=ms,
            cell_label=f"d256-{spec.backend}-{spec.precision}" + ("-graphs" if spec.cuda_graphs else ""),
            step_times_ms=[ms * j for j in JITTER], loss_curve=curve(seed), loss_final=curve(seed)[-1])
        return r | extra

    eager, graphed = (TrialSpec(d_model=256, n_layers=2, backend="torch", precision="bf16", cuda_graphs=g)
                      for g in (False, True))
    for sample in range(3):
        store.write_record(rec(eager, sample, eager_ms[sample]))
        losses = curve(graphed.seed + sample)
        if sample == 1:
            losses[1] *= 1 + moved
        store.write_record(rec(graphed, sample, graphed_ms[sample], loss_curve=losses, graphs_per_step=4,
                               graph_capture_s=2.5, graph_pool_bytes=3 * 2**30, est_graph_pool_bytes=2 * 2**30,
                               peak_mem_allocated_bytes=10 * 2**30, graph_pool_free_bytes=2**30,
                               est_peak_mem_bytes=12 * 2**30))
    for graphs in (False, True):  # a graphed cell whose curve is the eager one's at every step of one seed
        same = TrialSpec(d_model=512, n_layers=2, backend="torch", precision="bf16", cuda_graphs=graphs)
        store.write_record(rec(same, 0, 9.0, cell_id=f"same-{graphs}",
                               cell_label="d512-torch-bf16" + ("-graphs" if graphs else "")))
    moe = TrialSpec(d_model=256, n_layers=2, backend="torch", precision="fp32", cuda_graphs=True)
    store.write_record(rec(moe, 0, 12.0, graphs_per_step=0, cuda_graphs_why="unit h.0 holds MoE experts; the step "
                           "ran eager"))
    md = open(build_report(store.root).md_path).read()
    rows = {r["cell"]: r for r in _md_section(md, "Graphed against eager")}
    held = next(r for r in _md_section(md, "All cells") if r["cell_label"] == "d256-torch-bf16-graphs")
    # the pool's free bytes are held too: 12 GiB planned over 10 allocated + 1 free
    assert (float(held["peak_gib"]), float(held["est_over_peak"])) == (11, pytest.approx(12 / 11, rel=1e-3))
    row = rows["d256-torch-bf16-graphs"]
    assert row["eager twin"] == "d256-torch-bf16" and row["seeds compared"] == "3" and row["CI over"] == "samples"
    assert float(row["speedup"]) == pytest.approx(np.median(eager_ms) / np.median(graphed_ms), rel=5e-3)
    assert float(row["loss curve: largest rel. diff"]) == pytest.approx(moved, rel=5e-3)
    assert (float(row["graphs per step"]), float(row["pool GiB"]), float(row["planned pool GiB"])) == (4, 3, 2)
    assert row["loss verdict"] == "within the eager cell's seed noise"
    assert rows["d512-torch-bf16-graphs"]["loss verdict"] == "equal to the eager curve at every step (1 seed)"
    assert rows["d256-torch-fp32-graphs"]["note"] == "ran eager: unit h.0 holds MoE experts; the step ran eager"
    assert rows["d256-torch-fp32-graphs"]["eager twin"] == "not in this run"
