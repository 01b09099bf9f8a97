"""Plotly figures of a sweep. One colour per backend/precision/recipe across every chart; dashed
lines are CUDA-graphed cells; hover text carries the cell's configuration."""

from __future__ import annotations

import itertools
import math
import re

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trials.spec import PRECISIONS

from .analysis import LOSS_GAP_KINDS, SEED_NOISE_SDS, Pairs, crossover, known, size_order

COLORS = {
    "torch-fp32": "#7f7f7f",
    "torch-bf16": "#1f77b4",
    "te-fp32": "#8c564b",
    "te-bf16": "#2ca02c",
    "te-fp8-delayed": "#d62728",
    "te-fp8-current": "#ff7f0e",
    "te-fp8-block": "#9467bd",
    "torchao-fp8-tensorwise": "#e377c2",
    "torchao-fp8-rowwise": "#8c564b",
    "torchao-fp8-rowwise_with_gw_hp": "#bcbd22",
}
_SPARE = ["#17becf", "#bcbd22", "#e377c2", "#393b79", "#637939"]
STATUS_COLORS = {"ok": "#2ca02c", "oom": "#ff7f0e", "unsupported": "#9edae5", "diverged": "#e377c2",
                 "error": "#d62728", "timeout": "#8c564b", "missing": "#c7c7c7"}
# Legend below the plot: with many series a legend above wraps into the title.
LAYOUT = dict(template="plotly_white", height=540, margin=dict(l=70, r=30, t=60, b=60),
              legend=dict(orientation="h", yanchor="top", y=-0.14, x=0), hovermode="closest")


def color(variant: str) -> str:
    if variant not in COLORS:
        COLORS[variant] = _SPARE[len([k for k in COLORS if k not in _SPARE]) % len(_SPARE)]
    return COLORS[variant]


HOVER_COLUMNS = ["cell_label", "variant", "d_model", "n_layers", "n_heads", "ffn", "batch_size", "seq_len",
                 "cuda_graphs", "n_params", "status"]


def _hover(df: pd.DataFrame) -> list[str]:
    # only the columns shown: itertuples over all ~100 record columns dominates a large report; a cell's samples
    # share their text, which is written once per cell
    texts: dict[tuple, str] = {}

    def text(label, variant, d_model, n_layers, n_heads, ffn, batch, seq, graphs, n_params, status) -> str:
        return (f"{label or variant}<br>d_model={d_model} n_layers={n_layers} heads={n_heads} ffn={ffn}<br>"
                f"batch={batch} seq={seq} graphs={graphs}<br>params={n_params / 1e6:.1f}M<br>{status}")

    return [texts.get(r) or texts.setdefault(r, text(*r)) for r in df[HOVER_COLUMNS].itertuples(index=False, name=None)]


HOVER = "_hover"  # a column of every row's _hover text, written once per chart rather than once per series


def note_if_empty(fig: go.Figure, text: str) -> go.Figure:
    """Say why a chart is empty instead of showing bare axes."""
    has_data = any(getattr(t, "y", None) is not None and any(v is not None and v == v for v in t.y) for t in fig.data)
    if not has_data:  # no axes, bands or reference lines drawn around nothing
        fig.layout.shapes, fig.layout.annotations = (), ()
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        fig.update_layout(height=220, showlegend=False)
        fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font=dict(size=15, color="#666"))
    return fig


def _x_axis(fig: go.Figure, **kw) -> None:
    fig.update_xaxes(type="log", title_text="Parameters (log scale)", **kw)


def series_name(variant: str, layers: int | None, graphs: bool, series: str) -> str:
    """One line per variant, depth, execution mode and every other field that varies in the results."""
    name = variant + (f" L{int(layers)}" if known(layers) is not None else "") + (" graphs" if graphs else "")
    return f"{name} {series}" if series else name


SERIES = ["variant", "series", "cuda_graphs", "n_layers"]  # grouped with dropna=False: n_layers may be unset


def _lines(df: pd.DataFrame, y: str, y_title: str, title: str, y_log: bool = False) -> go.Figure:
    fig = go.Figure()
    ok = df.loc[df["status"] == "ok", list(dict.fromkeys([*SERIES, *HOVER_COLUMNS, y]))]  # slicing ~100 columns per series is slow
    lines = []
    for key, g in ok.groupby(SERIES, dropna=False, sort=True):
        med = g.groupby("n_params")[y].median()
        lines.append((key, g.sort_values("n_params").drop_duplicates("n_params")
                      .assign(**{y: lambda d: d["n_params"].map(med)})))
    # the points' hover texts in one pass (one per series was most of a chart's pandas calls)
    texts = iter(_hover(pd.concat([g for _, g in lines]))) if lines else iter(())
    for (variant, series, graphs, layers), g in lines:
        fig.add_trace(go.Scatter(
            x=g["n_params"], y=g[y], mode="lines+markers", name=series_name(variant, layers, graphs, series),
            line=dict(color=color(variant), dash="dash" if graphs else "solid"),
            hovertext=list(itertools.islice(texts, len(g))), hoverinfo="text+y"))
    fig.update_layout(title=title, **LAYOUT)
    _x_axis(fig)
    fig.update_yaxes(title_text=y_title, type="log" if y_log else "linear")
    return fig


def speedup_chart(pairs: Pairs, title: str = "FP8 speedup over BF16 of the same stack vs model scale (95% "
                                             "intervals)",
                  y_title: str = "Speedup (BF16 step time / FP8 step time)", kind: str = "fp8_speedup",
                  empty: str = "no BF16 / FP8 pairs that both ran ok") -> go.Figure:
    """One line per candidate variant of ``kind``'s pairs; ``empty`` says why there is none."""
    fig = go.Figure()
    rows = pairs.rows[pairs.rows["kind"] == kind] if not pairs.rows.empty else pairs.rows
    xs_all, n_cross = [], 0
    if not rows.empty:
        for (cand, series, graphs, layers), g in rows.groupby(["candidate", "series", "cuda_graphs", "n_layers"],
                                                              dropna=False, sort=True):
            g = g.sort_values("n_params")
            xs_all += list(g["n_params"])
            err_hi = (g["ci_high"] - g["ratio"]).clip(lower=0).fillna(0)
            err_lo = (g["ratio"] - g["ci_low"]).clip(lower=0).fillna(0)
            name = series_name(cand, layers, graphs, series)
            fig.add_trace(go.Scatter(
                x=g["n_params"], y=g["ratio"], mode="lines+markers", name=name,
                line=dict(color=color(cand), dash="dash" if graphs else "solid"),
                marker=dict(symbol="diamond" if graphs else "circle", size=9 if graphs else 7),
                error_y=dict(type="data", symmetric=False, array=err_hi, arrayminus=err_lo, visible=True),
                hovertext=[f"d_model={r.d_model} n_layers={r.n_layers} graphs={r.cuda_graphs}<br>"
                           f"BF16 {r.reference_ms:.2f} ms / FP8 {r.candidate_ms:.2f} ms<br>"
                           f"speedup {r.ratio:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
                           for r in g[["d_model", "n_layers", "cuda_graphs", "reference_ms", "candidate_ms", "ratio",
                                       "ci_low", "ci_high"]].itertuples()],  # the columns read: ~80 are slow
                hoverinfo="text"))
            x_cross = crossover(list(g["n_params"]), list(g["ratio"]))
            if x_cross:
                # staggered so that several crossings near each other stay readable
                fig.add_annotation(x=math.log10(x_cross), y=1.0, text=f"crossover ≈ {x_cross / 1e6:.0f}M ({name})",
                                   showarrow=True, arrowhead=2, ay=-40 - 26 * n_cross, font=dict(color=color(cand)))
                n_cross += 1
    lo, hi = (min(xs_all) / 1.5, max(xs_all) * 1.5) if xs_all else (1e6, 1e10)
    fig.add_shape(type="rect", xref="x", yref="y", x0=lo, x1=hi, y0=0, y1=1.0, fillcolor="rgba(214,39,40,0.07)",
                  line_width=0, layer="below")
    fig.add_hline(y=1.0, line=dict(color="black", width=1, dash="dot"),
                  annotation_text=f"1.0 = no gain; shaded: {'FP8' if kind == 'fp8_speedup' else 'the candidate'} slower",
                  annotation_position="bottom right")
    fig.update_layout(title=title, **LAYOUT)
    _x_axis(fig, range=[math.log10(lo), math.log10(hi)])
    top = max([1.6] + ([float(rows["ci_high"].max()) * 1.1] if not rows.empty and rows["ci_high"].notna().any() else []))
    fig.update_yaxes(title_text=y_title, range=[0, top])
    return note_if_empty(fig, empty)


def loss_gap_chart(pairs: Pairs) -> go.Figure:
    """Per FP8 cell (a run without FP8: BF16 cell; and learning rate, where it is an axis: in the series), its
    final-loss gap over its reference with its interval over seeds, over a grey band of the reference's own seed
    noise (+-SEED_NOISE_SDS sd)."""
    fig = go.Figure()
    rows = pairs.rows
    if not rows.empty and "loss_gap" in rows:
        rows = rows[rows["kind"].isin(LOSS_GAP_KINDS) & rows["loss_gap"].notna()]
        labels = [" ".join(str(v) for v in (r.candidate, f"d{r.d_model}-L{r.n_layers}", r.series) if v)
                  for r in rows.itertuples()]
        band = rows["loss_seed_band"]
        fig.add_trace(go.Bar(x=labels, y=2 * band, base=-band, name=f"the reference's seed noise (+-{SEED_NOISE_SDS:g} sd)",
                             marker=dict(color="rgba(127,127,127,0.3)"), hoverinfo="skip"))
        fig.add_trace(go.Scatter(
            x=labels, y=rows["loss_gap"], mode="markers", name="gap: final loss - the reference's (95% interval over seeds)",
            marker=dict(color=[color(c) for c in rows["candidate"]], size=9),
            error_y=dict(type="data", symmetric=False, visible=True,
                         array=(rows["loss_gap_ci_high"] - rows["loss_gap"]).clip(lower=0).fillna(0),
                         arrayminus=(rows["loss_gap"] - rows["loss_gap_ci_low"]).clip(lower=0).fillna(0)),
            hovertext=[f"{label}<br>gap {r.loss_gap:.4g} over {r.loss_gap_seeds} seeds<br>{r.loss_gap_verdict}"
                       for label, r in zip(labels, rows.itertuples())], hoverinfo="text"))
    fig.add_hline(y=0.0, line=dict(color="black", width=1, dash="dot"))
    fig.update_layout(title="Final-loss gap over the higher-precision partner (FP8 over BF16; without FP8, BF16 over "
                            "FP32), against the partner's seed-to-seed noise",
                      **LAYOUT)
    fig.update_yaxes(title_text="final-loss gap (nats)")
    return note_if_empty(fig, "no cell with a higher-precision partner and final losses")


def fastest_chart(rows: pd.DataFrame) -> go.Figure:
    """Every cell against the fastest BF16 cell of its shape (any stack): one line per cell kind."""
    fig = go.Figure()
    for (name, series, layers), g in rows.groupby(["cell", "series", "n_layers"], dropna=False, sort=True):
        g = g.sort_values("n_params")
        variant = name.split(" ", 1)[0]
        fig.add_trace(go.Scatter(
            x=g["n_params"], y=g["ratio"], mode="lines+markers", name=series_name(name, layers, False, series),
            line=dict(color=color(variant), dash="solid" if name.endswith("eager") else "dash"),
            error_y=dict(type="data", symmetric=False, array=(g["ci_high"] - g["ratio"]).clip(lower=0).fillna(0),
                         arrayminus=(g["ratio"] - g["ci_low"]).clip(lower=0).fillna(0), visible=True),
            hovertext=[f"{r['cell']}: {r['ms']:.2f} ms<br>fastest BF16 {r['fastest BF16']}: {r['BF16 ms']:.2f} ms<br>"
                       f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
                       for r in g[["cell", "ms", "fastest BF16", "BF16 ms", "ratio", "ci_low", "ci_high"]].to_dict("records")],
            hoverinfo="text+y"))
    fig.add_hline(y=1.0, line=dict(color="black", width=1, dash="dot"), annotation_text="1.0 = the fastest BF16",
                  annotation_position="bottom right")
    fig.update_layout(title="Every cell against the fastest BF16 cell of its shape (any stack; dashed: graphs or "
                            "compiled)", **LAYOUT)
    _x_axis(fig)
    fig.update_yaxes(title_text="Speedup (fastest BF16 ms / cell ms)")
    return note_if_empty(fig, "no shape has a BF16 cell that ran ok")


def step_time_chart(df: pd.DataFrame) -> go.Figure:
    return _lines(df, "step_ms_p50", "Step time, p50 (ms, log)", "Step time vs scale (fwd + bwd + AdamW)", y_log=True)


def throughput_chart(df: pd.DataFrame) -> go.Figure:
    return _lines(df, "tokens_per_s", "Tokens per second (log)", "Training throughput vs scale", y_log=True)


def decode_chart(df: pd.DataFrame) -> go.Figure:
    return _lines(df, "decode_tokens_per_s", "Decode tokens per second (log)",
                  "KV-cached decode throughput vs scale (dashed: CUDA-graphed decode)", y_log=True)


def mfu_chart(df: pd.DataFrame) -> go.Figure:
    fig = _lines(df, "mfu_bf16_peak", "MFU (model FLOP/s / dense peak)", "MFU vs scale: solid/dashed vs BF16 peak, dotted vs FP8 peak")
    fp8 = df.loc[(df["status"] == "ok") & (df["effective_precision"] == "fp8"),
                 list(dict.fromkeys([*SERIES, *HOVER_COLUMNS, "mfu_precision_peak"]))]
    fp8 = fp8.assign(**{HOVER: _hover(fp8)})
    for (variant, series, graphs, layers), g in fp8.groupby(SERIES, dropna=False, sort=True):
        g = g.sort_values("n_params")
        fig.add_trace(go.Scatter(x=g["n_params"], y=g["mfu_precision_peak"], mode="lines+markers",
                                 name=series_name(variant, layers, graphs, series) + " vs FP8 peak",
                                 line=dict(color=color(variant), dash="dot"), hovertext=g[HOVER].tolist(),
                                 hoverinfo="text+y"))
    fig.update_yaxes(tickformat=".0%")
    return note_if_empty(fig, "no MFU: this device has no entry in the peak table (CPU runs)")


def memory_chart(df: pd.DataFrame) -> go.Figure:
    scaled = df.assign(peak_gib=df["peak_mem_allocated_bytes"] / 2**30)
    fig = _lines(scaled, "peak_gib", "Peak allocated memory (GiB)", "Peak device memory vs scale")
    return note_if_empty(fig, "no device memory recorded (CPU runs)")


def loss_chart(df: pd.DataFrame, max_sizes: int = 6) -> go.Figure:
    ok = df[(df["status"] == "ok") & df["loss_curve"].notna()]
    sizes = sorted(ok["size_label"].unique(), key=size_order)[:max_sizes]
    cols = min(3, max(1, len(sizes)))
    rows = max(1, math.ceil(len(sizes) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"d_model x layers = {s}" for s in sizes] or [""],
                        shared_yaxes=True)
    shown = set()
    for i, size in enumerate(sizes):
        for (variant, series, graphs), g in ok[ok["size_label"] == size].groupby(["variant", "series", "cuda_graphs"],
                                                                                  sort=True):
            curve = list(g["loss_curve"].iloc[0])
            name = series_name(variant, None, graphs, series)
            fig.add_trace(go.Scatter(y=curve, x=list(range(len(curve))), mode="lines", name=name,
                                     legendgroup=name, showlegend=name not in shown,
                                     line=dict(color=color(variant), dash="dash" if graphs else "solid")),
                          row=i // cols + 1, col=i % cols + 1)
            shown.add(name)
    ran = [p for p in PRECISIONS if p in set(ok["effective_precision"])]
    fig.update_layout(title=f"Training loss per size, {' vs '.join(p.upper() for p in ran) or 'no curves'} (numerics check)",
                      **{**LAYOUT, "height": 320 * rows + 120})
    fig.update_xaxes(title_text="Step")
    fig.update_yaxes(title_text="Cross-entropy (nats)", col=1)
    return fig


def status_chart(df: pd.DataFrame) -> go.Figure:
    if df.empty:
        return go.Figure().update_layout(title="Status of every cell (no records)", **LAYOUT)
    names: dict[tuple, str] = {}  # a few series among thousands of records: each named once
    keyed = df.assign(row=[names.get(k) or names.setdefault(k, series_name(k[0], None, k[1], k[2]))
                           for k in zip(df["variant"].tolist(), df["cuda_graphs"].tolist(), df["series"].tolist())])
    sizes = sorted(keyed["size_label"].unique(), key=size_order)
    rows = sorted(keyed["row"].unique())
    order = list(STATUS_COLORS)
    statuses: dict[tuple, list[str]] = {}  # (row, size) -> its records' statuses, grouped over plain lists
    for key in zip(keyed["row"].tolist(), keyed["size_label"].tolist(), keyed["status"].tolist()):
        statuses.setdefault(key[:2], []).append(key[2])
    # the most common status (value_counts' own pick where several are); most cells have one
    cells = {key: (s[0] if len(set(s)) == 1 else pd.Series(s, dtype=object).value_counts().idxmax(), len(s))
             for key, s in statuses.items()}
    z, text = [], []
    for r in rows:
        zr, tr = [], []
        for s in sizes:
            status, n_records = cells.get((r, s), ("missing", 0))
            zr.append(order.index(status) if status in order else order.index("error"))
            tr.append(status if n_records <= 1 else f"{status} ({n_records})")
        z.append(zr)
        text.append(tr)
    n = len(order)
    scale = []
    for i, s in enumerate(order):
        scale += [(i / n, STATUS_COLORS[s]), ((i + 1) / n, STATUS_COLORS[s])]
    fig = go.Figure(go.Heatmap(z=z, x=sizes, y=rows, text=text, texttemplate="%{text}", zmin=-0.5, zmax=n - 0.5,
                               colorscale=scale, showscale=False, hovertemplate="%{y} @ %{x}: %{text}<extra></extra>"))
    fig.update_layout(title="Status of every cell", **{**LAYOUT, "height": max(300, 60 * len(rows) + 160)})
    fig.update_xaxes(title_text="d_model x n_layers", type="category")
    fig.update_yaxes(title_text="variant")
    return fig


def compare_chart(cmp: pd.DataFrame, label_a: str, label_b: str) -> go.Figure:
    fig = go.Figure()
    if not cmp.empty:
        cmp = cmp.sort_values(["variant", "n_params"])
        for variant, g in cmp.groupby("variant", sort=True):
            fig.add_trace(go.Scatter(
                x=g["cell_label"], y=g["ratio_b_over_a"], mode="markers", name=variant,
                marker=dict(color=color(variant), size=[14 if c else 8 for c in g["changed"]],
                            line=dict(width=[2 if c else 0 for c in g["changed"]], color="black")),
                error_y=dict(type="data", symmetric=False, array=(g["ci_high"] - g["ratio_b_over_a"]).fillna(0),
                             arrayminus=(g["ratio_b_over_a"] - g["ci_low"]).fillna(0)),
                hovertext=[f"{r.cell_label}: {r.a_ms:.2f} -> {r.b_ms:.2f} ms ({r.ratio_b_over_a:.3f}, {r.verdict})"
                           for r in g.itertuples()],
                hoverinfo="text"))
    fig.add_hline(y=1.0, line=dict(color="black", width=1, dash="dot"))
    fig.update_layout(title=f"Time B / A per cell (step; infer: decode step) (large outlined markers: beyond noise)"
                            f"<br><sup>A = {label_a}, B = {label_b}</sup>", **LAYOUT)
    fig.update_xaxes(title_text="Cell", type="category")
    fig.update_yaxes(title_text="Time ratio (B / A; < 1 means B is faster)")
    return note_if_empty(fig, f"{label_a} and {label_b} share no cells: nothing to compare")


BREAKDOWN_LABEL_CHARS = 36  # a cell's label wraps at this width, between its parts ('-', '/', ':')


def wrap_label(label: str, width: int = BREAKDOWN_LABEL_CHARS) -> str:
    """A long cell label (``py:/path/to/model.py:build-d64-L2-torchao-fp8-tensorwise``) on lines of at most
    ``width`` characters, broken after a '-', '/' or ':' where it can be (a longer part is cut), joined by <br>."""
    parts = re.findall(r"[^-/:]*[-/:]?", label)[:-1] or [label]
    lines = [""]
    for part in parts:
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
        while len(lines[-1]) > width:  # one part longer than a line: cut it
            lines[-1:] = [lines[-1][:width], lines[-1][width:]]
    return "<br>".join(lines)


def breakdown_chart(table: pd.DataFrame, title: str) -> go.Figure:
    """Stacked bars: each profiled cell's ms per step by kernel class (``why.breakdown``'s columns: GEMMs by the
    precision they ran in), and the gap on top (GPU idle on GPUs, outside operators on CPU).

    The bars lie along the x axis and the cells down the y axis, in the table's order, each label whole and
    wrapped (:func:`wrap_label`): upright labels under bars overlapped each other and the legend, and the
    margin cut them (``py:na``) when a label held a factory's path."""
    from trials.measure.kernels import CLASSES

    from .why import gap_name

    fig = go.Figure()
    if not table.empty:
        y = [wrap_label(f"{r.cell_label} b{r.batch_size}" if r.batch_size != 32 else r.cell_label)
             for r in table.itertuples()]
        palette = ["#aec7e8", "#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
        for cls, col in zip(["gemm_fp32", *CLASSES], palette):
            if cls in table:
                fig.add_bar(y=y, x=table[cls], name=cls, marker_color=col, orientation="h")
        fig.add_bar(y=y, x=table["gap"].clip(lower=0), name=gap_name(table), marker_color="#dddddd", orientation="h")
    lines = sum(label.count("<br>") + 1 for label in fig.data[0].y) if fig.data else 0
    fig.update_layout(**{**LAYOUT, "height": max(420, 160 + 18 * lines + 12 * len(table)),  # every line legible
                         "legend": dict(orientation="v", x=1.01, y=1, xanchor="left", yanchor="top")},  # beside
                      title=title, barmode="stack", xaxis_title="ms per step")
    fig.update_yaxes(automargin=True, type="category", autorange="reversed")  # the table's order, top down
    return note_if_empty(fig, "no profiled cells (profile: false, or records from before the breakdown)")


def search_chart(answer) -> go.Figure:
    """The crossover search's probes: speedup with its 95% interval at each probed value, the target,
    and the bracket the search ended with."""
    probes = [p for p in answer.probes if p.ratio is not None]
    fig = go.Figure()
    if probes:
        fig.add_scatter(x=[p.x for p in probes], y=[p.ratio for p in probes], mode="markers+text",
                        text=[p.verdict for p in probes], textposition="top center",
                        error_y=dict(type="data", symmetric=False, array=[p.ci_high - p.ratio for p in probes],
                                     arrayminus=[p.ratio - p.ci_low for p in probes]),
                        name=f"{answer.variant} / {answer.baseline}", marker=dict(size=10, color=color(answer.variant)))
        fig.add_hline(y=answer.target, line_dash="dash", annotation_text=f"target {answer.target:g}x")
        if answer.bracket and answer.bracket[0] != answer.bracket[1]:
            fig.add_vrect(x0=answer.bracket[0], x1=answer.bracket[1], fillcolor="#2ca02c", opacity=0.12, line_width=0)
    fig.update_layout(**LAYOUT, title=f"Crossover search: {answer.variant} vs {answer.baseline} (95% intervals)",
                      yaxis_title="baseline time / variant time")
    fig.update_xaxes(type="log", title_text=f"{answer.axis} (log scale)")
    return note_if_empty(fig, "the search probed no point to the end")
