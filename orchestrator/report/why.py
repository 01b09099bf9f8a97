"""Why a number is what it is: where each step's GPU time goes, what bound that sets on FP8, and the
energy, clock and power cap behind it.

From the records' kernel breakdown (``kernel_ms_<class>``, trials/measure/kernels.py) and energy window
(trials/measure/energy.py):

- *Where the step goes*: per cell, the medians over samples of each class's ms per step, their sum,
  and the gap to the timed p50 (the GPU idle inside a step: waiting on the host).
- *The bound*: for each FP8/BF16 pair, the speedup the BF16 step would reach if only its GEMMs became
  the FP8 cell's GEMMs and the FP8 cell's casts were added (Amdahl):
  ``bound = T_bf16 / (T_bf16 - GEMM_bf16 + GEMM_fp8cell + casts)``, casts being the change in cast plus
  element-wise kernel time (both stacks fuse casts into element-wise kernels), beside
  the measured speedup. A measured speedup above the bound means FP8 also changed kernels besides its
  GEMMs (TE fuses its casts into the layer norm and GELU), one below it means the rest of the step
  got slower or the GPU idled more.
- *Energy*: joules per step and tokens per joule per cell, the FP8/BF16 energy ratio of each pair with
  a 95% interval over samples, and the power cap and SM clock the numbers ran under.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trials.measure.kernels import CLASSES

from .analysis import BOOTSTRAP_SEED, Timing, _median, bootstrap_ratio, shape_keys

KERNEL_FIELDS = [f"kernel_ms_{c}" for c in CLASSES]
GEMM_FIELDS = ["kernel_ms_gemm_bf16", "kernel_ms_gemm_fp8"]
# What casting costs, net: cast kernels plus the element-wise class, because both stacks fuse casts with
# element-wise work (TE casts inside its layer norm and GELU; Inductor fuses torchao's casts with them).
CAST_FIELDS = ["kernel_ms_fp8_cast", "kernel_ms_elementwise"]
ENERGY_FIELDS = ["energy_j_per_step", "tokens_per_j", "power_mean_w", "power_max_w", "sm_clock_mean_mhz",
                 "sm_clock_min_mhz", "sm_clock_max_mhz", "power_limit_w"]
RESAMPLES = 2000


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _samples(ok: pd.DataFrame, fields: list[str]) -> dict[str, dict[tuple, list[float]]]:
    """field -> (shape, variant) -> the field's value in every ok sample that has it."""
    keys = list(zip(ok["_shape"], ok["variant"]))
    out: dict[str, dict[tuple, list[float]]] = {}
    for field in fields:
        per: dict[tuple, list[float]] = out.setdefault(field, {})
        values = ok[field].tolist() if field in ok else [None] * len(ok)
        for key, v in zip(keys, values):
            per.setdefault(key, [])
            if v is not None and v == v:
                per[key].append(float(v))
    return out


# What the gap (timed p50 - the classes' sum) is, by where the cells ran.
GAP_MEANING = {"GPU": "GPU idle (timed - kernels)", "CPU": "host outside aten operators (timed - operators)"}


def gap_name(table: pd.DataFrame) -> str:
    """The gap's name for a breakdown table's cells: GPU idle only where every cell ran on a GPU."""
    devices = sorted(set(table["device"])) if "device" in table and not table.empty else ["GPU"]
    return GAP_MEANING[devices[0]] if len(devices) == 1 else "gap: GPU idle (GPU cells), outside operators (CPU cells)"


def breakdown(df: pd.DataFrame, timing: Timing) -> pd.DataFrame:
    """Per profiled cell (by size, then variant): each class's ms per step, the sum, the gap to the timed p50
    (medians over samples), and where it ran. GEMMs not in FP8 are named by the precision they ran in:
    ``gemm_fp32`` for fp32 cells (the record's ``kernel_ms_gemm_bf16`` holds them)."""
    ok = _ok(df)
    if ok.empty or "kernel_ms_total" not in ok or ok["kernel_ms_total"].isna().all():
        return pd.DataFrame()
    ok = ok[ok["kernel_ms_total"].notna()]
    ok = ok.assign(_device=np.where(ok["gpu_name"].notna(), "GPU", "CPU") if "gpu_name" in ok else "GPU",
                   _fp32=(ok["effective_precision"] == "fp32") if "effective_precision" in ok else False)
    fields = [*KERNEL_FIELDS, "kernel_ms_total", "kernel_gap_ms", timing.median]
    keys = ["d_model", "n_layers", "batch_size", "cuda_graphs", "compile", "variant", "cell_label"]
    g = ok.groupby(keys, dropna=False, sort=True)
    table = g[fields].median().reset_index()
    table.insert(len(table.columns) - len(fields), "samples", g.size().values)
    table.insert(len(table.columns) - len(fields), "device", g["_device"].first().values)
    fp32 = g["_fp32"].any().values
    if fp32.any():
        at = table.columns.get_loc("kernel_ms_gemm_bf16")
        table.insert(at, "gemm_fp32", np.where(fp32, table["kernel_ms_gemm_bf16"], np.nan))
        table["kernel_ms_gemm_bf16"] = np.where(fp32, np.nan, table["kernel_ms_gemm_bf16"])
    table = table[["cell_label", "variant", *keys[:5], *table.columns[len(keys):]]]  # the label first, as before
    return table.rename(columns={f: f.removeprefix("kernel_ms_") for f in KERNEL_FIELDS}
                        | {"kernel_ms_total": "kernels", "kernel_gap_ms": "gap", timing.median: "timed"})


def bounds(df: pd.DataFrame, pair_rows: pd.DataFrame, timing: Timing) -> pd.DataFrame:
    """For each FP8/BF16 pair with a breakdown on both sides: GEMM share, GEMM speedup, cast cost, the
    Amdahl bound, the measured speedup, and the FP8/BF16 energy ratio with its interval."""
    sp = pair_rows[pair_rows["kind"] == "fp8_speedup"] if not pair_rows.empty else pair_rows
    ok = _ok(df)
    if sp.empty or ok.empty:
        return pd.DataFrame()
    if any(f not in ok or ok[f].isna().all() for f in [*GEMM_FIELDS, *CAST_FIELDS]):
        return pd.DataFrame()  # no pair has a breakdown on both sides (profile: false): its keys cost seconds
    samples = _samples(ok.assign(_shape=shape_keys(ok)), [*KERNEL_FIELDS, timing.median, "energy_j_per_step"])
    med = {f: {k: _median(v) for k, v in samples[f].items() if v} for f in [*KERNEL_FIELDS, timing.median]}
    energy = samples["energy_j_per_step"]
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    rows = []
    for shape, (_, r) in zip(shape_keys(sp), sp.iterrows()):
        ref, cand = (shape, r["reference"]), (shape, r["candidate"])
        try:
            t_ref = med[timing.median][ref]
            gemm_ref = sum(med[f][ref] for f in GEMM_FIELDS)
            gemm_cand = sum(med[f][cand] for f in GEMM_FIELDS)
            cast = sum(med[f][cand] - med[f][ref] for f in CAST_FIELDS)
        except KeyError:  # a side without a breakdown (profile: false, an older record)
            continue
        bound = t_ref / (t_ref - gemm_ref + gemm_cand + cast)
        # the model first: three models' pairs at one size read alike without it
        row: dict[str, Any] = {k: r[k] for k in ("model", "d_model", "n_layers", "batch_size", "cuda_graphs") if k in r}
        row.update({"FP8 variant": r["candidate"], "BF16 partner": r["reference"], "BF16 ms": t_ref,
                    "GEMM share of BF16": gemm_ref / t_ref, "GEMM speedup": gemm_ref / gemm_cand if gemm_cand else None,
                    "casts add ms": cast, "bound (GEMMs only)": t_ref / (t_ref - gemm_ref + gemm_cand),
                    "bound": bound, "measured": r["ratio"], "CI low": r["ci_low"], "CI high": r["ci_high"]})
        e_ref, e_cand = energy.get(ref, []), energy.get(cand, [])
        if e_ref and e_cand:
            lo, hi = bootstrap_ratio(e_cand, e_ref, RESAMPLES, rng)
            row.update({"energy FP8/BF16": _median(e_cand) / _median(e_ref), "energy CI low": lo, "energy CI high": hi})
        row["why"] = (f"GEMMs are {gemm_ref / t_ref:.0%} of the BF16 step and {row['GEMM speedup'] or 0:.2f}x faster "
                      f"in FP8; the casts add {cast:.2f} ms net; at most {bound:.2f}x from GEMMs and casts alone; "
                      f"measured {r['ratio']:.2f}x")
        rows.append(row)
    return pd.DataFrame(rows)


def energy_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per cell with an energy window: medians of J/step, tokens/J, power, clocks; the cap and throttle reasons."""
    ok = _ok(df)
    if ok.empty or "energy_j_per_step" not in ok or ok["energy_j_per_step"].isna().all():
        return pd.DataFrame()
    ok = ok[ok["energy_j_per_step"].notna()]
    g = ok.groupby(["cell_label", "variant", "d_model", "n_layers", "batch_size", "workload"], dropna=False, sort=True)
    table = g[ENERGY_FIELDS].median().reset_index()
    table["clock limits seen"] = g["clock_limits"].agg(lambda s: ",".join(sorted({p for v in s if v for p in v.split(",")}))
                                                       or "none").values
    table["GPU shared"] = g["energy_gpu_shared"].agg(lambda s: bool(s.fillna(False).any())).values
    table["samples"] = g.size().values
    return table


def conditions(df: pd.DataFrame) -> str:
    """One line: the power cap and SM clocks the run's GPU numbers were measured under."""
    ok = df[(df["status"] == "ok") & df.get("power_limit_w", pd.Series(dtype=float)).notna()] \
        if "power_limit_w" in df else pd.DataFrame()
    if ok.empty:
        return ""
    caps = sorted({float(v) for v in ok["power_limit_w"]})
    limits = sorted({p for v in ok["clock_limits"].dropna() for p in v.split(",") if p})
    return (f"power limit {', '.join(f'{c:.0f}' for c in caps)} W; SM clock over the energy windows "
            f"{ok['sm_clock_min_mhz'].min():.0f}-{ok['sm_clock_mean_mhz'].max():.0f} MHz (max "
            f"{ok['sm_clock_max_mhz'].max():.0f}); clock limits seen: {', '.join(limits) or 'none'}")
