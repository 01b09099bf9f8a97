"""Report outputs: summary tables (markdown and HTML from the same frames), CSV, the HTML page, PNGs."""

from __future__ import annotations

import html
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from trials.measure.steadiness import unsteady_spread
from trials.record.atomic import write_text_atomic
from trials.numbers import fmt_sig, round_sig

from ..efficiency import concurrent_trials, run_efficiency
from .analysis import (DECODE_STEP, LOSS_GAP_KINDS, SEED_NOISE_SDS, SMALL_SAMPLE, TEACHER_FORCED, TEACHER_FORCED_NOTE,
                       TRAIN_STEP, Pairs, Timing, crossover, knob_effects, noise_side, per_layer_costs,
                       teacher_forced_columns, varying_keys, verdict_counts)
from .inference import InferencePairs, inference_sections, split
from .scaling import scaling_table
from .why import ENERGY_FIELDS, bounds, breakdown, conditions, energy_table

log = logging.getLogger(__name__)

TIMING_METHOD = (
    "Each trial runs in a trial process apart from Ray's worker (launcher warm: one process per GPU runs "
    "trial after trial, freeing memory and TE state between them; process: a fresh process per trial): "
    "build, train (train_steps), warm up (warmup_steps), then "
    "`repeats` blocks of `bench_steps` timed steps. A step is forward + backward + fused AdamW. On GPUs "
    "every step is bracketed by two CUDA events and the host never syncs inside a block; on CPUs the host "
    "clock times each (synchronous) step. The step time of a cell is the median over its samples of each "
    "sample's p50. Intervals: 95%, over samples: a t-interval on log times while either cell has fewer than "
    f"{SMALL_SAMPLE} samples (Welch's; one sample against several: the pooled spread), else a percentile bootstrap "
    "of the ratio of medians; where both cells have one sample, over the trial's per-step times (CI over: steps), "
    "which is not run-to-run noise, so no verdict rests on it. Model FLOPs per step = 6·N_matmul·tokens + "
    "6·n_layers·seq_len·d_model·tokens (causal attention); MFU divides by the dense datasheet peak. "
    "launch_bound: the GPU waited on the host for at least 20% of the step (the kernel breakdown's gap: the "
    "step less its kernels' time); without a breakdown, issuing one step took the host at least 80% of the GPU's "
    "step time (launch_bound_by says which rule decided). "
    "After timing, never inside it: an energy window (the step repeated for >= 1 s, NVML's energy counter "
    "read at ticks on both edges, SM clock and power sampled every 20 ms) and a kernel breakdown (a few "
    "steps under torch.profiler, every kernel sorted into a class by its name)."
)
ENV_FIELDS = ["gpu_name", "compute_capability", "driver_version", "cuda_version", "torch_version", "te_version",
              "ray_version", "python_version", "juicytalk_version", "git_sha", "hostname"]


def held_peak(df: pd.DataFrame) -> pd.Series:
    """Each record's measured peak of device memory held: the allocator's peak, plus, in a graphed cell, the bytes
    of its graphs' pool that the allocator counts free and the replays use (graph_pool_free_bytes)."""
    free = df["graph_pool_free_bytes"] if "graph_pool_free_bytes" in df else pd.Series(0.0, index=df.index)
    return df["peak_mem_allocated_bytes"].astype(float) + free.astype(float).fillna(0.0)


def _num(v, digits=2):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return round(float(v), digits)


Section = tuple[str, str, pd.DataFrame]  # title, note, table


def summary_sections(df: pd.DataFrame, pairs: Pairs, comparison: pd.DataFrame | None,
                     inference: InferencePairs | None,
                     fastest_bf16: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> list[Section]:
    """Every table of the report, made once for results.md and the HTML page; ``pairs`` are the
    training records', ``inference`` the inference records' (None without any); ``fastest_bf16``:
    :func:`~.analysis.against_fastest_bf16` of the training records."""
    fastest_bf16 = fastest_bf16 if fastest_bf16 is not None else (pd.DataFrame(), pd.DataFrame())
    everything, (df, infer) = df, split(df)
    sections = []
    rows = pairs.rows
    varying = varying_keys(df)  # fields that vary besides size and variant: a column of every table
    sp = rows[rows["kind"] == "fp8_speedup"] if not rows.empty else rows
    if not sp.empty:
        t = pd.DataFrame({
            "d_model": sp["d_model"], "n_layers": sp["n_layers"], **{k: sp[k] for k in varying},
            "params (M)": (sp["n_params"] / 1e6).round(1),
            "graphs": sp["cuda_graphs"], "FP8 variant": sp["candidate"], "BF16 partner": sp["reference"],
            "BF16 ms": sp["reference_ms"].round(3), "FP8 ms": sp["candidate_ms"].round(3),
            "speedup": sp["ratio"].round(3), "CI low": sp["ci_low"].round(3), "CI high": sp["ci_high"].round(3),
            "CI over": sp["ci_method"], "n": sp["n_candidate"],
        }).sort_values(["FP8 variant", "graphs", "n_layers", *varying, "params (M)"])
        sections.append(("FP8 speedup over BF16 of the same stack", "speedup = BF16 step time / FP8 step time (> 1: FP8 "
                         "faster); te FP8 against te BF16, torchao FP8 against the twin's BF16, in the same execution "
                         "mode", t))
        cross = []
        for (cand, series, layers, graphs), g in sp.groupby(["candidate", "series", "n_layers", "cuda_graphs"], dropna=False):
            x = crossover(list(g["n_params"]), list(g["ratio"]))
            cross.append({"FP8 variant": cand, **({"series": series} if series else {}),
                          "n_layers": layers, "graphs": graphs,
                          "crossover params (M)": crossover_cell(x, g), "note": crossover_note(x, g)})
        sections.append(("Crossover size", "where FP8's speedup crosses 1.0 for good: between the last size below 1.0 "
                         "and the next (log-linear interpolation), >= 1.0 at every size above it; the note counts the "
                         "sizes FP8 is faster at beyond noise (95% interval over samples above 1)",
                         pd.DataFrame(cross)))
        knobs, findings = knob_effects(rows)
        if not knobs.empty:
            sections.append(("Recipes and formats", "each FP8 setting that takes several values, against cells equal in "
                             "everything else, the FP8 cell's stack included: speedup over the BF16 of that stack, built as "
                             "the FP8 cell is (BF16 partner), and final training loss against it, 95% intervals (loss: "
                             "over samples, so samples >= 2)", knobs))
            sections.append(("Recipes and formats: what changed", "a difference is beyond noise when the two 95% "
                             "intervals do not overlap", pd.DataFrame({"finding": findings})))
    sections += why_sections(df, rows, TRAIN_STEP, "step", "training step")
    scaling = scaling_table(df)
    if not scaling.empty:
        sections.append(("Scaling across GPUs", "weak scaling (batch_size per rank): efficiency = one-rank step time / "
                         "N-rank step time = per-GPU tokens/s at N over at 1, 95% interval over samples; FP8 speedups "
                         "at each world size are in the tables above (world_size is part of every pairing)", scaling))
    layers, estimates = per_layer_costs(df, pairs.cells)  # the training cells pairs were made of
    if not layers.empty:
        sections.append(("Per-layer cost", "the same cell at two depths: per layer = (t_deep - t_shallow) / (L_deep - "
                         "L_shallow); rest = embedding, LM head, loss and their optimizer work. Speedups at published "
                         "depths are estimates from this split, not measurements", layers))
        if estimates:
            sections.append(("Per-layer cost: full-depth estimates", "labelled estimates, from the split above",
                             pd.DataFrame({"estimate": estimates})))
    fastest, heads = fastest_bf16
    if not fastest.empty:
        base = [k for k in varying if k in fastest]  # execution fields are part of each cell's label here
        f = fastest.assign(**{"params (M)": (fastest["n_params"] / 1e6).round(1)})
        keep = ["d_model", "n_layers", *base, "params (M)", "cell", "ms", "fastest BF16", "BF16 ms", "ratio",
                "ci_low", "ci_high", "n"]
        f = f[[c for c in keep if c in f]].rename(columns={"ratio": "speedup", "ci_low": "CI low", "ci_high": "CI high"})
        sections.append(("Against the fastest BF16", "every cell of a shape against the fastest BF16 cell of that shape, "
                         "any stack and execution mode (world_size and parallel are part of the shape: batch_size is "
                         "per rank): speedup = fastest BF16 ms / cell ms, 95% interval",
                         f.round({"ms": 3, "BF16 ms": 3, "speedup": 3, "CI low": 3, "CI high": 3})
                         .sort_values(["d_model", "n_layers", *base, "ms"])))
    if not heads.empty:
        keep = ["d_model", "n_layers", *[k for k in varying if k in heads], "a", "a ms", "b", "b ms", "a/b time", "CI low", "CI high", "CI over"]
        sections.append(("FP8 stacks head to head", "per shape, each stack's fastest FP8 cell: a/b time = a's step "
                         "time / b's (< 1: a faster), 95% interval",
                         heads[[c for c in keep if c in heads]].round({"a ms": 3, "b ms": 3, "a/b time": 3,
                                                                       "CI low": 3, "CI high": 3})))
    gain = rows[rows["kind"] == "te_gain"] if not rows.empty else rows
    if not gain.empty:
        sections.append(("TE kernel gain (te-bf16 vs torch-bf16)", "gain = torch-bf16 step time / te-bf16 step time",
                         pd.DataFrame({"d_model": gain["d_model"], "n_layers": gain["n_layers"],
                                       **{k: gain[k] for k in varying}, "graphs": gain["cuda_graphs"],
                                       "torch ms": gain["reference_ms"].round(3),
                                       "te ms": gain["candidate_ms"].round(3), "gain": gain["ratio"].round(3),
                                       "CI low": gain["ci_low"].round(3), "CI high": gain["ci_high"].round(3)})))
    bf16 = rows[rows["kind"] == "bf16_speedup"] if not rows.empty else rows
    if not bf16.empty:
        sections.append(("BF16 speedup over FP32 of the same stack", "speedup = FP32 step time / BF16 step time (> 1: "
                         "BF16 faster), 95% interval",
                         pd.DataFrame({"d_model": bf16["d_model"], "n_layers": bf16["n_layers"],
                                       **{k: bf16[k] for k in varying}, "graphs": bf16["cuda_graphs"],
                                       "BF16 variant": bf16["candidate"], "FP32 partner": bf16["reference"],
                                       "FP32 ms": bf16["reference_ms"].round(3), "BF16 ms": bf16["candidate_ms"].round(3),
                                       "speedup": bf16["ratio"].round(3), "CI low": bf16["ci_low"].round(3),
                                       "CI high": bf16["ci_high"].round(3), "CI over": bf16["ci_method"],
                                       "n": bf16["n_candidate"]})
                         .sort_values(["BF16 variant", "graphs", "n_layers", "d_model"])))
    sections += inference_sections(infer, inference)
    if inference is not None:
        sections += why_sections(infer, inference.decode.rows, DECODE_STEP, "decode step", "decode step")
    energy = energy_table(everything)
    if not energy.empty:
        sections.append(("Energy", "NVML's board energy over a window of >= 1 s of the timed step repeated (infer: whole "
                         "generations), medians over samples; " + conditions(everything),
                         energy.round({f: 2 for f in ENERGY_FIELDS})))
    estimated = df["est_peak_mem_bytes"] if "est_peak_mem_bytes" in df else pd.Series(float("nan"), index=df.index)
    held = held_peak(df)
    cells = df.assign(peak_gib=held / 2**30, est_gib=estimated.astype(float) / 2**30,
                      est_over_peak=estimated.astype(float) / held).groupby(
        ["cell_label", "cell_id", "variant", "cuda_graphs", "d_model", "n_layers", *varying], dropna=False,
        sort=True).agg(
        samples=("status", "size"), status=("status", lambda s: ",".join(sorted(set(s)))),
        p50_ms=("step_ms_p50", "median"), tokens_per_s=("tokens_per_s", "median"),
        tflops=("model_tflops", "median"), mfu_bf16=("mfu_bf16_peak", "median"),
        mfu_own=("mfu_precision_peak", "median"), peak_gib=("peak_gib", "max"), est_gib=("est_gib", "max"),
        est_over_peak=("est_over_peak", "median"),
        loss_final=("loss_final", "median"), stride_acc=("gen_stride_accuracy", "median"),
        launch_bound=("launch_bound", lambda s: ",".join(sorted({str(v) for v in s if v is not None})) or "-"),
        launcher=("launcher", lambda s: ",".join(sorted({str(v) for v in s if isinstance(v, str)})) or "-"),
    ).reset_index().sort_values(["d_model", "n_layers", *varying, "variant", "cuda_graphs"])
    for col, digits in (("p50_ms", 4), ("tokens_per_s", 4), ("tflops", 3), ("mfu_bf16", 3), ("mfu_own", 3),
                        ("peak_gib", 3), ("est_gib", 3), ("est_over_peak", 3), ("loss_final", 4),
                        ("stride_acc", 3)):  # significant figures
        cells[col] = [round_sig(v, digits) for v in cells[col].astype(float)]
    if not df.empty:
        sections.append(("All cells", "medians over samples; status lists every sample's status; peak_gib: the "
                         "allocator's peak, and in graphed cells their pool's free bytes too (graph_pool_free_bytes: "
                         "the replays use them, the allocator counts them free); est_gib: the memory plan's peak "
                         "(docs/guide/memory.md), est_over_peak: it over peak_gib", cells))
    eff = run_efficiency(everything).round({"wall_s": 1, "busy_s": 1, "busy_fraction": 3, "busy_per_gpu": 3,
                                     "overhead_s_median": 2, "first_step_s_median": 2, "startup_s_median": 2,
                                     "trials_per_process": 1})
    if not eff.empty:
        sections.append(("Sweep efficiency", "per `juicytalk sweep` run: wall = run start to its last record; busy = "
                         "train+bench time of its trials; busy_per_gpu = busy / wall / GPUs; overhead = trial wall on the "
                         "worker - (setup + train + bench + generation); first step = the first training step, "
                         "where TE's fusers compile; start-up = trial start to first step", eff))
    flags = sanity_flags(df, pairs)
    if not flags.empty:
        sections.append(("Sanity checks", "numbers that are more likely a measurement problem than a result", flags))
    numerics = _loss_deltas(df, pairs)
    if not numerics.empty:
        sections.append(("FP8 numerics", "final training loss of each FP8 cell against the BF16 cell of its own stack: "
                         "medians over "
                         "samples, 95% interval of the ratio when the two have 3 or more samples between them (run long "
                         "enough for the "
                         "loss to flatten, e.g. train_steps 300, samples 3); " + TEACHER_FORCED_NOTE, numerics))
    gaps = loss_gap_table(df, pairs)
    if not gaps.empty:
        sections.append(("Loss gap against seed noise", "gap = FP8 - BF16 (a run without FP8: BF16 - FP32) final "
                         "training loss at the same seed (init and batches), median over the seeds both ran [95% "
                         f"interval over seeds, seeds >= 2: t under {SMALL_SAMPLE}, bootstrap from {SMALL_SAMPLE}]; "
                         "seed sd = the spread of the reference's final "
                         f"loss across its seeds; within its seed noise when |gap| <= {SEED_NOISE_SDS:g} sd (where a "
                         "reference run at a new seed lands about 95% of the time), else outside by the excess; per "
                         "learning rate where lr is an axis", gaps))
    if not pairs.unpaired.empty:
        u = pairs.unpaired
        sections.append(("Unpaired cells", "cells left out of the ratios above, and why",
                         pd.DataFrame({"kind": u["kind"], "d_model": u["d_model"], "n_layers": u["n_layers"],
                                       "graphs": u["cuda_graphs"], "cell": u["cell"], "partner": u["partner"],
                                       "reason": u["reason"]})))
    if comparison is not None and comparison.empty:
        sections.append(("Comparison", "the two result sets share no cells (no cell id in both): nothing to compare",
                         pd.DataFrame({"cells here": [df["cell_id"].nunique()], "in both": [0]})))
    elif comparison is not None:
        c = comparison.copy()
        for col in ("a_ms", "b_ms", "ratio_b_over_a", "ci_low", "ci_high"):
            c[col] = c[col].round(3)
        sections.append(("Comparison", "time ratio B/A per cell (timing: the step, or for infer cells the decode "
                         "step); changed = the 95% interval over samples "
                         "excludes 1; a cell with one sample on either side is not judged (the spread of one trial's "
                         "steps is not the spread between runs)",
                         c.drop(columns=["cell_id"])))
    return sections


def crossover_note(x: float | None, g: pd.DataFrame) -> str:
    """What a crossover row says beside its size: the point estimates' side of 1.0 above the crossover (or at every
    size), then how many sizes are faster beyond noise (``verdict_counts``): 1.01x [0.95, 1.07] is no win."""
    below = g["ratio"] < 1
    faster = all(noise_side(lo, hi, m) == 1 for lo, hi, m in zip(g["ci_low"], g["ci_high"], g["ci_method"]))
    where = ("FP8 >= 1.0 from here on" if x else "FP8 faster at every size measured" if faster else
             "FP8 >= 1.0 at every size measured" if not below.any() else "FP8 < 1.0 at every size measured"
             if below.all() else "FP8 < 1.0 at the largest size: no crossing it stays above")
    return f"{where}; {verdict_counts(g)}"


def crossover_cell(x: float | None, g: pd.DataFrame) -> float | str:
    """The crossover size in M parameters, or where it lies when the sizes measured do not cross 1.0 for good: at
    or below the smallest (>= 1.0 at every size), above the largest (below 1.0 at every size), or none (below
    1.0 at the largest size after being above it)."""
    if x:
        return round(x / 1e6, 1)
    sizes = g["n_params"].dropna()
    if sizes.empty:
        return "none"
    if (g["ratio"] >= 1).all():
        return f"<= {fmt_sig(sizes.min() / 1e6)}"
    if (g["ratio"] < 1).all():
        return f"> {fmt_sig(sizes.max() / 1e6)}"
    return "none"


def why_sections(df: pd.DataFrame, pair_rows: pd.DataFrame, timing: Timing, what: str, title: str) -> list[Section]:
    """"Where the <step> goes" and the bound of each FP8 pair (orchestrator/report/why.py)."""
    out: list[Section] = []
    table = breakdown(df, timing)
    if not table.empty:
        gaps = {"GPU": "on GPUs the GPU idle, waiting on the host", "CPU": "on CPU host time outside aten operators "
                "(the operators' self time is scaled to the timed step by the profiled step's wall clock)"}
        out.append((f"Where the {title} goes", f"ms per {what} by kernel class (a few steps under torch.profiler after "
                    "timing, medians over samples; GEMMs named by the precision they ran in); gap = timed p50 - "
                    f"kernels: {'; '.join(gaps[d] for d in sorted(set(table['device']), reverse=True))}",
                    table.round(3)))
    b = bounds(df, pair_rows, timing)
    if not b.empty:
        out.append((f"The bound: what FP8's GEMMs allow ({what})", "bound = BF16 time / (BF16 time - its GEMMs + the FP8 "
                    "cell's GEMMs + casts), casts = the change in cast + element-wise kernel time (both stacks fuse casts "
                    "into element-wise kernels); measured above the bound: the rest of the step got faster too; energy = FP8 / BF16 joules per step, 95% interval over samples",
                    b.round(3)))
    return out


MAX_PLAUSIBLE_FP8_SPEEDUP = 1.7  # end to end; published FP8 gains are ~1.1-1.5x for 1-10B models
MAX_PLAUSIBLE_MFU = 0.8


def sanity_flags(df: pd.DataFrame, pairs: Pairs) -> pd.DataFrame:
    """Flag what should make a performance engineer suspicious before publishing a number."""
    out = []
    rows = pairs.rows
    for r in (rows[rows["kind"] == "fp8_speedup"].itertuples() if not rows.empty else []):
        where = f"d{r.d_model}-L{r.n_layers}{'-graphs' if r.cuda_graphs else ''} {r.candidate}"
        if r.ratio > MAX_PLAUSIBLE_FP8_SPEEDUP:
            out.append({"cell": where, "check": "fp8 speedup", "value": round(r.ratio, 3),
                        "why": f"> {MAX_PLAUSIBLE_FP8_SPEEDUP}x end to end is more likely a slow BF16 baseline or a "
                               "timing problem than an FP8 gain"})
    ok = df[df["status"] == "ok"]
    # every column exists: records are read with the one explicit schema. Each loop takes the rows it can flag and
    # the columns it reads first: itertuples over all ~240 columns, or over every row, cost seconds at 100k records
    for r in ok.loc[ok["mfu_precision_peak"] > MAX_PLAUSIBLE_MFU, ["cell_label", "mfu_precision_peak"]].itertuples():
        out.append({"cell": r.cell_label, "check": "MFU vs own peak", "value": round(r.mfu_precision_peak, 3),
                    "why": "above 80% of the dense datasheet peak: check the FLOP count and the timer"})
    for r in ok.loc[ok["compiled_eager_why"].notna(),  # trials/measure/kernels.compiled_eager_why
                    ["cell_label", "compiled_calls_per_step", "compiled_eager_why"]].itertuples():
        out.append({"cell": r.cell_label, "check": "compiled, ran eager", "value": r.compiled_calls_per_step,
                    "why": f"{r.compiled_eager_why}: compare it with its eager cell before reading it as compiled"})
    for r in ok.loc[(ok["launch_bound"] == True) & ~ok["cuda_graphs"],  # noqa: E712 - nullable column
                    [c for c in ("cell_label", "host_ms_per_step", "compile") if c in ok]].itertuples():
        out.append({"cell": r.cell_label, "check": "launch-bound", "value": round(r.host_ms_per_step, 2),
                    "why": "the GPU waits on the host: this time measures launch overhead, not only the GPU; "
                           "compare with cuda_graphs" + ("" if not getattr(r, "compile", False) else
                                            " (compiled too: its compiled units are graphed as they are)")})
    for r in ok.loc[ok["timer"] == "cuda_event", ["cell_label", "step_ms_std", "step_ms_p50", "timer"]].itertuples():
        if (spread := unsteady_spread(r.step_ms_std, r.step_ms_p50, r.timer)) is not None:
            out.append({"cell": r.cell_label, "check": "unsteady steps", "value": round(spread, 3),
                        "why": f"its timed steps' sd is {spread:.0%} of their median: a median of steps that spread "
                               "so (the host's pace where launch-bound) moves by about as much from one run to the "
                               "next; take more samples before reading a gap under that"})
    neighbours = concurrent_trials(df)[ok.index]  # failed trials shared the host too
    shared: dict[Any, dict] = {}  # record index -> its "shared host" row: one per record, every reason in it
    shares = (neighbours != 0).to_numpy()  # a record alone on its host is never flagged here
    for r, n in zip(ok.loc[shares, ["cell_label", "timer", "launch_bound", "cuda_graphs"]].itertuples(),
                    neighbours[shares]):
        if n and r.timer == "perf_counter":  # timed on the host's cores, which the other trials used too
            shared[r.Index] = {"cell": r.cell_label, "check": "shared host", "value": int(n),
                               "why": f"timed on CPU while {n} other trial(s) ran on the same host: they shared its "
                                      "cores; rerun with max_concurrent: 1"}
        elif n and r.launch_bound == True and not r.cuda_graphs:  # noqa: E712 - nullable column
            shared[r.Index] = {"cell": r.cell_label, "check": "shared host", "value": int(n),
                               "why": f"launch-bound and timed while {n} other trial(s) ran on the same host: host "
                                      "contention slows such steps (1.2-1.36x on a two-H200 host); rerun with "
                                      "max_concurrent: 1 or cuda_graphs"}
    # what the trial itself saw while its steps were timed (trials/measure/disturbance.py): any process, ours or not
    for r in ok.loc[ok["timing_disturbed"] == True,  # noqa: E712 - nullable column
                    ["timing_disturbed_why", "timing_wait_share", "cell_label"]].itertuples():
        seen = f"timing disturbed: {r.timing_disturbed_why}"
        if r.Index in shared:
            shared[r.Index]["why"] += f"; {seen}"
        else:
            shared[r.Index] = {"cell": r.cell_label, "check": "shared host", "value": (
                round(r.timing_wait_share, 2) if pd.notna(r.timing_wait_share) else None),
                "why": f"{seen}; rerun when the host and GPU are free"}
    out += [shared[i] for i in sorted(shared)]
    # a multi-rank CPU cell's ranks on one host (gloo on a laptop): each has the CPUs the file gives it
    # (runner.check_resources), and they share the host's cores, memory bandwidth and caches
    ranks = ok[(ok["world_size"].fillna(1) > 1) & (ok["interconnect"] == "same host") & (ok["timer"] == "perf_counter")]
    for r in ranks[["cell_label", "world_size"]].itertuples():
        out.append({"cell": r.cell_label, "check": "shared host", "value": int(r.world_size),
                    "why": f"{int(r.world_size)} ranks timed on one host's CPU cores, which they shared: a try-out "
                           "of the parallel setup, not a figure for ranks on their own devices"})
    modes = {bool(v) for v in ok.loc[ok["effective_backend"] == "te", "te_torch_compile"].dropna()}
    if False in modes:
        out.append({"cell": "all te cells" if modes == {False} else "some te cells", "check": "NVTE_TORCH_COMPILE=0",
                    "value": None, "why": "TE's element-wise fusers ran uncompiled: BF16 slows more than FP8 "
                                          "and FP8 speedups come out inflated"})
    return pd.DataFrame(out)


def _loss_deltas(df: pd.DataFrame, pairs: Pairs) -> pd.DataFrame:
    """Each FP8 cell's final loss against the TE BF16 cell it pairs with: median over samples, and the
    95% interval of the ratio where both cells have two or more samples; then its teacher-forced agreement
    and KL with its BF16 partner (``TEACHER_FORCED``), '-' where it has none."""
    rows = pairs.rows
    if rows.empty or "loss_ratio" not in rows:
        return pd.DataFrame()
    sp = rows[(rows["kind"] == "fp8_speedup") & rows["loss_ratio"].notna()]
    tf = pd.DataFrame([teacher_forced_columns(r) for r in sp.to_dict("records")],
                      columns=[label for _, label in TEACHER_FORCED.values()], index=sp.index)
    return pd.DataFrame({
        "variant": sp["candidate"], "d_model": sp["d_model"], "n_layers": sp["n_layers"], "graphs": sp["cuda_graphs"],
        **{k: sp[k] for k in varying_keys(df)}, "bf16 loss": sp["reference_loss"].round(4),
        "fp8 loss": sp["candidate_loss"].round(4), "delta %": (100 * (sp["loss_ratio"] - 1)).round(2),
        "CI low %": (100 * (sp["loss_ci_low"] - 1)).round(2), "CI high %": (100 * (sp["loss_ci_high"] - 1)).round(2),
        "n": sp["n_candidate"], **{c: tf[c] for c in tf}})


def loss_gap_table(df: pd.DataFrame, pairs: Pairs) -> pd.DataFrame:
    """One row per FP8 cell with a BF16 partner (and BF16 cell with an FP32 one): its final-loss gap over that
    partner, beside the partner's seed spread (``analysis.loss_gap_stats``); the grid's varying axes (lr among
    them) name the row. Empty where no partner has two seeds."""
    rows = pairs.rows
    if rows.empty or "loss_gap" not in rows:
        return pd.DataFrame()
    g = rows[rows["kind"].isin(LOSS_GAP_KINDS) & rows["loss_gap"].notna()]
    if g.empty or g["loss_seed_sd"].isna().all():  # one sample each: no noise to judge by ("FP8 numerics" has it)
        return pd.DataFrame()
    return pd.DataFrame({
        "variant": g["candidate"], "vs": g["reference"], "d_model": g["d_model"], "n_layers": g["n_layers"],
        **{k: g[k] for k in varying_keys(df) if k not in ("d_model", "n_layers")},
        "loss": g["candidate_loss"].round(4), "vs loss": g["reference_loss"].round(4),
        **{name: g[col].map(round_sig) for name, col in (("gap", "loss_gap"), ("gap CI low", "loss_gap_ci_low"),
                                                          ("gap CI high", "loss_gap_ci_high"))},
        "seeds": g["loss_gap_seeds"], "seed sd": g["loss_seed_sd"].map(round_sig), "verdict": g["loss_gap_verdict"]})


def _md_cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return str(v).replace("|", "\\|")


def _md_table(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_md_cell(v) for v in row) + " |")
    return "\n".join(lines)


def markdown_tables(df: pd.DataFrame, sections: list[Section], headline: list[str] = ()) -> str:
    parts = ["# JuicyTalk results", "", *[f"**{line}**" for line in headline], *([""] if headline else [])]
    for title, note, frame in sections:
        parts += [f"## {title}", "", f"_{note}_", "", _md_table(frame), ""]
    parts += ["## Environment", "", _md_table(environment(df)), "", "## Timing method", "", TIMING_METHOD, ""]
    return "\n".join(parts)


def write_csv(path: Path, pairs: Pairs, comparison: pd.DataFrame | None) -> None:
    """One row per ratio (fp8_speedup, te_gain, and compare rows), full precision, and one per cell that has
    no ratio (``ratio`` empty, ``reason`` says why: an unsupported FP8 cell, a partner that did not run)."""
    frames = [pairs.rows] if not pairs.rows.empty else []
    if comparison is not None and not comparison.empty:
        frames.append(comparison.assign(kind="compare", ratio=comparison["ratio_b_over_a"]))
    if not pairs.unpaired.empty:
        frames.append(pairs.unpaired.rename(columns={"cell": "candidate", "partner": "reference"}).assign(
            pair_kind=pairs.unpaired["kind"], kind="unpaired"))
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    for col in ("kind", "ratio", "reason"):
        if col not in table:
            table[col] = None
    write_text_atomic(path, table.to_csv(index=False))


def environment(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for col in ENV_FIELDS:
        if col in df.columns:
            values = sorted({str(v) for v in df[col].dropna().unique()})
            rows.append({"field": col, "value": ", ".join(values) if values else "-"})
    peaks = df.dropna(subset=["peak_tflops_bf16"]).drop_duplicates(["gpu_name", "effective_precision"])
    for r in peaks.itertuples():
        rows.append({"field": f"peak TFLOP/s ({r.gpu_name}, {r.effective_precision})",
                     "value": f"bf16 {r.peak_tflops_bf16:g}, own precision {r.peak_tflops_precision}"})
    if peaks.empty:
        rows.append({"field": "MFU peaks", "value": "none: device not in the peak table (CPU runs)"})
    return pd.DataFrame(rows)


_CSS = """
body{font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1b2733;color:#fff;padding:22px 32px}header h1{margin:0;font-size:24px}
header p{margin:6px 0 0;color:#c9d6e2}main{max-width:1200px;margin:0 auto;padding:16px 32px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:8px;margin:18px 0;padding:12px 18px;overflow-x:auto}
#answer{border-left:4px solid #1b2733}#answer li{margin:4px 0;font-size:15px}
h2{font-size:18px;margin:8px 0}p.note{color:#666;margin:4px 0 10px;font-size:13px}
table{border-collapse:collapse;font-size:12.5px;width:100%}th,td{border-bottom:1px solid #eee;padding:4px 6px;text-align:right}
th{background:#f3f5f7}td:first-child,th:first-child{text-align:left}pre{background:#f6f8fa;padding:10px;overflow:auto;font-size:12px}
.chart{margin:6px 0}
"""


def shared_plotlyjs(html_path: str, script: str) -> str:
    """Write plotly.js at ``script`` (relative to the page's folder) unless it is there; the page's src for it.

    Published reports that share one plotly.min.js are ~100 KB each instead of ~4.8 MB.
    """
    import plotly.offline

    target = Path(html_path).resolve().parent / script
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(plotly.offline.get_plotlyjs(), encoding="utf-8")
    return script


def write_html(path: str, figures: list[tuple[str, go.Figure]], df: pd.DataFrame, sections: list[Section],
               sweep_text: str | None, plotlyjs: str | None = None, headline: list[str] = ()) -> None:
    """By default a single self-contained file (plotly.js embedded once: it opens offline from disk);
    with ``plotlyjs``, a page that loads that shared script instead."""
    include: bool | str = shared_plotlyjs(path, plotlyjs) if plotlyjs else True
    gpus = ", ".join(sorted({str(g) for g in df["gpu_name"].dropna().unique()})) or "CPU"
    sweeps = ", ".join(sorted({str(s) for s in df["sweep_name"].dropna().unique()})) or "-"
    body = [f"<header><h1>JuicyTalk scaling report: {html.escape(sweeps)}</h1>"
            f"<p>{len(df)} trial records on {html.escape(gpus)}</p></header><main>"]
    if headline:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in headline)
        body.append(f"<section id='answer'><h2>What this run says</h2><ul>{items}</ul></section>")
    for i, (name, fig) in enumerate(figures):
        div = fig.to_html(full_html=False, include_plotlyjs=include if i == 0 else False, div_id=f"chart-{name}",
                          config={"displaylogo": False, "responsive": True})
        body.append(f'<section class="chart" id="sec-{name}">{div}</section>')
    for title, note, frame in sections:
        table = frame.to_html(index=False, na_rep="-", border=0, escape=True)
        body.append(f"<section><h2>{html.escape(title)}</h2><p class='note'>{html.escape(note)}</p>{table}</section>")
    env = environment(df).to_html(index=False, border=0)
    body.append(f"<section><h2>Environment</h2>{env}</section>")
    body.append(f"<section><h2>Timing method</h2><p>{html.escape(TIMING_METHOD)}</p></section>")
    if sweep_text:
        body.append(f"<section><h2>Sweep file as run</h2><pre>{html.escape(sweep_text)}</pre></section>")
    body.append("</main>")
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>JuicyTalk report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")
    write_text_atomic(path, page)


BROWSERS = 3  # kaleido's tab race (below) met ~1 browser in 12 on a loaded 2-core host: 3 make a failure ~1 in 2000


def browser_problem() -> str | None:
    """Why kaleido has no browser to draw PNGs with, in one line, or None: asked with kaleido's own lookup (its
    download, BROWSER_PATH, PATH, the usual install paths) before the report is built, whose PNGs come last."""
    from choreographer.browsers.chromium import Chromium

    found = Chromium.find_browser(skip_local=False)
    if found and Path(found).is_file():
        return None
    where = f"BROWSER_PATH={found} is no file" if found else "none on PATH or in the usual install paths"
    return (f"no Chrome or Chromium for kaleido to draw PNGs with ({where}); install one (Debian/Ubuntu: "
            "apt-get install chromium) or run plotly_get_chrome, or leave out --png")


def export_pngs(figures: list[tuple[str, go.Figure]], out_dir: str) -> list[str]:
    """PNG per chart through kaleido, which drives a Chromium (Debian's /usr/bin/chromium works).

    kaleido 1.5 sends its new tab to its page and only then enables the tab's JavaScript runtime, so on a busy host
    it can take the blank page's context for its page's and run a chart before its script exists
    (``ReferenceError: kaleido_scopes is not defined``; 3 of 25 six-chart exports beside three busy processes on a
    2-core machine). Rendering again in the same tab does not always help (kaleido reloads whatever page the tab
    holds: 1 of 3 retries failed again), so a chart that meets it is drawn again in a fresh browser (beside four
    busy processes: 5 of 60 exports met it, each drew in the next browser, none failed)."""
    import asyncio

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = [str(Path(out_dir) / f"{name}.png") for name, _ in figures]
    asyncio.run(_render_pngs([fig for _, fig in figures], paths))
    return paths


async def _render_pngs(figures: list[go.Figure], paths: list[str]) -> None:
    import kaleido

    done = 0
    for browser in range(1, BROWSERS + 1):
        if done == len(figures):
            return
        async with kaleido.Kaleido(n=1, mathjax=False) as k:  # no LaTeX in these charts; MathJax is a CDN fetch
            while done < len(figures):
                fig = figures[done]
                opts = {"format": "png", "width": 1100, "height": int(fig.layout.height or 500), "scale": 1}
                try:
                    await k.write_fig(fig, path=paths[done], opts=opts, cancel_on_error=True)
                except Exception as exc:  # kaleido's JavascriptError is private; its text identifies the race
                    if browser == BROWSERS or "kaleido_scopes is not defined" not in str(exc):
                        raise
                    log.warning("kaleido ran %s before its page had loaded; drawing it in a fresh browser",
                                Path(paths[done]).name)
                    break
                done += 1
