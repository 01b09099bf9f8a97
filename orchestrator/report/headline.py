"""The report's first words: what this run says about the question, in a few sentences.

"Does FP8 pay off here?" gets its answer before any chart: the best measured FP8 speedup per FP8
variant with its interval, where FP8 could not run and why (in TE's or the device's own words), and
what the cells that did run compare instead. The sweep prints the same lines after its summary.
"""

from __future__ import annotations

import pandas as pd

from .analysis import Pairs


def _reasons(frame: pd.DataFrame) -> list[str]:
    return sorted({str(e).splitlines()[0] for e in frame["error"].dropna()})


def headline(df: pd.DataFrame, pairs: Pairs) -> list[str]:
    """Sentences for the top of the report (training records; inference has its own section)."""
    if df.empty:
        return ["No training records in this result set."]
    fp8 = df[df["precision"] == "fp8"]
    ok = df[df["status"] == "ok"]
    ran = sorted(set(ok["variant"]))
    lines: list[str] = []
    rows = pairs.rows[pairs.rows["kind"] == "fp8_speedup"] if not pairs.rows.empty else pairs.rows
    if fp8.empty:
        lines.append("This run has no FP8 cells.")
    elif rows.empty:
        unsupported = fp8[fp8["status"] == "unsupported"]
        if len(unsupported) == len(fp8):
            lines.append(f"FP8 could not run on this machine: {'; '.join(_reasons(unsupported))}.")
        else:
            failed = fp8[fp8["status"] != "ok"]
            lines.append("No FP8 cell has a BF16 partner that ran: "
                         + ("; ".join(_reasons(failed)) if not failed.empty else "see 'Unpaired cells'") + ".")
    else:
        for cand, g in rows.groupby("candidate", sort=True):
            best = g.loc[g["ratio"].idxmax()]
            where = f"d_model {best['d_model']} x {best['n_layers']} layers" + (" (CUDA graphs)" if best["cuda_graphs"] else "")
            interval = (f" [{best['ci_low']:.2f}, {best['ci_high']:.2f}]" if best["ci_low"] == best["ci_low"] else "")
            verdict = ("faster beyond noise" if best["ci_low"] > 1 else "slower beyond noise" if best["ci_high"] < 1
                       else "within noise of BF16")
            lines.append(f"{cand} vs {best['reference']}: best {best['ratio']:.2f}x{interval} at {where} "
                         f"({verdict}); {int((g['ratio'] > 1).sum())} of {len(g)} sizes faster.")
    if ran and (fp8.empty or rows.empty):
        precisions = sorted({str(p) for p in ok["effective_precision"].dropna()})
        lines.append(f"The cells that ran ({', '.join(ran)}) compare {' and '.join(precisions)}.")
    if not ran:
        lines.append("No cell finished ok.")
    return lines
