"""The report's "Graphed against eager" section: what CUDA-graphing a cell's training step did to it.

Each ``cuda_graphs`` cell beside its eager twin (every other field equal, the same variant): the step's speedup with
its 95% interval, what the capture cost and holds (seconds; the graphs' memory pool against the memory plan's), and
whether it trains as the eager cell does, which a graph that replays stale inputs or scales would break while still
looking fast: the largest relative difference of the two loss curves at a seed both ran, and the final-loss gap
against the eager cell's own seed-to-seed spread. A graphed cell that ran eager says why (``cuda_graphs_why``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trials.numbers import round_sig

from .analysis import (BOOTSTRAP_SEED, SHAPE_KEYS, CellStats, Pairs, _get, cell_interval, loss_gap_stats, shape_keys,
                       size_label)

Section = tuple[str, str, pd.DataFrame]  # title, note, table (as render.Section)
GRAPHS = SHAPE_KEYS.index("cuda_graphs")
GIB = 2.0**30


def curves(df: pd.DataFrame) -> dict[tuple, dict[int, list[float]]]:
    """(shape key, variant) -> seed -> the loss curve of each ok sample of that cell."""
    ok = df[(df["status"] == "ok") & df["loss_curve"].notna() & df["seed"].notna()]
    out: dict[tuple, dict[int, list[float]]] = {}
    for key, variant, seed, curve in zip(shape_keys(ok), ok["variant"], ok["seed"], ok["loss_curve"]):
        out.setdefault((key, variant), {})[int(seed)] = [float(v) for v in curve]
    return out


def largest_difference(a: dict[int, list[float]], b: dict[int, list[float]]) -> tuple[float | None, int]:
    """The largest relative difference of ``a``'s loss curve from ``b``'s over the steps of every seed both ran, and
    how many seeds that is."""
    shared = sorted(set(a) & set(b))
    diffs = [abs(x - y) / max(abs(y), 1e-12) for s in shared for x, y in zip(a[s], b[s])]
    return (max(diffs) if diffs else None), len(shared)


def _median(df: pd.DataFrame, field: str) -> float | None:
    values = df[field].dropna() if field in df else pd.Series(dtype=float)
    return float(values.median()) if not values.empty else None


def table(df: pd.DataFrame, pairs: Pairs) -> pd.DataFrame:
    """One row per graphed cell: its eager twin's step over its own, what the graphs cost and hold, and the loss."""
    rows: list[dict[str, Any]] = []
    if df.empty or "cuda_graphs" not in df or not df["cuda_graphs"].any():
        return pd.DataFrame()
    losses = curves(df)
    by_cell = {cell: part for cell, part in df[df["status"] == "ok"].groupby("cell_id")}
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    for shape, variants in pairs.cells.items():
        if not shape[GRAPHS]:
            continue
        twins = pairs.cells.get(shape[:GRAPHS] + (False,) + shape[GRAPHS + 1:], {})
        for name, graphed in variants.items():
            eager: CellStats | None = twins.get(name)
            record = graphed.record
            row: dict[str, Any] = {"cell": _get(record, "cell_label"),
                                   "size": size_label(_get(record, "d_model"), _get(record, "n_layers"))}
            if graphed.status != "ok":
                rows.append(row | {"eager twin": "-", "note": f"{graphed.status}: {_get(record, 'error') or ''}"})
                continue
            own = by_cell.get(_get(record, "cell_id"), pd.DataFrame())
            per_step = _median(own, "graphs_per_step")
            row.update({"graphs per step": per_step, "capture s": _median(own, "graph_capture_s"),
                        "pool GiB": _gib(_median(own, "graph_pool_bytes")),
                        "planned pool GiB": _gib(_median(own, "est_graph_pool_bytes"))})
            if per_step == 0:
                row["note"] = f"ran eager: {_get(record, 'cuda_graphs_why') or 'no reason recorded'}"
            if eager is None or eager.status != "ok":
                row["eager twin"] = "not in this run" if eager is None else f"{eager.status}"
                rows.append(row)
                continue
            lo, hi, over = cell_interval(eager, graphed, pairs.resamples, rng)
            diff, seeds = largest_difference(losses.get((shape, name), {}),
                                             losses.get((shape[:GRAPHS] + (False,) + shape[GRAPHS + 1:], name), {}))
            gap = loss_gap_stats(eager, graphed, pairs.resamples, rng, whose="the eager cell")
            verdict = gap.get("loss_gap_verdict")
            if diff == 0 and seeds:  # no spread is needed to judge a curve equal to the eager one at every step
                verdict = f"equal to the eager curve at every step ({seeds} seed{'s' if seeds > 1 else ''})"
            row.update({"eager twin": _get(eager.record, "cell_label"), "eager ms": eager.median_ms,
                        "graphed ms": graphed.median_ms, "speedup": eager.median_ms / graphed.median_ms,
                        "CI low": lo, "CI high": hi, "CI over": over,
                        "loss curve: largest rel. diff": diff, "seeds compared": seeds,
                        "final loss gap": gap.get("loss_gap"), "loss verdict": verdict})
            rows.append(row)
    return pd.DataFrame(rows)


def _gib(value: float | None) -> float | None:
    return None if value is None else value / GIB


def sections(df: pd.DataFrame, pairs: Pairs) -> list[Section]:
    out = table(df, pairs)
    if out.empty:
        return []
    note = ("each CUDA-graphed cell against its eager twin (the same cell, cuda_graphs false): speedup = the eager "
            "step's median over the graphed one's, with its 95% interval; capture seconds and the graphs' private "
            "memory pool, measured and as the memory plan has it; the largest relative difference of the two loss "
            "curves over every step of each seed both ran (same seed: same initial weights and batches), and the "
            "final-loss gap (graphed - eager) against the eager cell's seed-to-seed spread")
    for col in ("graphs per step", "seeds compared"):  # counts (a row without one: None, not a float column)
        if col in out:
            out[col] = pd.Series([None if v is None or v != v else int(v) for v in out[col]], index=out.index,
                                 dtype=object)
    for col in out.columns:
        if out[col].dtype.kind == "f":
            out[col] = [round_sig(v) for v in out[col]]  # three significant figures, as every number shown
    return [("Graphed against eager", note, out)]
