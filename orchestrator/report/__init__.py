"""Scaling report: records -> pairing and intervals -> plotly charts -> one offline HTML file,
plus a PNG per chart, ``results.md`` and ``results.csv``.

    build_report("juicytalk-results/seed")                     # writes seed/report.html etc.
    build_report(dir_a, compare_dir=dir_b)                     # adds the A/B comparison
    build_report("s3://bucket/prefix/seed")                    # reads there, writes report.html etc. there too
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from trials.record.atomic import write_text_atomic

from ..answer import BestAnswer
from ..answer import load as load_answer
from ..store import Store, is_uri, read_results
from .analysis import (DECODE_STEP, NO_TIMING, ONE_SAMPLE, TRAIN_STEP, Pairs, against_fastest_bf16, compare_runs, crossover, pair_cells,
                       prepare, ways_that_ran)
from .headline import headline
from . import best, graphs, numerics
from .inference import inference_pairs, split
from .why import breakdown, gap_name


def search_table(found: Any) -> pd.DataFrame:
    """The crossover search's probes (an :class:`~orchestrator.answer.Answer`), one row each."""
    rows = [{found.axis: p.x, "speedup": p.ratio, "CI low": p.ci_low, "CI high": p.ci_high, "samples": p.samples,
             "verdict": p.verdict, "why": p.why} for p in found.probes]
    return pd.DataFrame(rows).round(3)

log = logging.getLogger(__name__)


class ReportInputError(ValueError):
    """The report's input cannot be read (no such directory, no records)."""


@dataclass
class Report:
    html_path: str
    md_path: str
    csv_path: str
    png_paths: list[str] = field(default_factory=list)
    pairs: Pairs | None = None
    headline: list[str] = field(default_factory=list)  # the answer for this run, in sentences
    warnings: list[str] = field(default_factory=list)  # one line each, for the CLI

    @property
    def other_paths(self) -> list[str]:
        return [self.md_path, self.csv_path, *self.png_paths]


def side_names(a: str, b: str) -> tuple[str, str]:
    """Names that tell the two sides of a comparison apart: the folders' names, or their whole paths when
    the names are the same (two runs of one sweep file, in different output folders)."""
    left, right = (Path(p).expanduser().resolve() for p in (a, b))
    left, right = (p.parent if p.is_file() else p for p in (left, right))
    return (left.name, right.name) if left.name != right.name else (str(left), str(right))


def _load(path: str) -> pd.DataFrame:
    if not is_uri(path) and not Path(path).exists():
        raise ReportInputError(f"DIR: {path} does not exist (a sweep directory or a results.parquet)")
    try:
        table = read_results(path)
    except (FileNotFoundError, OSError, pa.ArrowException) as exc:
        raise ReportInputError(f"DIR: {path}: {str(exc).splitlines()[0]}") from None
    if table.num_rows == 0:
        raise ReportInputError(f"DIR: {path} holds no trial records")
    return prepare(table.to_pandas())


def build_report(path: str, out_html: str | None = None, png_dir: str | None = None,
                 compare_dir: str | None = None, sweep_text: str | None = None, plotlyjs: str | None = None) -> Report:
    # plotly only here: the headline (``answer``) works on GPU hosts that have no plotly
    from . import charts
    from .render import export_pngs, markdown_tables, summary_sections, write_csv, write_html

    t0 = time.perf_counter()
    remote = Store.at(path) if is_uri(path) else None  # results on object storage (s3://...)
    if remote is not None and remote.local:  # file://: a local directory after all
        path, remote = remote.root, None
    src = Path(path).expanduser().resolve() if remote is None else None
    base_dir = (src if src.is_dir() else src.parent) if src is not None else None
    where = str(src) if src is not None else path
    df = _load(where)

    def beside(name: str) -> str | None:  # a file of the sweep directory, wherever it is
        if remote is not None:
            return remote.read_text(name)
        return (base_dir / name).read_text() if (base_dir / name).is_file() else None

    search = beside("search.json")
    found = load_answer(search) if search is not None else None
    # a best search's answers read the cells it timed in full, not its screens (every trial counts in its status)
    train, infer = split(df[df["cell_id"].isin(found.timed_cell_ids())] if isinstance(found, BestAnswer) else df)
    pairs = pair_cells(train)
    fastest = (against_fastest_bf16(train, cells=pairs.cells) if ways_that_ran(train) > 1
               else (pd.DataFrame(), pd.DataFrame()))

    if sweep_text is None:
        sweep_text = beside("sweep.yaml")

    steps, tokens = breakdown(train, TRAIN_STEP), breakdown(infer, DECODE_STEP)  # empty where nothing was profiled
    figures = [] if train.empty else [
        speedup_figure(pairs, train),
        *([("vs_fastest_bf16", charts.fastest_chart(fastest[0]))] if not fastest[0].empty else []),
        *([("step_breakdown", charts.breakdown_chart(steps, "Where the training step goes: ms per step by kernel "
                                                     f"class, and the {gap_name(steps).split(' (')[0]}"))]
          if not steps.empty else []),
        ("step_time", charts.step_time_chart(train)),
        ("throughput", charts.throughput_chart(train)),
        ("mfu", charts.mfu_chart(train)),
        ("memory", charts.memory_chart(train)),
        ("loss_curves", charts.loss_chart(train)),
        *([("loss_gap", charts.loss_gap_chart(pairs))]  # where some partner's seed noise is known (samples >= 2)
          if not pairs.rows.empty and "loss_seed_sd" in pairs.rows and pairs.rows["loss_seed_sd"].notna().any()
          else []),
        *numerics.figures(train),  # per-layer FP8 SQNR and outliers, where cells read them
    ]
    inference = inference_pairs(infer)
    if inference is not None:
        figures += [
            ("decode_speedup", charts.speedup_chart(inference.decode, "FP8 decode speedup over BF16 of the same stack vs model "
                                                    "scale (95% "
                                                    "intervals)", "BF16 ms per decode step / FP8's")),
            ("decode_throughput", charts.decode_chart(infer)),
            *([("decode_breakdown", charts.breakdown_chart(tokens, "Where the decode step goes: ms per decode step by "
                                                           f"kernel class, and the {gap_name(tokens).split(' (')[0]}"))]
              if not tokens.empty else []),
            ("prefill_speedup", charts.speedup_chart(inference.prefill, "FP8 prefill speedup over BF16 of the same stack vs "
                                                     "model scale",
                                                     "BF16 prefill ms / FP8 prefill ms")),
        ]
    figures.append(("status", charts.status_chart(df)))
    comparison, warnings = None, []
    if compare_dir:
        other = _load(compare_dir)
        comparison = compare_runs(df, other)
        if comparison.empty:
            warnings.append(f"--compare: {where} and {compare_dir} share no cells (no cell id in both); "
                            "the report has no comparison")
        unjudged = int((comparison["verdict"] == ONE_SAMPLE).sum())
        if unjudged:
            warnings.append(f"--compare: {unjudged} of {len(comparison)} cells have one sample on a side, so no change "
                            f"is called for them ({ONE_SAMPLE})")
        untimed = int((comparison["verdict"] == NO_TIMING).sum())
        if untimed:
            warnings.append(f"--compare: {untimed} of {len(comparison)} cells: {NO_TIMING}")
        figures.append(("compare", charts.compare_chart(comparison, *side_names(where, compare_dir))))

    lines = headline(train, pairs) if not train.empty or infer.empty else []
    sections = (summary_sections(df, pairs, comparison, inference, fastest) + numerics.sections(train)
                + graphs.sections(train, pairs))
    if found is not None:  # a sweep with a search block: its answer first, then its sections
        lines = [f"{found.title}: {found.statement}"] + lines
        if isinstance(found, BestAnswer):
            sections[:0] = best.sections(found, train)
        else:  # the crossover's probes, as a chart
            figures.insert(0, ("crossover_search", charts.search_chart(found)))
            sections.insert(0, ("Crossover search", found.statement, search_table(found)))
    md = markdown_tables(df, sections, lines)
    upload = remote is not None and out_html is None  # written here first, then beside the records
    staging = tempfile.TemporaryDirectory(prefix="juicytalk-report-") if upload else None
    out_html = out_html or str(Path(staging.name if staging else base_dir) / "report.html")
    out_dir = Path(out_html).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = out_dir / "results.md", out_dir / "results.csv"
    write_text_atomic(md_path, md)
    write_csv(csv_path, pairs, comparison)
    write_html(out_html, figures, df, sections, sweep_text, plotlyjs, lines)
    pngs = export_pngs(figures, png_dir) if png_dir else []
    log.info("report built in %.2fs", time.perf_counter() - t0)
    if staging is not None:
        with staging:
            paths = []
            for local in (Path(out_html), md_path, csv_path):
                remote.write_text(remote.path(local.name), local.read_text())
                paths.append(remote.url(local.name))
        return Report(*paths, pngs, pairs, lines, warnings)
    return Report(str(out_html), str(md_path), str(csv_path), pngs, pairs, lines, warnings)


def speedup_figure(pairs: Pairs, train: pd.DataFrame) -> tuple[str, Any]:
    """The report's first chart: FP8 over BF16; in a run without FP8 cells but with BF16 and FP32 cells, BF16
    over FP32 (what such a run compares); an FP8 chart with nothing to show says why."""
    from . import charts

    kinds = set(pairs.rows["kind"]) if not pairs.rows.empty else set()
    has_fp8 = (train["precision"] == "fp8").any()
    if not has_fp8 and "bf16_speedup" in kinds:
        return "bf16_speedup", charts.speedup_chart(
            pairs, "BF16 speedup over FP32 of the same stack vs model scale (95% intervals)",
            "Speedup (FP32 step time / BF16 step time)", kind="bf16_speedup")
    unpaired = not pairs.unpaired.empty
    why = ("this run has no FP8 cells" if not has_fp8 else
           "no BF16 / FP8 pairs that both ran ok" + (" (see 'Unpaired cells')" if unpaired else ""))
    return "fp8_speedup", charts.speedup_chart(pairs, empty=why)


def answer(path: str) -> list[str]:
    """The headline of a result set without writing a report (``juicytalk sweep --no-report``)."""
    train, infer = split(_load(path))
    return headline(train, pair_cells(train)) if not train.empty or infer.empty else []


__all__ = ["Report", "ReportInputError", "answer", "build_report", "crossover", "pair_cells"]
