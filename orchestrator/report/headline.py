"""The report's first words: what this run says about the question, in a few sentences.

"Does FP8 pay off here?" gets its answer before any chart: the best measured FP8 speedup per FP8
variant with its interval, where FP8 could not run and why (in TE's or the device's own words), and
what the cells that did run compare instead. The sweep prints the same lines after its summary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from trials.backends import STACKS
from trials.numbers import fmt_sig

from .analysis import (BOOTSTRAP_SEED, MODE_KEYS, NOT_JUDGED, SHAPE_KEYS, CellStats, Pairs, cell_interval, cell_table,
                       execution_label, known, launch_bound_note, noise_side, verdict_counts)


def _reasons(frame: pd.DataFrame) -> list[str]:
    return sorted({str(e).splitlines()[0] for e in frame["error"].dropna()})


def _where(row: pd.Series, also: Sequence[str] = ()) -> str:
    """A size in words: its d_model and depth, or its parameter count where the model chose those itself, and
    ``also``'s settings (those that tell the rows of one sentence apart: seq_len, activation_checkpointing)."""
    d_model, layers = known(row["d_model"]), known(row["n_layers"])
    size = (f"{fmt_sig(row['n_params'] / 1e6)}M parameters" if d_model is None or layers is None
            else f"d_model {int(d_model)} x {int(layers)} layers")
    size += "".join(f", {k} {row[k]}" for k in also)
    return size + (" (CUDA graphs)" if row["cuda_graphs"] else "")


def _interval(row: pd.Series) -> str:
    """A pair row's 95% interval as the headline writes it after the ratio ('' where it has none)."""
    return f" [{fmt_sig(row['ci_low'])}, {fmt_sig(row['ci_high'])}]" if row["ci_low"] == row["ci_low"] else ""


def _varying(rows: pd.DataFrame) -> list[str]:
    """The shape, schedule and execution fields whose values differ among ``rows`` of one size (d_model and
    n_layers): a sentence over them names each, or its "at d_model 4096 x 32 layers" could be either of two cells
    (seq 256 or 4096). Fields that follow the size (n_heads, ffn) or others (tokens_per_step) never differ there."""
    keys = [k for k in SHAPE_KEYS if k in rows and k not in ("d_model", "n_layers", "cuda_graphs", "tokens_per_step")]
    if rows.empty or not keys:
        return []
    # one grouped count of every field at once: a count per field and size cost seconds at 10k records
    counts = rows[["d_model", "n_layers", *keys]].astype(str).groupby(["d_model", "n_layers"], dropna=False).nunique()
    return [k for k in keys if (counts[k] > 1).any()]


def best_of_each(rows: pd.DataFrame, reference: str) -> list[str]:
    """One sentence per candidate variant: its best ratio over ``reference`` (e.g. 'BF16') with the interval
    and verdict, how many sizes it wins, and whether launch-bound steps set those times."""
    lines: list[str] = []
    if rows.empty:
        return lines
    # several models (the ``model`` axis): one sentence per model and variant, never a best across models
    by_model = "model" in rows and rows["model"].nunique() > 1
    for key, g in rows.groupby(["model", "candidate"] if by_model else ["candidate"], sort=True):
        model, cand = key if by_model else (None, key[0])
        best = g.loc[g["ratio"].idxmax()]
        side = noise_side(best["ci_low"], best["ci_high"], best["ci_method"])
        verdict = {1: "faster beyond noise", -1: "slower beyond noise", 0: f"within noise of {reference}",
                   None: NOT_JUDGED}[side]
        also = _varying(g)
        line = (f"{model + ': ' if model else ''}{cand} vs {best['reference']}: best {fmt_sig(best['ratio'])}x{_interval(best)} at {_where(best, also)} "
                f"({verdict}); {verdict_counts(g, 'settings' if also else 'sizes')}")
        share = known(best.get("fp8_flop_share"))
        if reference == "BF16" and share is not None and share < FULL_SHARE:
            line += f"; {share:.0%} of its step's FLOPs ran in FP8 GEMMs (fp8_flop_share), the rest in BF16"
        stack = STACKS.get(str(best.get("candidate_stack")))
        if reference == "BF16" and stack is not None and stack.fp8_casts_need_compile and not known(best["compile"]):
            line += (f"; eager: {stack.name}'s FP8 casts are fused only under torch.compile, so this is not its best "
                     "(add compile: true)")
        bound = g[g["launch_bound"].fillna(False).astype(bool)] if "launch_bound" in g else g.iloc[:0]
        free = g.drop(bound.index)
        if best.name in bound.index and not free.empty:  # the best is the host's pace: say FP8's own beside it
            own = free.loc[free["ratio"].idxmax()]
            line += (f"; where the host did not set the steps: {fmt_sig(own['ratio'])}x{_interval(own)} at "
                     f"{_where(own, also)}")
        if not bound.empty:
            line += "; " + launch_bound_note(" and ".join(_where(r, also) for _, r in bound.sort_values("n_params").iterrows()))
        lines.append(line + ".")
    return lines


FULL_SHARE = 0.95  # an FP8 speedup whose cell ran less of its FLOPs in FP8 says how much (fp8_flop_share)


def not_fp8(df: pd.DataFrame) -> list[str]:
    """One sentence per model and asked FP8 variant whose cells finished ok but ran no FP8 worth the name
    (``effective_precision`` bf16, trials.measure.metrics.fp8_ran): they are BF16 results and are paired as nothing."""
    asked = df[(df["precision"] == "fp8") & (df["status"] == "ok") & (df["effective_precision"] != "fp8")]
    lines = []
    for (model, backend, recipe), g in asked.groupby(["model", "backend", "recipe"], sort=True, dropna=False):
        converted = {int(v) for v in g["fp8_converted_modules"].dropna()} if "fp8_converted_modules" in g else set()
        shares = g["fp8_flop_share"].dropna() if "fp8_flop_share" in g else g.iloc[:0, 0]
        lines.append(f"{model}: {backend} fp8 {recipe} ran no FP8 worth the name ("
                     + (f"{'/'.join(map(str, sorted(converted)))} modules converted, " if converted else "")
                     + (f"{shares.max():.0%} of the step's FLOPs in FP8" if len(shares) else "FP8 share unknown")
                     + f", {len(g)} trial{'s' if len(g) > 1 else ''}): recorded as BF16, not an FP8 result, "
                     "and paired with nothing (fp8_skipped_why says what stayed BF16 and why).")
    return lines


def fastest_per_model(df: pd.DataFrame) -> list[str]:
    """With several models in the run: one sentence per model, which of its cells (variant and execution mode)
    ran the step fastest at each of its sizes, and by how much it beat the next one (ratio of medians, 95%
    interval over samples, else over steps: not judged). Only cells of one model and one size (every shape field,
    world_size and parallel among them: batch_size is per rank) are ranked."""
    ok = df[df["status"] == "ok"]
    if "model" not in ok or ok["model"].nunique() < 2:
        return []
    size_at = [i for i, k in enumerate(SHAPE_KEYS) if k not in MODE_KEYS]
    ranks = [k for k in ("world_size", "parallel") if k in ok and ok[k].astype(str).nunique() > 1]  # named if they vary
    sizes: dict[str, dict[tuple, list[tuple[tuple, CellStats]]]] = {}
    for shape, variants in cell_table(ok).items():
        where = dict(zip(SHAPE_KEYS, shape))
        size = tuple(None if shape[i] != shape[i] else shape[i] for i in size_at)  # NaN never equals NaN
        for cell in variants.values():
            if cell.median_ms:
                sizes.setdefault(where["model"], {}).setdefault(size, []).append((shape, cell))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    lines = []
    for model, by_size in sorted(sizes.items()):
        parts = []
        for cells in by_size.values():
            ranked = sorted(cells, key=lambda sc: sc[1].median_ms)
            best, where = ranked[0][1], dict(zip(SHAPE_KEYS, ranked[0][0]))
            size = _where(pd.Series({**where, "n_params": best.n_params}), ranks)
            part = f"{best.variant} {execution_label(where)} at {size}, {fmt_sig(best.median_ms)} ms per step"
            if len(ranked) > 1:
                next_shape, runner = ranked[1]
                lo, hi, method = cell_interval(runner, best, 1000, rng)
                verdict = {1: "beyond noise", None: NOT_JUDGED}.get(noise_side(lo, hi, method), "within noise")
                part += (f", {fmt_sig(runner.median_ms / best.median_ms)}x [{fmt_sig(lo)}, {fmt_sig(hi)}] faster than "
                         f"the next of its {len(ranked)} cells, {runner.variant} "
                         f"{execution_label(dict(zip(SHAPE_KEYS, next_shape)))} ({verdict})")
            parts.append(part)
        lines.append(f"Fastest cell of {model}: " + "; ".join(parts) + ".")
    return lines


def headline(df: pd.DataFrame, pairs: Pairs) -> list[str]:
    """Sentences for the top of the report (training records; inference has its own section)."""
    if df.empty:
        return ["No training records in this result set."]
    ok = df[df["status"] == "ok"]
    ran = sorted(set(ok["variant"]))
    lines: list[str] = not_fp8(df)
    # FP8 cells: those that asked for it, less those that ran without it (counted above)
    fp8 = df[(df["precision"] == "fp8") & ~((df["status"] == "ok") & (df["effective_precision"] != "fp8"))]
    kinds = pairs.rows["kind"] if not pairs.rows.empty else pd.Series(dtype=str)
    rows = pairs.rows[kinds == "fp8_speedup"] if not pairs.rows.empty else pairs.rows
    if fp8.empty:
        lines.append("No cell ran in FP8." if lines else "This run has no FP8 cells.")  # lines: not_fp8's
    elif rows.empty:
        unsupported = fp8[fp8["status"] == "unsupported"]
        if len(unsupported) == len(fp8):
            lines.append(f"FP8 could not run on this machine: {'; '.join(_reasons(unsupported))}.")
        else:
            failed = fp8[fp8["status"] != "ok"]
            lines.append("No FP8 cell has a BF16 partner that ran: "
                         + ("; ".join(_reasons(failed)) if not failed.empty else "see 'Unpaired cells'") + ".")
    else:
        lines += best_of_each(rows, "BF16")
    if ran and (fp8.empty or rows.empty):
        precisions = sorted({str(p) for p in ok["effective_precision"].dropna()})
        lines.append(f"The cells that ran ({', '.join(ran)}) compare {' and '.join(precisions)}.")
        lines += best_of_each(pairs.rows[kinds == "bf16_speedup"] if not pairs.rows.empty else pairs.rows, "FP32")
    if not ran:
        lines.append("No cell finished ok.")
    return lines + fastest_per_model(df)
