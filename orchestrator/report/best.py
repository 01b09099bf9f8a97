"""The report's "Best against best" sections: what a ``find: best`` search (orchestrator/best.py) found.

Per side, the winning setting and its tokens/s with the 95% interval, the settings timed in full beside it (those
within noise of it are the runner-ups), what was counted out (cells the memory plan said will not fit, with its
margin; cells that ran out of memory; combinations that name no cell), and the GPU-seconds the search spent
against the exhaustive grid's; then why the two winners are as fast as they are: their kernel breakdowns side by
side (the records' ``kernel_ms_<class>``, as the report's "Where the step goes" reads them).
"""

from __future__ import annotations

import pandas as pd

from ..answer import BestAnswer
from .analysis import TRAIN_STEP
from .why import breakdown


def sections(found: BestAnswer, train: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """The sections, in the order the report shows them: the sides, every setting timed in full, the winners' why."""
    out = [("Best against best", f"{found.statement}. {spent(found)}", sides_table(found)),
           ("Best against best: every setting timed in full",
            "per side, fastest first; 'vs winner' is the setting's step time over the winner's with its 95% interval "
            "over samples: one that holds 1 is a runner-up within noise", timed_table(found))]
    why = why_table(found, train)
    if not why.empty:
        out.append(("Best against best: why", "ms per optimizer step by kernel class of each side's winner (medians "
                    "over samples) and the gap to the timed step: where one winner's step is shorter than the other's",
                    why))
    return out


def spent(found: BestAnswer) -> str:
    """The search's GPU-seconds against the exhaustive grid's, in a sentence."""
    unit = "GPU" if found.device else "CPU"
    line = f"The search ran {found.trials} trials, {found.gpu_seconds:.0f} {unit}-seconds"
    if found.grid_gpu_seconds:
        line += (f"; the exhaustive grid of the same cells would run {found.grid_trials} trials, about "
                 f"{found.grid_gpu_seconds:.0f} {unit}-seconds (estimated from the trials' walls): "
                 f"{found.gpu_seconds / found.grid_gpu_seconds:.0%} of it")
    if found.unfit:
        line += (f". {found.unfit} cells were never run: the memory plan says they will not fit (a GPU cell over "
                 f"{found.fit_margin}x the GPU's memory, the plan's error margin; a CPU cell over the host's RAM)")
    elif found.fit_margin is None:
        line += ". No cell was held against the memory plan (--no-fit-check, or no memory known to hold it to)"
    return line + "."


def sides_table(found: BestAnswer) -> pd.DataFrame:
    rows = []
    for side in found.sides:
        row = {"side": side.label, "winning setting": side.winner.setting if side.winner else side.why}
        if side.winner is not None:
            rate, lo, hi = found.tokens_per_s(side)
            row.update({"tokens/s": rate, "CI low": lo, "CI high": hi, "step ms": side.winner.median_ms,
                        "samples": len(side.winner.ms)})
        row.update({"runner-ups within noise": "; ".join(c.setting for c in side.runners_up) or "-",
                    "timed in full": len(side.timed), "screened": side.screened,
                    "ran out of memory": side.does_not_fit, "skipped: will not fit": side.unfit,
                    "no such cell": side.invalid, "out": "; ".join(side.out) or "-"})
        rows.append(row)
    return pd.DataFrame(rows).round(2)


def timed_table(found: BestAnswer) -> pd.DataFrame:
    rows = []
    for side in found.sides:
        for c in side.timed:
            rows.append({"side": side.label, "setting": c.setting, "step ms": c.median_ms, "samples": len(c.ms),
                         "vs winner": 1.0 if c is side.winner else c.median_ms / side.winner.median_ms
                         if side.winner else None,
                         "CI low": c.ci_low, "CI high": c.ci_high,
                         "verdict": "winner" if c is side.winner else "within noise" if c.within_noise else "slower",
                         "launch-bound": c.launch_bound})
    return pd.DataFrame(rows).round(3)


def why_table(found: BestAnswer, train: pd.DataFrame) -> pd.DataFrame:
    """Kernel class (rows) by side winner (columns): ms per step, from the records of the winners' cells (each by
    its cell id: cells of one label differ in the searched settings, batch size among them)."""
    if train.empty or "cell_id" not in train:
        return pd.DataFrame()
    columns, order = {}, []
    for side in found.sides:
        if side.winner is None:
            continue
        table = breakdown(train[train["cell_id"] == side.winner.cell_id], TRAIN_STEP)
        if table.empty:
            continue
        metrics = list(table.columns[list(table.columns).index("device") + 1:])
        for i, metric in enumerate(metrics):  # each where its table puts it (gemm_fp32 before gemm_bf16)
            if metric not in order:
                order.insert(order.index(metrics[i - 1]) + 1 if i else 0, metric)
        columns[side.label] = table.iloc[0][metrics].astype(float)  # one row: the winner's cell
    if not columns:
        return pd.DataFrame()
    out = pd.concat(columns, axis=1).reindex(order)
    out.index.name = "ms per step"
    return out.reset_index().round(3)
