"""Per-layer FP8 numerics in the report: SQNR per layer forward and backward with the layers under the floor
flagged, the worst cast-health shares, and the outlier trend per layer over training.

What it reads is the records' ``fp8_layers`` JSON (trials/measure/fp8_layers.py writes it, with the floors it judges by)
and their summary fields; what each figure means: docs/guide/numerics.md. Plotly is imported by the chart
functions only (the headline works without it).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from trials.measure.fp8_floors import DIRECTIONS, OPERANDS, SQNR_FLOOR_DB

from .analysis import known

Section = tuple[str, str, pd.DataFrame]  # title, note, table (as render.Section)


def _cell(row: Any) -> str:
    """The cell's readable name: its label where the sweep gave one, else its variant and size."""
    label = known(row.get("cell_label"))
    return str(label) if label is not None else f"{row.get('variant')} {row.get('size_label')}".strip()


def _read(df: pd.DataFrame) -> list[tuple[str, dict]]:
    """(cell, its fp8_layers JSON) per record that has one, ok records only."""
    if "fp8_layers" not in df or df.empty:
        return []
    rows = df[(df["status"] == "ok") & df["fp8_layers"].notna()]
    return [(_cell(r), json.loads(r["fp8_layers"])) for r in rows.to_dict("records")]


LAYER_COLUMNS = ["cell", "index", "module", "direction", "sqnr_db", "sqnr_min_db", "samples", "under"]


def layer_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, module, direction): the SQNR in dB, the median over the cell's samples (``sqnr_db``, what
    the charts draw) and the lowest (``sqnr_min_db``), the samples read and how many of them read under the
    direction's floor (``under``); ``index`` is the module's place in the model."""
    rows = [{"cell": cell, "index": i, "module": name, "direction": d, "sqnr_db": layers["sqnr"][d][i]}
            for cell, layers in _read(df) for d in DIRECTIONS for i, name in enumerate(layers["modules"])]
    if not rows:
        return pd.DataFrame(columns=LAYER_COLUMNS)
    frame = pd.DataFrame(rows)
    # a NaN SQNR (a layer whose FP8 output or gradient held a NaN) is the worst read, never a skipped one: the
    # median and min would pass over it and ``<`` the floor is false for it, so a broken layer vanished.
    # Records since trials/measure/fp8_layers.broken_is_worst write -inf; this reads older ones the same way
    frame["sqnr_db"] = frame["sqnr_db"].astype(float).fillna(-math.inf)
    frame["low"] = frame["sqnr_db"] < frame["direction"].map(SQNR_FLOOR_DB)
    return (frame.groupby(["cell", "index", "module", "direction"], as_index=False, sort=False)
            .agg(sqnr_db=("sqnr_db", "median"), sqnr_min_db=("sqnr_db", "min"), samples=("sqnr_db", "size"),
                 under=("low", "sum")))[LAYER_COLUMNS]


def outlier_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, module, training step sampled): max|x| / rms and kurtosis, medians over samples."""
    rows = [{"cell": cell, "module": name, "step": step, "ratio": ratios[k], "kurtosis": out["kurtosis"][name][k]}
            for cell, layers in _read(df) if (out := layers.get("outliers"))
            for name, ratios in out["ratio"].items() for k, step in enumerate(out["steps"])]
    if not rows:
        return pd.DataFrame(columns=["cell", "module", "step", "ratio", "kurtosis"])
    return pd.DataFrame(rows).groupby(["cell", "module", "step"], as_index=False, sort=False)[
        ["ratio", "kurtosis"]].median()


BELOW_COLUMNS = ["cell", "module", "direction", "lowest SQNR dB", "samples under", "floor dB"]


def below_floor(layers: pd.DataFrame) -> pd.DataFrame:
    """The layers read under the floor of their direction (SQNR_FLOOR_DB) in any sample, lowest first, with how
    many of the cell's samples read so. One seed's 15.6 dB is the number to see, whatever the median of the
    seeds says (the per-cell summary's minimum is the same lowest read)."""
    low = layers[layers["under"] > 0]
    if low.empty:  # (a full-length column assigned to an empty selection gave it every row, all NaN)
        return pd.DataFrame(columns=BELOW_COLUMNS)
    return pd.DataFrame({
        "cell": low["cell"], "module": low["module"], "direction": low["direction"],
        "lowest SQNR dB": low["sqnr_min_db"].round(2),
        "samples under": [f"{int(u)} of {int(n)}" for u, n in zip(low["under"], low["samples"])],
        "floor dB": low["direction"].map(SQNR_FLOOR_DB)}).sort_values("lowest SQNR dB").reset_index(drop=True)


def _rounded(value: Any) -> float | None:
    value = known(value)
    return None if value is None else round(float(value), 2)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per FP8 cell with reads: the lowest SQNR over its samples and that read's module per direction, the worst
    cast shares per operand class, the outlier ratio and kurtosis at the last sample (medians over samples), and
    what the reads cost."""
    out = []
    for cell, g in _cells(df):
        first = g.iloc[0]
        row: dict[str, Any] = {"cell": cell, "n": len(g)}
        for d in DIRECTIONS:  # the lowest read of any sample, and its module (below_floor lists the same)
            read = g[f"sqnr_{d}_min_db"].dropna()
            lowest = g.loc[read.idxmin()] if not read.empty else None
            row[f"{d} SQNR min dB"] = None if lowest is None else round(float(lowest[f"sqnr_{d}_min_db"]), 2)
            row[f"{d} worst"] = None if lowest is None else lowest[f"sqnr_{d}_worst"]
        for cls in OPERANDS:
            for kind in ("underflow", "saturation"):
                value = known(g[f"cast_{kind}_{cls}"].max())
                row[f"{cls} {kind}"] = None if value is None else float(f"{value:.3g}")
        row["max abs / rms"] = _rounded(g["outlier_ratio_max"].median())
        row["worst input"] = first["outlier_ratio_worst"]
        row["kurtosis max"] = _rounded(g["outlier_kurtosis_max"].median())
        row["reads s"] = round(float((g["fp8_layers_s"].fillna(0) + g["outliers_s"].fillna(0)).median()), 2)
        row["modules read"] = _modules_read(g)
        out.append(row)
    return pd.DataFrame(out)


def _cells(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(cell name, its ok samples) of every FP8 cell with per-layer reads, by name."""
    if "sqnr_fwd_min_db" not in df:
        return []
    rows = df[(df["status"] == "ok") & df["sqnr_fwd_min_db"].notna()]
    return list(rows.groupby(rows.apply(_cell, axis=1), sort=True)) if not rows.empty else []


def _fewest_read(g: pd.DataFrame) -> tuple[int, int] | None:
    """(FP8 modules read, FP8 modules the model runs) of the sample that read the fewest; None: records from
    before the count."""
    if "fp8_layers_read" not in g or "fp8_layers_total" not in g:
        return None
    counted = g[["fp8_layers_read", "fp8_layers_total"]].dropna()
    if counted.empty:
        return None
    fewest = counted.loc[counted["fp8_layers_read"].idxmin()]
    return int(fewest["fp8_layers_read"]), int(fewest["fp8_layers_total"])


def _modules_read(g: pd.DataFrame) -> str | None:
    fewest = _fewest_read(g)
    return None if fewest is None else "{} of {}".format(*fewest)


def partial(df: pd.DataFrame) -> list[str]:
    """The cells some sample of which read fewer FP8 modules than the model runs (a module that saw no forward or
    no gradient on the held batch, or ran twice in one forward), as "cell (read of total)": their figures are of
    the modules read only."""
    out = []
    for cell, g in _cells(df):
        fewest = _fewest_read(g)
        if fewest is not None and fewest[0] < fewest[1]:
            out.append("{} ({} of {})".format(cell, *fewest))
    return out


# what a Transformer Engine cell's fused modules give the reads (docs/guide/numerics.md, "A TE module is read whole")
TE_FUSED_NOTE = ("TE's fused modules (LayerNormLinear: norm and QKV; LayerNormMLP: norm, fc1, activation, fc2) are "
                 "read whole: one SQNR over both of the MLP's GEMMs, act cast health of the normalized input, weight "
                 "cast health over all the module's GEMM weights, grad of the module's output gradient; their "
                 "outlier input is the module's input before its norm, so a TE cell's kurtosis and max/rms never "
                 "see the MLP's activation product (fc2's input) that torchao's down projection reads: the two "
                 "stacks' outlier columns are not the same tensors")

FLOOR_NOTE = ("floors: forward {fwd:g} dB, input and weight gradients {wgrad:g} dB, the SQNR torchao's own Float8Linear "
              "test holds each layer's output and weight gradient to against the high-precision Linear (pytorch/ao "
              "test/float8/test_base.py); docs/guide/numerics.md").format(**SQNR_FLOOR_DB)


def sections(df: pd.DataFrame) -> list[Section]:
    """The report's numerics tables: the per-cell summary, then the layers under the floor (or a line saying
    none is)."""
    table = summary(df)
    if table.empty:
        return []
    low = below_floor(layer_frame(df))
    note = ("every module that runs in FP8, against the same module in BF16 on the same input and upstream gradient "
            "(one held batch, after the timed steps); SQNR in dB (higher: closer; -inf: the FP8 output or "
            "gradient held a NaN or inf); cast shares: elements flushed to zero / saturated under the recipe's "
            "scales, worst module; outliers: the FP8 modules' inputs at the last sample; modules read: of the FP8 "
            "modules the model runs, the fewest any sample read")
    if some := partial(df):
        note += ("; not every FP8 module was read in " + ", ".join(some) + ": their figures are of the modules read "
                 "only (a module is left out where it saw no forward or gradient on the held batch, or ran twice "
                 "in one forward)")
    if "backend" in df and (df.loc[df["sqnr_fwd_min_db"].notna(), "backend"] == "te").any():
        note += "; " + TE_FUSED_NOTE
    out = [("FP8 numerics per layer", note + "; " + FLOOR_NOTE, table)]
    note = (f"{len(low)} layer(s) read under their floor in at least one sample" if not low.empty else
            "no layer read under its floor in any sample")
    out.append(("FP8 layers below the SQNR floor", note + "; " + FLOOR_NOTE, low))
    return out


def sqnr_chart(layers: pd.DataFrame, directions: tuple[str, ...], title: str) -> Any:
    """SQNR per layer (x: the modules in model order), one line per cell and direction, the floors dashed."""
    import plotly.graph_objects as go

    fig = go.Figure()
    dashes = {"fwd": "solid", "dgrad": "solid", "wgrad": "dot"}
    for (cell, d), g in layers[layers["direction"].isin(directions)].groupby(["cell", "direction"], sort=True):
        g = g.sort_values("index")
        fig.add_trace(go.Scatter(x=g["module"], y=g["sqnr_db"], mode="lines+markers", name=f"{cell} {d}",
                                 line=dict(dash=dashes[d])))
    for d in dict.fromkeys(SQNR_FLOOR_DB[d] for d in directions):
        fig.add_hline(y=d, line=dict(color="#c00", dash="dash"), annotation_text=f"floor {d:g} dB")
    fig.update_layout(title=title, xaxis_title="module (model order)", yaxis_title="SQNR vs BF16 (dB)", height=420)
    return fig


def outlier_chart(outliers: pd.DataFrame) -> Any:
    """max|x| / rms of each FP8 module's input over training, one line per cell and module."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (cell, module), g in outliers.groupby(["cell", "module"], sort=False):
        fig.add_trace(go.Scatter(x=g["step"], y=g["ratio"], mode="lines+markers", name=f"{cell} {module}",
                                 legendgroup=cell, hovertext=[f"kurtosis {k:.2f}" for k in g["kurtosis"]]))
    fig.update_layout(title="Outliers over training: max|x| / rms of each FP8 module's input (the held batch; "
                            "hover: kurtosis)", xaxis_title="training step", yaxis_title="max|x| / rms", height=420)
    return fig


def figures(df: pd.DataFrame) -> list[tuple[str, Any]]:
    """The numerics charts of the records that have per-layer reads (none without)."""
    layers = layer_frame(df)
    if layers.empty:
        return []
    out = [("fp8_sqnr_forward", sqnr_chart(layers, ("fwd",), "FP8 error per layer, forward: SQNR of each module's "
                                           "output against BF16")),
           ("fp8_sqnr_backward", sqnr_chart(layers, ("dgrad", "wgrad"), "FP8 error per layer, backward: SQNR of the "
                                            "input gradient (solid) and weight gradient (dotted) against BF16"))]
    outliers = outlier_frame(df)
    if not outliers.empty:
        out.append(("fp8_outliers", outlier_chart(outliers)))
    return out
