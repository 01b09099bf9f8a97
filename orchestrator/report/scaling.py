"""Scaling across GPUs: the same cell at several world sizes, at equal per-rank work (weak scaling).

``batch_size`` is per rank, so a cell at world_size N does N times the work of the one-rank cell in
(ideally) the same step time. Efficiency at N = one-rank step time / N-rank step time, i.e. per-GPU
tokens/s at N over per-GPU tokens/s at 1, with a 95% interval over samples (``analysis.bootstrap_ratio``).
The one-rank reference is the cell with the same parallel mode at world_size 1 where one ran, else the
cell with no parallel wrapper (what a single GPU would run).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .analysis import BOOTSTRAP_SEED, SHAPE_KEYS, _median, bootstrap_ratio, shape_keys

SCALE_KEYS = ("world_size", "parallel")
BASE_KEYS = [k for k in SHAPE_KEYS if k not in SCALE_KEYS]
RESAMPLES = 2000


def scaling_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per multi-rank cell: per-GPU tokens/s, step time and efficiency against its one-rank cell."""
    if df.empty or "world_size" not in df or not (df["world_size"].fillna(1) > 1).any():
        return pd.DataFrame()
    ok = df[df["status"] == "ok"].assign(_base=lambda d: shape_keys(d, BASE_KEYS))
    times: dict[tuple, list[float]] = {}
    per_gpu: dict[tuple, list[float]] = {}
    for (base, variant, world, parallel), g in ok.groupby(["_base", "variant", "world_size", "parallel"], sort=False):
        times[(base, variant, int(world), parallel)] = [float(v) for v in g["step_ms_p50"].dropna()]
        per_gpu[(base, variant, int(world), parallel)] = [float(v) for v in g["tokens_per_s_per_gpu"].dropna()]
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    rows = []
    for (base, variant, world, parallel), t in times.items():
        if world == 1 or not t:
            continue
        ref = times.get((base, variant, 1, parallel)) or times.get((base, variant, 1, "none"))
        row = dict(zip(BASE_KEYS, base))
        row.update({"variant": variant, "parallel": parallel, "world_size": world, "step ms": _median(t),
                    "tokens/s per GPU": _median(per_gpu[(base, variant, world, parallel)]) if per_gpu[
                        (base, variant, world, parallel)] else None})
        if ref:
            lo, hi = bootstrap_ratio(ref, t, RESAMPLES, rng)
            row.update({"one-rank ms": _median(ref), "efficiency": _median(ref) / _median(t), "CI low": lo,
                        "CI high": hi})
        rows.append(row)
    keep = ["d_model", "n_layers", "batch_size", "variant", "parallel", "world_size", "step ms", "one-rank ms",
            "tokens/s per GPU", "efficiency", "CI low", "CI high"]
    out = pd.DataFrame(rows)
    return out[[c for c in keep if c in out]].sort_values(["d_model", "variant", "parallel", "world_size"]).round(3)
