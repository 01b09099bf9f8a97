"""Where in the model FP8 loses precision: per-layer error forward and backward, cast health, outliers.

Three reads of an FP8 training cell (``fp8_reads: true``, the default; docs/guide/numerics.md says what each
figure means and where its floor comes from):

    per-layer SQNR   after the cell's timed steps, on one held batch, for every module that runs its GEMMs in FP8:
                     the module's FP8 output, input gradient and weight gradient against the same module computed
                     in BF16 on the same input with the same upstream gradient (the held loss taken over a
                     training step's token count: :func:`read_layers`), SQNR in dB
                     (10 log10(sum ref^2 / sum (ref - x)^2), torchao's ``compute_error``; a NaN read as -inf)
    cast health      per operand class (act: the GEMM's input, weight, grad: the output gradient): the share of
                     elements the recipe's scale flushes to zero (nonzero, cast to FP8 zero) and the share it
                     saturates (|x * scale| beyond the format's maximum by more than half a unit in the last
                     place: the clamp, not the rounding, decides its value)
    outliers         max|x| / rms and kurtosis (E[(x - mean)^4] / var^2; 3 for a Gaussian) of every FP8 module's
                     input (MiniGPT llama's fc2: the SwiGLU product feeding the down projection), on the held
                     batch, sampled every ``outlier_every(train_steps)`` training steps

How a stack finds its FP8 modules, runs one in BF16 and scales its operands is the stack's seam
(``trials/backends/<stack>_numerics.py``, loaded by :func:`trials.backends.numerics`); everything here is the
same for every stack.

None of it moves a timed number or the loss curve: the per-layer read runs after the timed steps, inside the
stack's ``read_context`` and ``quiet`` (the RNG states kept), and before the energy window and the profiled
steps, which train on for as many steps as the measured step time asks: read after them, the model would be
a timing-dependent number of steps further on and two runs of one seeded cell would not read the same. The
outlier samples run between training steps (never the timed ones) as a
forward of their own on the held batch, in eval mode and without grad, inside ``torch.random.fork_rng`` and the
stack's ``read_context`` (TE delayed: its scaling state restored), so training sees what it would have without
them. Their cost is recorded (``fp8_layers_s``, ``outliers_s``; the latter is inside ``train_s``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from ..workloads.loss import next_token_loss
from .fp8_floors import DIRECTIONS, OPERANDS, SQNR_FLOOR_DB

log = logging.getLogger(__name__)

OUTLIER_SAMPLES = 8  # outlier samples over a training run (the last step always among them)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref``, dB (inf: identical; -inf: ref all zero)."""
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum()
    signal = ref.pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(signal / noise))


@dataclass(frozen=True)
class CastHealth:
    underflow: float  # share of all elements: nonzero, cast to FP8 zero under the scale
    saturation: float  # share of all elements: |x * scale| beyond the format's maximum by more than half an ulp


def cast_health(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> CastHealth:
    """How ``x`` fares cast to FP8 ``dtype`` under ``scale`` (broadcastable to ``x``: one per tensor, per row),
    as a saturating cast does it: ``x * scale`` clamped to the format's range, rounded to ``dtype``."""
    info = torch.finfo(dtype)
    big = info.max
    # a round-to-nearest cast brings values up to half a unit in the last place above the maximum down to it
    # (e4m3: 448 + 16); only beyond that does the clamp lose anything (an amax element scaled to exactly the
    # maximum can land a rounding above it in fp32: not saturated)
    limit = big + 2.0 ** math.floor(math.log2(big)) * info.eps / 2
    scaled = x.float() * scale.float()
    cast = scaled.clamp(-big, big).to(dtype)
    n = max(1, x.numel())
    underflow = int(((cast.float() == 0) & (x != 0)).sum()) / n
    saturation = int((scaled.abs() > limit).sum()) / n
    return CastHealth(underflow, saturation)


def outlier_stats(x: torch.Tensor) -> tuple[float, float]:
    """(max|x| / rms, kurtosis) of all of ``x``'s elements (kurtosis: E[(x - mean)^4] / var^2, 3 for a Gaussian;
    both nan for an all-zero tensor)."""
    x = x.detach().double().flatten()
    rms = x.pow(2).mean().sqrt()
    centred = x - x.mean()
    var = centred.pow(2).mean()
    ratio = float(x.abs().max() / rms) if rms > 0 else math.nan
    kurtosis = float(centred.pow(4).mean() / var.pow(2)) if var > 0 else math.nan
    return ratio, kurtosis


def outlier_every(train_steps: int) -> int:
    """Training steps between outlier samples: OUTLIER_SAMPLES of them over the run."""
    return max(1, math.ceil(train_steps / OUTLIER_SAMPLES))


@contextlib.contextmanager
def quiet(model: nn.Module, device: str):
    """Eval mode (no dropout), the RNG states kept and compiled units run eager: a read draws nothing training
    would have drawn (these reads and the teacher-forced one, trials/workloads/training.fp8_read) and compiles
    nothing. A read's hooks inside a compiled unit would make Dynamo trace them: graph breaks, recompiles that
    spend the recompile limit (the timed steps then ran eager: hf:llama 32 layers on torchao, 0.41x of BF16 on an
    H200), and errors torchao's float8 tensors meet under dynamic shapes."""
    was_training = model.training
    rng = [torch.cuda.current_device()] if device == "cuda" else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=rng), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.train(was_training)


@dataclass
class LayerRead:
    """One FP8 module's read: SQNR per direction (dB) and cast health per operand class."""

    name: str
    sqnr: dict[str, float]  # direction -> dB
    cast: dict[str, CastHealth]  # operand class -> shares


def _module_pass(seam: ModuleType, module: nn.Module, x: torch.Tensor, dy: torch.Tensor, fp8: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input gradient, weight gradients flattened and concatenated) of ``module`` alone on ``x`` with
    upstream gradient ``dy``, in FP8 as the cell trains it or in BF16 (``seam.run``); the module's own
    gradients are cleared after."""
    weights = seam.weights(module)
    for w in weights:
        w.grad = None
    xi = x.detach().clone().requires_grad_(True)
    y = seam.run(module, xi, fp8)
    y.backward(dy)
    dw = torch.cat([w.grad.detach().flatten().float() for w in weights])
    for w in weights:
        w.grad = None
    return y.detach(), xi.grad.detach(), dw


# submodule names that torch's wrappers insert (torch.compile's OptimizedModule, checkpoint_wrapper), not the model's
WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")


def fp8_modules(seam: ModuleType, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The seam's FP8 modules of ``model``, named as the model names them (fp8_converted_names): without the
    wrappers' segments a compiled unit adds (``layers.23._orig_mod.self_attn.k_proj`` read as
    ``layers.23.self_attn.k_proj``)."""
    return [(".".join(p for p in name.split(".") if p not in WRAPPERS), m) for name, m in seam.fp8_modules(model)]


def read_layers(step: Any, seam: ModuleType, held: tuple[torch.Tensor, torch.Tensor], device: str,
                train_tokens: int | None = None) -> tuple[list[LayerRead], int]:
    """Every FP8 module of ``step.model``, read on the held batch (the module docstring): the reads, in model
    order, and how many FP8 modules the model runs (more than were read where some saw no forward). One forward and
    backward of the whole model in FP8 gives each module's input and upstream gradient (the cross-entropy's on
    the held targets); each module is then run alone on them, in FP8 and in BF16. Parameters' gradients are
    left as they were found (cleared: a training step leaves none).

    ``train_tokens``: the tokens a training step's loss averages over (a rank's whole step: batch_size * seq_len *
    grad_accum, each micro-batch's loss divided by grad_accum). The held loss is
    summed and divided by that count, so each held gradient element is the size training's were: the held
    batch is one row, and its mean loss would make every gradient batch_size times larger than those the
    recipe's scales were made from. SQNR does not see the factor (both sides get the same dy, and it is a
    ratio), nor does a recipe that scales each tensor by its own amax (torchao, TE current scaling); only
    delayed scaling's does, whose backward scales come from training's gradients: its FP8 backward passes and
    grad cast health would otherwise read a gradient its history never saw (saturated). None: the held
    batch's own token count (its mean), as before this argument existed."""
    modules = fp8_modules(seam, step.model)
    seen: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in modules}

    def keep(name: str):
        def hook(_module: nn.Module, args: tuple, output: Any) -> None:
            if "x" in seen[name]:  # called twice in one forward (a shared module): no one input to read it on
                seen[name]["reused"] = args[0]
                return
            seen[name]["x"] = args[0].detach()
            out = output[0] if isinstance(output, (tuple, list)) else output
            out.register_hook(lambda g: seen[name].__setitem__("dy", g.detach()))
        return hook

    x, y = held
    handles = [m.register_forward_hook(keep(name)) for name, m in modules]
    reads: list[LayerRead] = []
    try:
        with quiet(step.model, device), seam.read_context(step) as saved:
            with seam.fp8_context(step, saved):
                logits = step.model(x)
            # the hooks go before the backward: activation checkpointing's recompute runs the units' forwards
            # again inside it, and a hook still there took each recomputed module for one called twice (a
            # shared module) and left it out (full-depth hf:llama on torchao, AC full: 32 of 224 FP8 modules
            # read, the down projections only, whose forwards the recompute stops before). The gradient hooks
            # stay: they sit on the first forward's outputs, which the backward reaches whether or not it
            # recomputes what lies between
            for h in handles:
                h.remove()
            handles = []
            loss = next_token_loss(logits, y)
            if train_tokens:  # the held mean as a sum over training's token count
                loss = loss * (y.numel() / train_tokens)
            loss.backward()
            for p in step.model.parameters():
                p.grad = None
            for name, module in modules:
                got = seen[name]
                if "x" not in got or "dy" not in got or "reused" in got:
                    log.info("fp8 layer read: %s saw no forward, no gradient or two forwards, left out", name)
                    continue
                with seam.fp8_context(step, saved):
                    out8, dx8, dw8 = _module_pass(seam, module, got["x"], got["dy"], fp8=True)
                out16, dx16, dw16 = _module_pass(seam, module, got["x"], got["dy"], fp8=False)
                sqnr = {"fwd": sqnr_db(out16, out8), "dgrad": sqnr_db(dx16, dx8), "wgrad": sqnr_db(dw16, dw8)}
                cast = {cls: cast_health(t, s, dt) for cls, (t, s, dt) in seam.casts(module, got["x"], got["dy"],
                                                                                      step, saved).items()}
                reads.append(LayerRead(name, sqnr, cast))
    finally:
        for h in handles:
            h.remove()
        for p in step.model.parameters():
            p.grad = None
    if len(reads) < len(modules):
        log.warning("fp8 layer read: %d of %d FP8 modules read (fp8_layers_read, fp8_layers_total)", len(reads),
                    len(modules))
    return reads, len(modules)


@dataclass
class OutlierTrend:
    """Outlier samples over training: the training step after which each was taken, and per module one value
    per sample."""

    steps: list[int] = field(default_factory=list)
    ratio: dict[str, list[float]] = field(default_factory=dict)  # module -> max|x| / rms per sample
    kurtosis: dict[str, list[float]] = field(default_factory=dict)  # module -> kurtosis per sample
    seconds: float = 0.0  # what the samples cost, s (inside train_s)


class OutlierSampler:
    """``train``'s ``after_step``: every ``every`` training steps (and after the last), a forward of the FP8
    model on the held batch with hooks on each FP8 module's input, outside the training step (the module
    docstring)."""

    def __init__(self, step: Any, seam: ModuleType, held: torch.Tensor, device: str, every: int, steps: int):
        self.step, self.seam, self.held, self.device = step, seam, held, device
        self.every, self.last = every, steps - 1
        self.trend = OutlierTrend()
        self.failed = False

    def __call__(self, i: int) -> None:
        if self.failed or ((i + 1) % self.every and i != self.last):
            return
        self._sync()  # the training step's kernels still queued are the step's time, not the sample's
        t = time.perf_counter()
        try:
            self._sample(i)
            self._sync()  # and the sample's own still queued (its forward past the last hook) are the sample's
        except Exception as exc:  # noqa: BLE001 - training goes on without the samples
            log.warning("outlier sample after step %d failed, no more taken: %s: %s", i, type(exc).__name__, exc)
            self.failed = True
        self.trend.seconds += time.perf_counter() - t

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _sample(self, i: int) -> None:
        modules = fp8_modules(self.seam, self.step.model)
        got: dict[str, tuple[float, float]] = {}

        def keep(name: str):
            def hook(_module: nn.Module, args: tuple) -> None:
                got[name] = outlier_stats(args[0])
            return hook

        handles = [m.register_forward_pre_hook(keep(name)) for name, m in modules]
        try:
            with torch.no_grad(), quiet(self.step.model, self.device), \
                    self.seam.read_context(self.step) as saved, self.seam.fp8_context(self.step, saved):
                self.step.model(self.held)
        finally:
            for h in handles:
                h.remove()
        self.trend.steps.append(i)
        for name, (ratio, kurt) in got.items():
            self.trend.ratio.setdefault(name, []).append(ratio)
            self.trend.kurtosis.setdefault(name, []).append(kurt)


def _finite(values: list[tuple[str, float]]) -> list[tuple[str, float]]:
    return [(n, v) for n, v in values if not math.isnan(v)]


def broken_is_worst(db: float) -> float:
    """A NaN SQNR as -inf, the worst: NaN is what a layer whose FP8 output (or gradient) holds a NaN reads, and
    min() and a floor's ``<`` pass over it, so the summary read the good layers only. (+inf stays: a module
    FP8 leaves exact.) The report applies the same rule to records written before it
    (orchestrator/report/numerics.py)."""
    return -math.inf if math.isnan(db) else db


def record_fields(reads: list[LayerRead], trend: OutlierTrend | None, total: int | None = None) -> dict[str, Any]:
    """The record's fields (trials/record/fields.py) from the reads: min, median and worst module per direction
    (a NaN SQNR counted as -inf: :func:`broken_is_worst`), worst share and module per operand class, the last
    outlier sample's largest values, how many FP8 modules were read of ``total``, how many run (fewer read than
    run is a partial read the record says, never a full one; both from :func:`read_layers`), and every per-layer
    value as JSON (``fp8_layers``) for the report."""
    out: dict[str, Any] = {"fp8_layers_read": len(reads), "fp8_layers_total": total}
    sqnr = {d: [broken_is_worst(r.sqnr[d]) for r in reads] for d in DIRECTIONS}
    for d in DIRECTIONS:
        values = list(zip((r.name for r in reads), sqnr[d]))
        if values:
            worst = min(values, key=lambda nv: nv[1])
            out.update({f"sqnr_{d}_min_db": worst[1], f"sqnr_{d}_median_db": statistics.median(v for _, v in values),
                        f"sqnr_{d}_worst": worst[0]})
    for cls in OPERANDS:
        for kind in ("underflow", "saturation"):
            values = [(r.name, getattr(r.cast[cls], kind)) for r in reads if cls in r.cast]
            if values:
                worst = max(values, key=lambda nv: nv[1])
                out.update({f"cast_{kind}_{cls}": worst[1],  # no module is worst where none loses anything
                            f"cast_{kind}_{cls}_worst": worst[0] if worst[1] > 0 else None})
    if trend is not None and trend.steps:
        last = _finite([(n, v[-1]) for n, v in trend.ratio.items()])
        if last:
            worst = max(last, key=lambda nv: nv[1])
            out.update(outlier_ratio_max=worst[1], outlier_ratio_worst=worst[0])
        kurt = _finite([(n, v[-1]) for n, v in trend.kurtosis.items()])
        if kurt:
            out["outlier_kurtosis_max"] = max(v for _, v in kurt)
    layers = {"floors_db": SQNR_FLOOR_DB,
              "modules": [r.name for r in reads],
              "sqnr": sqnr,
              "cast": {cls: {kind: [asdict(r.cast[cls])[kind] if cls in r.cast else None for r in reads]
                             for kind in ("underflow", "saturation")} for cls in OPERANDS}}
    if trend is not None:
        layers["outliers"] = {"steps": trend.steps, "ratio": trend.ratio, "kurtosis": trend.kurtosis}
    # inf (a module FP8 leaves exact) is written as Infinity, -inf (a broken one) as -Infinity, both read back
    out["fp8_layers"] = json.dumps(layers)
    return out
