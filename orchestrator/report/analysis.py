"""Numbers behind the report: pairing cells, ratios of medians, their 95% intervals.

FP8 speedup = BF16 step time / FP8 step time, for cells equal in every other axis, the BF16 cell of
the FP8 cell's own stack (``trials.backends``: te FP8 with te BF16, torchao FP8 with the twin's
BF16) and execution mode (CUDA graphs, compile). TE kernel gain = torch-bf16 step time / te-bf16
step time, likewise. Across stacks, every cell is also compared with the fastest BF16 cell of its
shape, whatever its stack or execution mode (its world size and parallel mode kept: batch_size is per
rank). Per cell, the step time is the median over samples of each sample's p50. The 95% interval of
a ratio is over samples (:func:`bootstrap_ratio`); only where both cells have one sample each is it
over the trial's own per-step times, which is no run-to-run noise: no verdict rests on it
(:func:`noise_side`). Cells whose partner is missing or did not finish ok are listed, not dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd

from trials.backends import STACKS
from trials.measure.launch import launch_bound
from trials.spec import TrialSpec, applies, axis_fields, default_for, only_fields, variant_name

# "The same cell apart from its variant": pairs must agree on every shape, schedule and execution field
# (declared with TrialSpec). Two different specs are never merged into one cell.
SHAPE_KEYS = axis_fields("shape", "schedule", "execution")
# Always in a series' name (n_layers) or its style (cuda_graphs), or moving with the x-axis (d_model).
_IMPLIED = ("d_model", "n_heads", "ffn", "n_layers", "cuda_graphs")
# The FP8 settings a knob comparison varies one at a time (the variant axes besides backend/precision).
KNOBS = [k for k in axis_fields("variant") if k not in ("backend", "precision")]
_SPEC_DEFAULTS = TrialSpec().to_dict()
BOOTSTRAP_SEED = 0


def known(value: Any) -> Any:
    """``value``, or None where a record has none (null, which pandas reads as None or NaN)."""
    return None if value is None or (isinstance(value, (float, np.floating)) and value != value) else value


def _get(row: Any, key: str) -> Any:
    return known(row.get(key))


def backend_of(row: Any) -> str | None:
    """The stack a record ran on; for one that did not run, the one it asked for (auto fp8: te)."""
    asked = _get(row, "backend")
    fp8 = (_get(row, "effective_precision") or _get(row, "precision")) == "fp8"
    return _get(row, "effective_backend") or ("te" if fp8 and asked in ("auto", None) else asked)


def variant_of(row: Any) -> str:
    """The variant as it actually ran (requested, for cells that did not run): see ``variant_name``."""
    precision = _get(row, "effective_precision") or _get(row, "precision")
    backend = backend_of(row)
    values = {name: _get(row, name) for name in axis_fields("variant")}
    values.update(backend=backend, precision=precision, recipe=_get(row, "effective_recipe") or _get(row, "recipe"),
                  model=_get(row, "model"))  # whose te_layer default applies
    name = variant_name(values)
    if _get(row, "precision") == "fp8" and precision not in ("fp8", None):  # asked FP8, ran none (trials.measure.metrics.fp8_ran)
        name += f"-asked-fp8-{_get(row, 'recipe')}"  # its own cell: never merged with a BF16 cell nor another recipe
    return name


# What variant_of, backend_of and execution_label read: rows are turned into dicts of these columns only
# (a dict of all ~100 record columns per row costs seconds at 10k records).
_VARIANT_COLUMNS = list(dict.fromkeys([*axis_fields("variant", "execution"), "effective_backend",
                                       "effective_precision", "effective_recipe", "model"]))  # model: whose defaults


def varying_keys(df: pd.DataFrame) -> list[str]:
    """Pairing fields that take several values in this result set and are not already shown by the
    x-axis, the series name or its style: each becomes part of series names and a table column."""
    return [k for k in SHAPE_KEYS if k not in _IMPLIED and k in df and df[k].nunique(dropna=True) > 1]


def series_label(values: dict[str, Any], keys: list[str]) -> str:
    return " ".join(f"{k}={values[k]}" for k in keys)


def prepare(records: pd.DataFrame) -> pd.DataFrame:
    df = records.copy()
    # pandas 3 reads strings as Arrow-backed "str" columns, whose row-wise take is several times
    # slower than plain object columns; the report selects rows a few thousand times.
    strings = [c for c in df.columns if isinstance(df[c].dtype, pd.StringDtype)]
    if strings:
        df[strings] = df[strings].astype(object).where(df[strings].notna(), None)
    if df.empty:
        df["variant"] = pd.Series(dtype=str)
        df["series"] = pd.Series(dtype=str)
        return df
    columns = [c for c in _VARIANT_COLUMNS if c in df]
    names: dict[tuple, str] = {}  # a few distinct variants among thousands of records: name each once
    df["variant"] = [names.get(v) or names.setdefault(v, variant_of(dict(zip(columns, v))))
                     for v in _tuples(df, columns)]
    df["cuda_graphs"] = df["cuda_graphs"].fillna(False).astype(bool)
    _judge_launch_bound(df)
    df["workload"] = df["workload"].fillna("train")  # records from before the workload field trained
    model = _SPEC_DEFAULTS["model"]  # records from before the model field ran MiniGPT
    df["model"] = df["model"].fillna(model) if "model" in df else model
    _clear_minigpt_only(df)
    keys = varying_keys(df)
    labels: dict[tuple, str] = {}  # a few distinct series and sizes among thousands of records: each named once
    df["series"] = [labels.get(v) or labels.setdefault(v, series_label(dict(zip(keys, v)), keys))
                    for v in zip(*(df[k].tolist() for k in keys))] if keys else ""
    sizes: dict[tuple, str] = {}
    df["size_label"] = [sizes.get(v) or sizes.setdefault(v, size_label(*v)) for v in zip(df["d_model"], df["n_layers"])]
    return df


def _clear_minigpt_only(df: pd.DataFrame) -> None:
    """MiniGPT's own fields (``arch``) to None on rows of another model source, in place. A record keeps the
    spec's default there ("gpt" on an hf:llama cell), which series names and tables would show as "arch=gpt"
    beside MiniGPT-llama rows: a Llama called a GPT."""
    for name in only_fields("minigpt"):
        if name in df:
            keep = {m: applies(name, {"model": m}) for m in df["model"].unique()}  # a few models: each parsed once
            df[name] = df[name].astype(object).where(df["model"].map(keep).astype(bool), None)


def _judge_launch_bound(df: pd.DataFrame) -> None:
    """``launch_bound`` of every profiled GPU record by today's rule (trials/measure/launch.py), in place: records
    written under the host-issue rule alone (before 2026-12-05) carry what the profiler's gap says instead."""
    need = ("step_ms_p50", "host_ms_per_step", "kernel_gap_ms")
    if df.empty or not all(c in df for c in need):
        return
    rows = np.flatnonzero(df[list(need)].notna().all(axis=1).to_numpy()).tolist()  # the float fields all known
    if not rows:
        return
    step, host, gap = (df[c].tolist() for c in need)
    judged = [launch_bound(float(step[i]), float(host[i]), float(gap[i])) for i in rows]
    for column, values in (("launch_bound", [j[0] for j in judged]), ("launch_bound_by", [j[1] for j in judged])):
        if column not in df:
            df[column] = None
        df[column] = df[column].astype(object)
        df.iloc[rows, df.columns.get_loc(column)] = values


UNSET = "?"  # a shape field the cell left to its model (a py: factory that takes no d_model, say)


def size_label(d_model: Any, n_layers: Any) -> str:
    """``d_model x n_layers`` of a cell, each part :data:`UNSET` where the record has none (None or NaN)."""
    return "x".join(UNSET if known(v) is None else str(int(v)) for v in (d_model, n_layers))


def size_order(label: str) -> tuple[int, ...]:
    """Sort key of a :func:`size_label`: by d_model, then depth; an unset part first."""
    return tuple(-1 if v == UNSET else int(v) for v in label.split("x"))


@dataclass
class CellStats:
    variant: str
    status: str
    median_ms: float | None
    samples: list[float]  # per-sample p50
    steps: list[float]  # per-step times of the first sample (one sample a side: ``cell_interval``)
    losses: list[float]  # per-sample final training loss
    n_params: int | None
    record: dict[str, Any] = field(default_factory=dict)
    launch_bound: bool = False  # a sample that ran ok was launch-bound: the host's pace set its time
    teacher_forced: dict[str, list[float]] = field(default_factory=dict)  # TEACHER_FORCED field -> per-sample values
    loss_by_seed: dict[int, float] = field(default_factory=dict)  # each ok sample's final loss, by its seed


def launch_bound_note(where: str) -> str:
    """What every answer that rests on launch-bound steps says with it (the headline, the crossover search)."""
    return (f"launch-bound at {where}: the host's pace of issuing kernels, not the GPU (nor FP8) alone, set those "
            "steps' times, so the answer can move with the host (cuda_graphs: true or a larger model takes it out)")


def shape_key(values: Any, keys: list[str] = SHAPE_KEYS) -> tuple:
    """A cell's identity across tables: its ``keys`` fields, missing values (None or NaN) as None."""
    return tuple(known(values[k]) for k in keys)


def _tuples(df: pd.DataFrame, keys: list[str]) -> list[tuple]:
    """Every row's ``keys`` values as a tuple, missing ones (None, NaN) as None, built a column at a time."""
    columns = []
    for k in keys:
        missing = df[k].isna().to_numpy()
        if missing.all():  # a field no record sets (most shape fields of a sweep)
            columns.append([None] * len(df))
        elif missing.any():
            columns.append([None if m else v for v, m in zip(df[k].tolist(), missing.tolist())])
        else:
            columns.append(df[k].tolist())
    return list(zip(*columns)) if len(df) else []


def shape_keys(df: pd.DataFrame, keys: list[str] = SHAPE_KEYS) -> pd.Series:
    """:func:`shape_key` of every row, a column at a time (a row-wise apply costs seconds at 10k records)."""
    return pd.Series(_tuples(df, keys), index=df.index, dtype=object)


def _median(values: list[float]) -> float:
    """np.median's value (NaN where any value is NaN, or none is given) in plain Python: the report takes ~10k
    medians of a few values each, where numpy's per-call cost is most of the time."""
    xs = sorted(float(v) for v in values)
    if not xs or any(x != x for x in xs):
        return float("nan")
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def _resampled_medians(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The median of each of ``resamples`` resamples of ``values``: the middle of each sorted row, np.median's
    value without its per-call cost (several times the sort's at 10-30 values)."""
    draws = values[rng.integers(0, len(values), (resamples, len(values)))]
    if np.isnan(values).any():  # np.median's NaN rule
        return np.median(draws, axis=1)
    draws.sort(axis=1)
    k = len(values) // 2
    return draws[:, k] if len(values) % 2 else (draws[:, k - 1] + draws[:, k]) / 2


def _middle_95(values: np.ndarray) -> tuple[float, float]:
    """``np.percentile(values, [2.5, 97.5])`` (its linear rule, NaN where any value is NaN) from one sort: numpy's
    per-call cost, over the few thousand bootstrap intervals of a large report, was several times the sort's."""
    if np.isnan(values).any():
        lo, hi = np.percentile(values, [2.5, 97.5])
        return float(lo), float(hi)
    ordered = np.sort(values)
    out = []
    for q in (2.5 / 100, 97.5 / 100):
        at = (len(ordered) - 1) * q  # numpy's virtual index, its neighbours and their weight
        i = math.floor(at)
        t = at - i
        a, b = float(ordered[i]), float(ordered[min(i + 1, len(ordered) - 1)])
        out.append(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)  # numpy's _lerp, as it rounds
    return out[0], out[1]


# Below this many values on a side an interval is Student's t, from this many on a percentile bootstrap. With 2
# values a side the bootstrap's "95%" interval is [min/max, max/min]: for a true ratio of 1 under 3% lognormal noise
# it excluded 1 in 33% of 2000 simulated runs (9% at 3 a side, 7% at 4, 3% at 5, 4% at 8; 19-20% at 2 against 3 or
# 8); the t-interval in 2%, 4% and 5% at 2, 3 and 4 a side, 5% at 1 against 2 or 3, 4% at 2 against 3 and 9% at 2
# against 8 (Welch's runs liberal that unbalanced).
SMALL_SAMPLE = 5


@lru_cache(maxsize=4096)
def _t975(df: float) -> float:
    """The 97.5th percentile of Student's t with ``df`` (>= 1, fractional: Welch's) degrees of freedom, from its
    density integrated on a grid (no scipy here); within 1e-4 of the tables."""
    x = np.linspace(0.0, 20.0, 20001)  # t(1)'s 97.5th percentile is 12.7
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(0.975, cdf, x))


def _t_interval(mean: float, se: float, df: float) -> tuple[float, float]:
    if se == 0:  # every value alike on both sides: nothing to widen it by
        return mean, mean
    half = _t975(round(float(df), 2)) * se
    return mean - half, mean + half


def _log_t_ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """95% t-interval of a's typical value over b's, on log values (times and losses spread in proportion):
    Welch's where both sides have two or more values; with one on a side, the other side's spread stands for both
    (pooled, n_a + n_b - 2 degrees of freedom). NaN with one value a side, or a value <= 0."""
    if min(a.min(), b.min()) <= 0 or len(a) + len(b) < 3:
        return float("nan"), float("nan")
    la, lb = np.log(a), np.log(b)
    diff = float(la.mean() - lb.mean())
    if len(a) >= 2 and len(b) >= 2:
        va, vb = la.var(ddof=1) / len(a), lb.var(ddof=1) / len(b)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else 1.0
        lo, hi = _t_interval(diff, math.sqrt(va + vb), df)
    else:
        df = len(a) + len(b) - 2
        pooled = (((la - la.mean()) ** 2).sum() + ((lb - lb.mean()) ** 2).sum()) / df
        lo, hi = _t_interval(diff, math.sqrt(pooled * (1 / len(a) + 1 / len(b))), df)
    # about the ratio of geometric means; the reported ratio is of medians, which it must hold
    ratio = float(np.median(a) / np.median(b))
    return min(math.exp(lo), ratio), max(math.exp(hi), ratio)


def bootstrap_ratio(num: list[float], den: list[float], resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """95% interval of median(num) / median(den): a t-interval on log values while either side has fewer than
    SMALL_SAMPLE values (:func:`_log_t_ratio`: valid, and wide, at two a side; defined at one against two), else a
    percentile bootstrap of the ratio of medians over independent resamples."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    if not len(a) or not len(b):
        return float("nan"), float("nan")
    if min(len(a), len(b)) < SMALL_SAMPLE:
        return _log_t_ratio(a, b)
    ma, mb = _resampled_medians(a, resamples, rng), _resampled_medians(b, resamples, rng)
    return _middle_95(ma / mb)


def bootstrap_median(values: list[float], resamples: int, rng: np.random.Generator,
                     bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float]:
    """95% interval of values' typical value: under SMALL_SAMPLE values a t-interval of their mean (n - 1 degrees
    of freedom), clipped to ``bounds`` (what the field can be: a share is in [0, 1], a KL >= 0) and holding the
    median; from SMALL_SAMPLE on a percentile bootstrap of the median. NaN with fewer than two values. The
    bootstrap of two values is [min, max] whatever they are, as for :func:`bootstrap_ratio`: a loss gap over two
    seeds read "[-0.011, 0.065]" where the t-interval says [-0.43, 0.48]."""
    a = np.asarray(values, float)
    if len(a) < 2:
        return float("nan"), float("nan")
    if len(a) < SMALL_SAMPLE:
        lo, hi = _t_interval(float(a.mean()), float(a.std(ddof=1)) / math.sqrt(len(a)), len(a) - 1)
        median = float(np.median(a))
        return min(max(lo, bounds[0]), median), max(min(hi, bounds[1]), median)
    return _middle_95(_resampled_medians(a, resamples, rng))


# How a ratio's interval was had (a pair row's ci_method): over samples, or -- both cells with one sample each -- over
# the trial's own per-step times. Steps spread is no run-to-run noise (another process, clock, allocator state):
# it is shown, labelled, and never judged by.
OVER_SAMPLES, OVER_STEPS = "samples", "steps"
NOT_JUDGED = "not judged: one sample a side, so its interval is one trial's step spread, not run-to-run noise"


def cell_interval(num: CellStats, den: CellStats, resamples: int, rng: np.random.Generator) -> tuple[float, float, str]:
    """95% interval of num's time over den's, and what it is over (OVER_SAMPLES or OVER_STEPS). Over steps only
    where both have exactly one sample: with more on a side, the first sample's steps would stand for a ratio
    of medians over all of them (and could exclude it)."""
    if len(num.samples) == 1 and len(den.samples) == 1:
        return *bootstrap_ratio(num.steps, den.steps, resamples, rng), OVER_STEPS
    return *bootstrap_ratio(num.samples, den.samples, resamples, rng), OVER_SAMPLES


def noise_side(lo: Any, hi: Any, method: Any = OVER_SAMPLES) -> int | None:
    """Where a ratio's 95% interval lies against 1: 1 above, -1 below, 0 holding 1; None where it says nothing of
    run-to-run noise (no interval, or one over steps)."""
    if method != OVER_SAMPLES or known(lo) is None or known(hi) is None:
        return None
    return 1 if lo > 1 else -1 if hi < 1 else 0


def verdict_counts(rows: pd.DataFrame, what: str = "sizes") -> str:
    """How many of ``rows`` (pair rows: ci_low, ci_high, ci_method) are faster or slower beyond noise, within it,
    or not judged: '1 of 3 sizes faster beyond noise, 2 within noise'. A size counts as faster only where its
    interval's low end is above 1, never by its point estimate alone."""
    sides = [noise_side(lo, hi, m) for lo, hi, m in zip(rows["ci_low"], rows["ci_high"], rows["ci_method"])]
    counts = [(sides.count(1), "faster beyond noise"), (sides.count(-1), "slower beyond noise"),
              (sides.count(0), "within noise"), (sides.count(None), "not judged (one sample a side)")]
    shown = [f"{n} {words}" for n, words in counts[1:] if n]
    return f"{counts[0][0]} of {len(sides)} {what} {counts[0][1]}" + "".join(f", {part}" for part in shown)


# Teacher-forced FP8 numerics (trials/workloads/teacher_forced.py): record field -> the pair-row column prefix of its
# median over the FP8 cell's samples and 95% interval (``<prefix>_ci_low``/``_ci_high``), and its table label.
TEACHER_FORCED = {"tf_top1_agreement": ("tf_top1", "tf top-1 agreement"),
                  "tf_top1_agreement_decided": ("tf_top1_decided", "tf top-1 agreement where BF16 decided"),
                  "tf_kl_mean": ("tf_kl", "tf KL (nats)"),
                  "tf_bf16_top1_prob": ("tf_bf16_p", "BF16 top-1 p"),
                  "tf_decided_share": ("tf_decided", "BF16 decided share")}
# what each can be, for its interval (bootstrap_median clips a small-sample t-interval to it): shares in [0, 1]
TEACHER_FORCED_BOUNDS = {"tf_kl_mean": (0.0, math.inf)}
# The all-position agreement says something about FP8 only where BF16 itself is decided at most positions;
# below this median share (tf_decided_share) the table says so in words instead of printing a number that reads
# as FP8 being broken (after a few steps on a 128k vocabulary BF16 is nearly flat and agreement ~ 0).
MEANINGFUL_DECIDED_SHARE = 0.5
TEACHER_FORCED_NOTE = ("tf = teacher-forced on one held sequence, every position, against the BF16 partner: top-1 "
                       "agreement of the next-token prediction (over all positions, and over those where BF16 is "
                       "decided: its top-1 clearly ahead of the runner-up, trials/workloads/teacher_forced.py) and mean "
                       "KL(FP8 || BF16); BF16 top-1 p = the partner's mean probability of its own argmax, decided "
                       f"share = where it is decided; where that share is under {MEANINGFUL_DECIDED_SHARE:.0%}, "
                       "agreement is noise and the table says so; median over samples [95% interval over samples, "
                       f"samples >= 2: t under {SMALL_SAMPLE}, bootstrap from {SMALL_SAMPLE}]; - where the cell has none (older records)")


def teacher_forced_stats(cell: CellStats, resamples: int, rng: np.random.Generator) -> dict[str, float]:
    """An FP8 cell's teacher-forced fields: the median over its samples and a 95% interval (bootstrap_median)."""
    out: dict[str, float] = {}
    for name, (prefix, _) in TEACHER_FORCED.items():
        values = cell.teacher_forced.get(name, [])
        lo, hi = bootstrap_median(values, resamples, rng, TEACHER_FORCED_BOUNDS.get(name, (0.0, 1.0)))
        out.update({prefix: _median(values), f"{prefix}_ci_low": lo, f"{prefix}_ci_high": hi})
    return out


def teacher_forced_columns(row: Any) -> dict[str, str]:
    """The table columns of a pair row's teacher-forced fields: 'median [low, high]', or '-' without any; the
    all-position agreement in words where BF16 is undecided (``MEANINGFUL_DECIDED_SHARE``)."""
    def value(key: str) -> float:
        v = _get(row, key)
        return float("nan") if v is None else float(v)

    columns = {label: _interval(value(prefix), value(f"{prefix}_ci_low"), value(f"{prefix}_ci_high"))
               for prefix, label in TEACHER_FORCED.values()}
    share, p = value(TEACHER_FORCED["tf_decided_share"][0]), value(TEACHER_FORCED["tf_bf16_top1_prob"][0])
    if share < MEANINGFUL_DECIDED_SHARE:  # False for NaN: records without the field keep their number
        columns[TEACHER_FORCED["tf_top1_agreement"][1]] = (
            f"BF16 itself is undecided here (top-1 p={p:.2g}, decided at {share:.0%} of positions): agreement not "
            f"meaningful; KL stands")
    return columns


# The loss gap against seed noise (issue 46). A BF16 run at a new seed lands within 2 standard deviations of
# BF16's mean final loss about 95% of the time: an FP8 cell whose gap over its BF16 partner is larger than that
# differs by more than a change of seed does to BF16 itself. A run without FP8 asks the same of BF16 against FP32.
SEED_NOISE_SDS = 2.0
LOSS_GAP_KINDS = ("fp8_speedup", "bf16_speedup")  # the pairs whose candidate is a lower precision of its reference


def loss_gap_stats(ref: CellStats, cand: CellStats, resamples: int, rng: np.random.Generator,
                   whose: str | None = None) -> dict[str, Any]:
    """A lower-precision cell's final-loss gap over its reference (FP8 over its BF16 partner, BF16 over FP32),
    beside the reference's own seed-to-seed spread.

    Samples use different seeds, and a sample of the candidate shares its seed (init and batches) with the
    reference's sample of the same index: the gap is the median over the seeds both ran of candidate - reference
    at that seed, its 95% interval over seeds (two or more: bootstrap_median). Without a shared seed it
    is the difference of the medians. ``loss_seed_sd``: the standard deviation of the reference's final losses
    across its seeds (ddof 1, two or more). ``loss_gap_verdict``: "within BF16's seed noise" when |gap| <=
    SEED_NOISE_SDS * that spread, else "outside by X nats" (X = |gap| - the band); "... seed noise unknown"
    with fewer than two reference seeds. ``whose``: the reference's name in the verdict (default its precision)."""
    shared = sorted(set(ref.loss_by_seed) & set(cand.loss_by_seed))
    if shared:
        diffs = [cand.loss_by_seed[s] - ref.loss_by_seed[s] for s in shared]
        gap, (lo, hi) = _median(diffs), bootstrap_median(diffs, resamples, rng)
    elif ref.losses and cand.losses:
        gap, lo, hi = _median(cand.losses) - _median(ref.losses), float("nan"), float("nan")
    else:
        return {}
    seeds = list(ref.loss_by_seed.values()) or ref.losses
    sd = float(np.std(seeds, ddof=1)) if len(seeds) >= 2 else float("nan")
    band = SEED_NOISE_SDS * sd
    whose = whose or (precision_of(ref) or "the reference").upper()
    verdict = (f"{whose} seed noise unknown: samples >= 2" if not np.isfinite(sd) else
               f"within {whose}'s seed noise" if abs(gap) <= band else f"outside by {abs(gap) - band:.3g} nats")
    return {"loss_gap": gap, "loss_gap_ci_low": lo, "loss_gap_ci_high": hi, "loss_gap_seeds": len(shared),
            "loss_seed_sd": sd, "loss_seed_band": band, "loss_gap_verdict": verdict}


@dataclass(frozen=True)
class Timing:
    """Which record fields time a cell: the per-sample median and every timed step of a sample."""

    median: str = "step_ms_p50"
    steps: str = "step_times_ms"


TRAIN_STEP = Timing()
DECODE_STEP = Timing("decode_ms_per_token_p50", "decode_times_ms")  # one decode step: a token for each row of the batch
PREFILL = Timing("prefill_ms_p50", "prefill_times_ms")


def timing_for(workload: Any) -> Timing:
    """What times a cell of ``workload``: a training step, or (infer) a decode step; the one place that says so."""
    return DECODE_STEP if workload == "infer" else TRAIN_STEP


def cell_table(df: pd.DataFrame, timing: Timing = TRAIN_STEP) -> dict[tuple, dict[str, CellStats]]:
    """(shape key) -> variant -> stats, over all samples of that cell (cells in order of first appearance)."""
    out: dict[tuple, dict[str, CellStats]] = {}
    if df.empty:
        return out
    # Rows are grouped by hand over plain lists: a pandas groupby slices every one of the ~100 record columns
    # for each of thousands of cells.
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(_tuples(df, SHAPE_KEYS), df["variant"].tolist())):
        groups.setdefault(key, []).append(i)
    status, median, losses = df["status"].tolist(), df[timing.median].tolist(), df["loss_final"].tolist()
    steps = df[timing.steps].tolist()
    bound = df["launch_bound"].tolist() if "launch_bound" in df else [None] * len(df)
    # a field no record has (teacher-forced fields outside such runs) is read as no values, without a pass per cell
    tf = {name: df[name].tolist() for name in TEACHER_FORCED if name in df and df[name].notna().any()}
    seeds = df["seed"].tolist() if "seed" in df else [None] * len(df)
    present = lambda values, rows: [float(values[i]) for i in rows if values[i] is not None and values[i] == values[i]]
    cells = []
    for (shape, variant), rows in groups.items():
        ok = [i for i in rows if status[i] == "ok"]
        samples = present(median, ok)
        cells.append((shape, variant, ok[0] if ok else rows[0], CellStats(
            variant, "ok" if ok else str(status[rows[0]]), _median(samples) if samples else None, samples,
            list(steps[ok[0]]) if ok and steps[ok[0]] is not None else [], present(losses, ok), None,
            teacher_forced={name: present(tf[name], ok) if name in tf else [] for name in TEACHER_FORCED},
            loss_by_seed={int(seeds[i]): float(losses[i]) for i in ok if seeds[i] == seeds[i] and seeds[i] is not None
                          and losses[i] is not None and losses[i] == losses[i]})))
    firsts = df.iloc[[first for _, _, first, _ in cells]].to_dict("records")  # one take for every cell's record
    bound_rows = {i for i, b in enumerate(bound) if isinstance(b, (bool, np.bool_)) and bool(b) and status[i] == "ok"}
    for (shape, variant, _, stats), record in zip(cells, firsts):
        stats.n_params, stats.record = record.get("n_params"), record
        stats.launch_bound = bool(bound_rows) and any(i in bound_rows for i in groups[(shape, variant)])
        out.setdefault(shape, {})[variant] = stats
    return out


def _pair_row(kind: str, shape: tuple, base: CellStats, other: CellStats, resamples: int,
              rng: np.random.Generator, series: list[str]) -> dict[str, Any]:
    """Ratio base/other (time of the reference over time of the candidate: > 1 means faster)."""
    lo, hi, method = cell_interval(base, other, resamples, rng)
    row = dict(zip(SHAPE_KEYS, shape))
    row.update(series=series_label(row, series), kind=kind, reference=base.variant, candidate=other.variant,
               n_params=base.n_params, reference_ms=base.median_ms, candidate_ms=other.median_ms,
               ratio=base.median_ms / other.median_ms, ci_low=lo, ci_high=hi, ci_method=method,
               n_reference=len(base.samples), n_candidate=len(other.samples),
               launch_bound=base.launch_bound or other.launch_bound)
    # the candidate's variant settings (what a knob comparison groups by) and its final loss against the
    # reference's: the ratio of medians over samples, with an interval where both have two or more
    row.update({k: _get(other.record, k) for k in KNOBS})
    row["fp8_flop_share"] = _get(other.record, "fp8_flop_share")  # how much of the candidate ran in FP8 GEMMs
    row["candidate_stack"] = backend_of(other.record)
    if base.losses and other.losses:
        loss_lo, loss_hi = bootstrap_ratio(other.losses, base.losses, resamples, rng)
        row.update(reference_loss=_median(base.losses), candidate_loss=_median(other.losses),
                   loss_ratio=_median(other.losses) / _median(base.losses), loss_ci_low=loss_lo, loss_ci_high=loss_hi)
    return row


def stack_of(cell: CellStats) -> str | None:
    return backend_of(cell.record)


def precision_of(cell: CellStats) -> str | None:
    return _get(cell.record, "effective_precision") or _get(cell.record, "precision")


def bf16_partner(cell: CellStats) -> str:
    """The BF16 variant an FP8 cell is compared with: its stack's partner (te for te, the twin for torchao),
    built the same way (te_layer, any stack-wide setting)."""
    partner = STACKS[stack_of(cell)].bf16_partner
    return variant_name({**{k: _get(cell.record, k) for k in KNOBS}, "backend": partner, "precision": "bf16",
                         "model": _get(cell.record, "model")})


def fp32_partner(cell: CellStats) -> str:
    """The FP32 variant of a BF16 cell's own stack, built the same way (by its model's defaults, as
    :func:`bf16_partner`: an hf: model's te_layer default is not MiniGPT's)."""
    return variant_name({**{k: _get(cell.record, k) for k in KNOBS}, "backend": stack_of(cell), "precision": "fp32",
                         "model": _get(cell.record, "model")})


TE_GAIN_REFERENCE = variant_name({"backend": "torch", "precision": "bf16"})


@dataclass
class Pairs:
    rows: pd.DataFrame  # one row per pair with a ratio
    unpaired: pd.DataFrame  # cells whose partner is missing or did not finish ok
    resamples: int
    cells: dict[tuple, dict[str, CellStats]] = field(default_factory=dict)  # the cell_table paired, to reuse


def pair_cells(df: pd.DataFrame, timing: Timing = TRAIN_STEP) -> Pairs:
    """FP8 speedups (te-bf16 / te-fp8-*), TE kernel gains (torch-bf16 / te-bf16) and BF16 speedups over FP32
    of the same stack (torch-fp32 / torch-bf16), by ``timing``."""
    cells = cell_table(df, timing)
    series = varying_keys(df)
    n_pairs = sum(len(v) for v in cells.values())
    resamples = int(max(200, min(2000, 400_000 // max(1, n_pairs))))
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    tf_rng = np.random.default_rng(BOOTSTRAP_SEED)  # its own: the timing intervals stay as they were without it
    gap_rng = np.random.default_rng(BOOTSTRAP_SEED)  # likewise for the loss gaps
    rows, unpaired = [], []

    def pair(kind: str, shape: tuple, ref_name: str, cand: CellStats, ref: CellStats | None) -> None:
        if ref is None or ref.status != "ok" or cand.status != "ok":
            if cand.status != "ok":
                why = f"{cand.variant} is {cand.status}: {_get(cand.record, 'error') or ''}".strip(": ")
            elif ref is None:
                why = f"no {ref_name} cell"
            else:
                why = f"{ref_name} is {ref.status}: {_get(ref.record, 'error') or ''}".strip(": ")
            entry = dict(zip(SHAPE_KEYS, shape))
            entry.update(series=series_label(entry, series), kind=kind, cell=cand.variant,
                         partner=ref_name if ref is not None else "-" if cand.status != "ok" else
                         f"{ref_name} (not in this run)", reason=why)  # a cell that did not run needs no partner
            unpaired.append(entry)
            return
        rows.append(_pair_row(kind, shape, ref, cand, resamples, rng, series))
        if kind == "fp8_speedup":
            rows[-1].update(teacher_forced_stats(cand, resamples, tf_rng))
        if kind in LOSS_GAP_KINDS:
            rows[-1].update(loss_gap_stats(ref, cand, resamples, gap_rng))

    for shape, variants in cells.items():
        for name, cell in variants.items():
            if precision_of(cell) == "fp8":
                ref_name = bf16_partner(cell)
                pair("fp8_speedup", shape, ref_name, cell, variants.get(ref_name))
            elif stack_of(cell) == "te" and precision_of(cell) == "bf16":
                pair("te_gain", shape, TE_GAIN_REFERENCE, cell, variants.get(TE_GAIN_REFERENCE))
    # What BF16 buys over FP32 on the same stack, where both ran (a run without FP8 compares nothing else).
    # After the others, so that their intervals (one generator) are the same with or without FP32 cells.
    # A BF16 cell whose own FP32 build is missing where FP32 ran at that shape is listed, not dropped.
    for shape, variants in cells.items():
        fp32_here = {stack_of(c) for c in variants.values() if precision_of(c) == "fp32"}
        for name, cell in variants.items():
            if precision_of(cell) == "bf16" and stack_of(cell) in fp32_here:
                pair("bf16_speedup", shape, fp32_partner(cell), cell, variants.get(fp32_partner(cell)))
    return Pairs(pd.DataFrame(rows), pd.DataFrame(unpaired), resamples, cells)


EXECUTION_KEYS = axis_fields("execution")
# The execution fields that only change how the same per-rank work is issued (graphs, compile, recompute): a
# comparison across execution modes varies these. world_size and parallel change the work itself (batch_size is
# per rank: a 2-rank FSDP step does twice a 1-rank step's work), so they stay part of what is compared like with like.
MODE_KEYS = [k for k in EXECUTION_KEYS if k not in ("world_size", "parallel")]


def execution_label(values: Any) -> str:
    """'graphs', 'compiled' or 'eager': how a cell's step was issued."""
    on = [name for name, key in (("graphs", "cuda_graphs"), ("compiled", "compile")) if _get(values, key)]
    return "+".join(on) or "eager"


def ways_that_ran(df: pd.DataFrame) -> int:
    """How many (stack, execution mode) combinations have a cell that ran ok: with one, every cell's fastest
    BF16 is its own stack's and the cross-stack comparison adds nothing."""
    ok = df[df["status"] == "ok"]
    columns = [c for c in _VARIANT_COLUMNS if c in ok]
    rows = (dict(zip(columns, v)) for v in set(_tuples(ok, columns)))  # each distinct combination once
    return len({(backend_of(r), execution_label(r)) for r in rows})


def against_fastest_bf16(df: pd.DataFrame, timing: Timing = TRAIN_STEP, same_execution: bool = False,
                         cells: dict[tuple, dict[str, CellStats]] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every cell against the fastest BF16 cell of its shape (any stack, any execution mode), and per shape
    the fastest FP8 cell of each stack against each other stack's: (rows, head_to_head).

    A shape is everything but the variant and the execution mode (MODE_KEYS; world_size and parallel are
    part of the shape; ``same_execution``: the mode too, as serving compares graphed decode with graphed
    decode). ratio = reference ms / cell ms (> 1: the cell is faster), with the usual 95% interval. ``cells``:
    ``cell_table(df, timing)`` where the caller has it (``Pairs.cells``).
    """
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    base_at = [i for i, k in enumerate(SHAPE_KEYS) if same_execution or k not in MODE_KEYS]
    series = [k for k in varying_keys(df) if k not in MODE_KEYS]  # e.g. arch, vocab: one line per family
    by_base: dict[tuple, list[tuple[tuple, CellStats]]] = {}
    for shape, variants in (cell_table(df, timing) if cells is None else cells).items():
        for cell in variants.values():
            if cell.status == "ok" and cell.median_ms:
                base = tuple(None if shape[i] != shape[i] else shape[i] for i in base_at)  # NaN never equals NaN
                by_base.setdefault(base, []).append((shape, cell))
    rows, heads = [], []
    resamples = 1000

    def ratio(ref: CellStats, cand: CellStats) -> dict[str, Any]:
        lo, hi, method = cell_interval(ref, cand, resamples, rng)
        return {"ratio": ref.median_ms / cand.median_ms, "ci_low": lo, "ci_high": hi, "ci_method": method}

    def label(shape: tuple, cell: CellStats) -> str:
        return f"{cell.variant} {execution_label(dict(zip(SHAPE_KEYS, shape)))}"

    for base, cells in by_base.items():
        where = dict(zip([SHAPE_KEYS[i] for i in base_at], base))
        bf16 = [(s, c) for s, c in cells if precision_of(c) == "bf16"]
        if bf16:
            fs, fastest = min(bf16, key=lambda sc: sc[1].median_ms)
            for shape, cell in cells:
                rows.append({**where, "series": series_label(where, series), "n_params": cell.n_params,
                             "cell": label(shape, cell), "variant": cell.variant, "stack": stack_of(cell),
                             "precision": precision_of(cell), "ms": cell.median_ms,
                             "fastest BF16": label(fs, fastest), "fastest BF16 stack": stack_of(fastest),
                             "BF16 ms": fastest.median_ms,
                             **ratio(fastest, cell), "n": len(cell.samples)})
        best: dict[str, tuple[tuple, CellStats]] = {}
        for shape, cell in cells:
            if precision_of(cell) == "fp8" and (stack_of(cell) not in best
                                                or cell.median_ms < best[stack_of(cell)][1].median_ms):
                best[stack_of(cell)] = (shape, cell)
        names = [s for s in STACKS if s in best]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                (sa, ca), (sb, cb) = best[a], best[b]
                r = ratio(ca, cb)  # a's time over b's: < 1 means a's fastest FP8 is faster
                heads.append({**where, "n_params": ca.n_params, "a": label(sa, ca), "a ms": ca.median_ms,
                              "b": label(sb, cb), "b ms": cb.median_ms, "a/b time": r["ratio"],
                              "CI low": r["ci_low"], "CI high": r["ci_high"], "CI over": r["ci_method"]})
    return pd.DataFrame(rows), pd.DataFrame(heads)


def crossover(xs: list[float], ys: list[float]) -> float | None:
    """The x (interpolated in log x) from which y stays >= 1.0: between the last point below 1.0 and the next.
    None where no point is below 1.0, or the last point is: a line that crosses up and falls back below
    (0.88, 1.08, 0.99, 0.94, 1.41) crosses for good only after its last dip."""
    pts = sorted((x, y) for x, y in zip(xs, ys) if x and y == y)
    below = [i for i, (_, y) in enumerate(pts) if y < 1.0]
    if not below or below[-1] == len(pts) - 1:
        return None
    (x0, y0), (x1, y1) = pts[below[-1]], pts[below[-1] + 1]
    t = (1.0 - y0) / (y1 - y0)
    return float(np.exp(np.log(x0) + t * (np.log(x1) - np.log(x0))))


# What a number was measured under, shown for both sides of a comparison: a cap or a clock that differ
# can explain a changed step time by themselves.
CONDITIONS = ("power_limit_w", "sm_clock_mean_mhz")


def _condition(group: pd.DataFrame, name: str) -> float | None:
    values = group[name].dropna() if name in group else []
    return float(np.median(values)) if len(values) else None


ONE_SAMPLE = "one sample: run-to-run noise unknown, use samples >= 2"
NO_TIMING = "no timing: no sample on a side has its workload's time"


def compare_runs(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Per cell present in both: time ratio B/A (the step, or for infer cells the decode step: ``timing_for``)
    with a 95% interval over samples; 'changed' when it excludes 1. A cell with one sample on a side is never
    called changed: the spread of one trial's steps says nothing of how two runs differ (a new process,
    another clock, another allocator state), so its verdict says so instead."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    rows = []
    a_ok, b_ok = a[a["status"] == "ok"], b[b["status"] == "ok"]
    columns = ["cell_id", "cell_label", "variant", "n_params", "a_ms", "b_ms", "ratio_b_over_a", "ci_low", "ci_high",
               "changed", "verdict", "n_a", "n_b", "timing", *[f"{side}_{c}" for side in "ab" for c in CONDITIONS]]
    for cid, ga in a_ok.groupby("cell_id"):
        gb = b_ok[b_ok["cell_id"] == cid]
        if gb.empty:
            continue
        timing = timing_for(ga["workload"].iloc[0] if "workload" in ga else None)
        sa, sb = (list(g[timing.median].dropna()) if timing.median in g else [] for g in (ga, gb))
        if not sa or not sb:
            lo, hi, changed, verdict = float("nan"), float("nan"), False, NO_TIMING
        elif len(sa) >= 2 and len(sb) >= 2:
            lo, hi = bootstrap_ratio(sb, sa, 1000, rng)
            changed = bool(lo > 1.0 or hi < 1.0)
            verdict = "changed" if changed else "within noise"
        else:
            lo, hi, changed, verdict = float("nan"), float("nan"), False, ONE_SAMPLE
        ratio = _median(sb) / _median(sa)
        first = ga.iloc[0]
        rows.append({"cell_id": cid, "cell_label": first["cell_label"], "variant": first["variant"],
                     "n_params": first["n_params"], "a_ms": _median(sa), "b_ms": _median(sb), "ratio_b_over_a": ratio,
                     "ci_low": lo, "ci_high": hi, "changed": changed, "verdict": verdict, "n_a": len(sa),
                     "n_b": len(sb), "timing": timing.median,
                     **{f"{side}_{c}": _condition(g, c) for side, g in (("a", ga), ("b", gb)) for c in CONDITIONS}})
    return pd.DataFrame(rows, columns=columns)



def _interval(value: float, lo: float, hi: float, scale: float = 1.0, unit: str = "") -> str:
    if value != value:
        return "-"
    text = f"{value * scale:.3g}{unit}"
    return text + (f" [{lo * scale:.3g}, {hi * scale:.3g}]" if lo == lo and hi == hi else " [no interval]")


def _verdict(a: tuple[float, float], b: tuple[float, float], over_samples: bool = True) -> str:
    """'beyond noise' when the two 95% intervals (over samples: ``over_samples``) do not overlap."""
    if any(v != v for v in (*a, *b)):
        return "no interval to judge by (one sample: use samples >= 2)"
    if not over_samples:
        return NOT_JUDGED
    return "beyond noise" if a[1] < b[0] or b[1] < a[0] else "within noise"


# A knob comparison holds everything else equal: shape, execution, the other knobs, and the FP8 cell's stack, so the
# BF16 each speedup is over is of one stack (a torchao recipe over the twin's BF16 is never set against a TE recipe
# over TE's). Within a stack the partner is built as its FP8 cell is (te_layer): te_layer compares two builds, each
# over its own BF16.
KNOB_PAIRING = ["candidate_stack"]


def knob_effects(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Each FP8 knob that takes several values, against cells equal in everything else (KNOB_PAIRING): the
    speedup over the BF16 of the FP8 cell's own stack and the final loss against it, with intervals, and one
    sentence per comparison."""
    sp = rows[rows["kind"] == "fp8_speedup"] if not rows.empty else rows
    table: list[dict[str, Any]] = []
    sentences: list[str] = []
    if not sp.empty:
        sp = sp.assign(loss_pct=100 * (sp.get("loss_ratio", np.nan) - 1),
                       loss_lo=100 * (sp.get("loss_ci_low", np.nan) - 1),
                       loss_hi=100 * (sp.get("loss_ci_high", np.nan) - 1))
    for knob in KNOBS:
        if sp.empty or knob not in sp or sp[knob].nunique(dropna=True) < 2:
            continue
        keys = SHAPE_KEYS + [k for k in KNOBS if k != knob] + KNOB_PAIRING
        shown = [knob, "reference", "d_model", "n_layers", "cuda_graphs", "series", "ratio", "ci_low", "ci_high",
                 "ci_method", "loss_pct", "loss_lo", "loss_hi", "n_candidate"]
        # the rows as tuples once, and only row positions grouped: slicing every group's ~80 pair columns (and
        # the pandas calls on each) cost seconds at 10k records
        tuples = list(sp[shown].itertuples())
        positions = pd.Series(range(len(sp)), index=sp.index)
        for key, at in positions.groupby([sp[k] for k in keys], dropna=False, sort=True):
            g = [tuples[i] for i in at]
            if len({v for r in g if (v := known(getattr(r, knob))) is not None}) < 2:  # nunique(dropna=True)
                continue
            where = dict(zip(keys, key))
            default = default_for(knob, where)  # the model source's where it has one (te_layer)
            g = [g[i] for i in np.argsort([getattr(r, knob) != default for r in g], kind="stable")]  # default first
            base = g[0]
            context = f"{where['candidate_stack']} FP8, d_model {where['d_model']} x {where['n_layers']} layers" + (
                " (CUDA graphs)" if where["cuda_graphs"] else "") + (f", {base.series}" if base.series else "")
            for r in g:
                table.append({"knob": knob, "value": getattr(r, knob), "BF16 partner": r.reference,
                              "d_model": r.d_model, "n_layers": r.n_layers,
                              "graphs": r.cuda_graphs, "series": r.series, "speedup": r.ratio, "CI low": r.ci_low,
                              "CI high": r.ci_high, "CI over": r.ci_method, "loss vs BF16 %": r.loss_pct,
                              "loss CI low %": r.loss_lo,
                              "loss CI high %": r.loss_hi, "n": r.n_candidate})
                if r is base:
                    continue
                speed = _verdict((r.ci_low, r.ci_high), (base.ci_low, base.ci_high),
                                 r.ci_method == base.ci_method == OVER_SAMPLES)
                loss = _verdict((r.loss_lo, r.loss_hi), (base.loss_lo, base.loss_hi))
                sentences.append(
                    f"{context}: {knob} {getattr(r, knob)} vs {getattr(base, knob)} — speedup "
                    f"{_interval(r.ratio, r.ci_low, r.ci_high, unit='x')} over {r.reference} vs "
                    f"{_interval(base.ratio, base.ci_low, base.ci_high, unit='x')} over {base.reference}: "
                    f"{speed}; final loss vs BF16 "
                    f"{_interval(r.loss_pct, r.loss_lo, r.loss_hi, unit='%')} vs "
                    f"{_interval(base.loss_pct, base.loss_lo, base.loss_hi, unit='%')}: {loss}.")
    frame = pd.DataFrame(table)
    if not frame.empty:
        frame = frame.round({"speedup": 3, "CI low": 3, "CI high": 3, "loss vs BF16 %": 2, "loss CI low %": 2,
                             "loss CI high %": 2})
        if not frame["series"].astype(bool).any():
            frame = frame.drop(columns="series")
    return frame, sentences


# Depths of published models a per-layer split is extrapolated to (Llama-3.2-1B: 16, Llama-3-8B: 32, 70B: 80).
REFERENCE_DEPTHS = (16, 32, 80)


def per_layer_costs(df: pd.DataFrame, cells: dict[tuple, dict[str, CellStats]] | None = None
                    ) -> tuple[pd.DataFrame, list[str]]:
    """How a step splits into transformer layers and the rest (embedding, LM head, loss, optimizer of those),
    from the same cell timed at two depths: per layer = (t_deep - t_shallow) / (L_deep - L_shallow).

    Also the FP8 speedup such a split implies at the depths of published models: an estimate from a
    linear model of depth, labelled as one, not a measurement. ``cells``: ``cell_table(df)`` where the caller has
    it (``Pairs.cells``).
    """
    depth = SHAPE_KEYS.index("n_layers")
    by_shape: dict[tuple, dict[int, dict[str, CellStats]]] = {}
    for shape, variants in (cell_table(df) if cells is None else cells).items():
        if shape[depth] is not None:  # a depth the model chose itself cannot be set to a second one
            by_shape.setdefault(shape[:depth] + shape[depth + 1:], {})[int(shape[depth])] = variants
    rows: list[dict[str, Any]] = []
    sentences: list[str] = []
    for rest_of_shape, depths in by_shape.items():
        if len(depths) < 2:
            continue
        l1, l2 = min(depths), max(depths)
        where = dict(zip(SHAPE_KEYS[:depth] + SHAPE_KEYS[depth + 1:], rest_of_shape))
        kv = where.get("n_kv_heads")
        heads = "/".join(UNSET if v is None else str(int(v))
                         for v in (where["n_heads"], where["n_heads"] if kv is None else kv))
        split: dict[str, dict[str, Any]] = {}  # variant -> its row
        for name, shallow in depths[l1].items():
            deep = depths[l2].get(name)
            if deep is None or shallow.median_ms is None or deep.median_ms is None:
                continue
            layer = (deep.median_ms - shallow.median_ms) / (l2 - l1)
            split[name] = {"arch": where.get("arch"), "d_model": where["d_model"], "ffn": where["ffn"],
                           "heads/kv": heads, "vocab": where["vocab"], "seq_len": where["seq_len"],
                           "graphs": where["cuda_graphs"], "variant": name, "depths": f"{l1}, {l2}",
                           "ms shallow": shallow.median_ms, "ms deep": deep.median_ms, "per layer ms": layer,
                           "rest ms": shallow.median_ms - l1 * layer,
                           "layer share at deep": l2 * layer / deep.median_ms}
            rows.append(split[name])
        context = (f"{where.get('arch')} d_model {where['d_model']}, ffn {where['ffn']}, {heads} heads, "
                   f"vocab {where['vocab']}, seq {where['seq_len']}" + (" (CUDA graphs)" if where["cuda_graphs"] else ""))
        for name, row in split.items():
            ref = split.get(bf16_partner(depths[l1][name])) if precision_of(depths[l1][name]) == "fp8" else None
            if ref is None:
                continue
            layer, rest, b_layer, b_rest = row["per layer ms"], row["rest ms"], ref["per layer ms"], ref["rest ms"]
            estimates = {d: (b_rest + d * b_layer) / (rest + d * layer) for d in REFERENCE_DEPTHS}
            row["per-layer speedup"] = b_layer / layer
            row.update({f"est. speedup at {d} layers": v for d, v in estimates.items()})
            sentences.append(
                f"{context}: one layer takes {b_layer:.2f} ms in {ref['variant']} and {layer:.2f} ms in {name} "
                f"(per-layer FP8 speedup {b_layer / layer:.2f}x); the rest of the step {b_rest:.2f} ms vs {rest:.2f} ms. "
                "Estimated end-to-end FP8 speedup for the full-depth model (an estimate from this split, not "
                "measured): " + ", ".join(f"{v:.2f}x at {d} layers" for d, v in estimates.items()) + ".")
    table = pd.DataFrame(rows)
    return (table.round(3) if not table.empty else table), sentences
