"""Where a step's time goes: the kernels of a few profiled steps, sorted into classes by name.

A speedup says how much faster; the breakdown says why not more. After the timed blocks (never
inside them) :func:`profile` runs a few more steps under ``torch.profiler`` and sums every GPU
kernel's device time, then :func:`classify` puts each kernel in one class by its name. The time at
least one kernel ran (:func:`busy_us`, the union of their intervals over every stream) beside the
timed p50 is the step's GPU busy time; the rest is the GPU waiting (on the host, on a sync). It is
not the classes' sum where streams overlap: a DDP/FSDP all-reduce on NCCL's stream runs beside the
compute (and spins while it waits for the other ranks), so a 100 ms step with 30 ms of it overlapped
sums to 130 ms of kernels, and the sum would leave a gap of -30 ms. On CPU the same is done with aten
operators' self time, so every trial fills the same fields; but the profiler slows a CPU step (it
runs on the same cores), so the operators' times are scaled by the timed step over the profiled
step's own wall clock: the classes and the gap then add up to the timed step, the gap being host
time outside aten operators (Python, the optimizer's loop), never GPU idle.

The rules are declared once, here, in the order they are tried (the first match wins): an FP8 GEMM
is a GEMM whose name carries an FP8 type, and is tried before the cast rules that also match FP8
type names. ``tests/fixtures/h200_kernels.json`` holds real kernel names from the H200 (collected by
``benchmarks/kernel_names.py``) and the class each must get.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# Class -> what it holds. The record has one ``kernel_ms_<class>`` field per class (trials/record/fields.py).
CLASSES: dict[str, str] = {
    "gemm_bf16": "GEMMs not in FP8, in the cell's own higher precision: BF16/FP16, or FP32 in an fp32 cell (the "
                 "report names those gemm_fp32) (cuBLAS, CUTLASS, Triton templates; the LM head of FP8 models)",
    "gemm_fp8": "GEMMs with FP8 operands",
    "fp8_cast": "FP8 quantize, cast, transpose, amax and scale updates",
    "attention": "fused attention (flash, cuDNN, memory-efficient SDPA)",
    "elementwise": "normalisation, activations, residual adds, the loss, embeddings and other element-wise kernels",
    "optimizer": "the optimizer step (fused or multi-tensor AdamW)",
    "comm": "collectives (NCCL, gloo)",
    "other": "memory copies and fills, KV-cache bookkeeping, and whatever no rule names",
}

_FP8 = r"(e4m3|e5m2|fp8|float8|f8f8)"
# aten's GEMMs as CPU operators: plain, batched, FP8 (_scaled_*) and grouped (MoE experts: _grouped_mm)
_GEMM = r"(gemm|nvjet|cutlass|xmma|wgmma|cublas|triton_tem_|aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_grouped_mm|" \
        r"_scaled_grouped_mm)$)"

# (class, regular expression searched in the lower-cased kernel name), tried in this order.
# cuBLASLt's Hopper GEMMs are "nvjet_sm90_<types>_...": tst = BF16 in, FP32 accumulate, BF16 out;
# qqtst / qrtst = E4M3 x E4M3 (or x E5M2, the backward's gradients) in, BF16 out. Inductor names a
# fused kernel after the ops it fused: torchao's casts show up as triton kernels with amax, clamp and
# reciprocal (the scale) in their names, often fused with a GELU or a layer norm beside them.
RULES: tuple[tuple[str, str], ...] = (
    ("comm", r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter"),
    ("other", r"^(memcpy|memset)|kv_cache|^aten::(copy_|fill_|zero_|empty|to|_to_copy)$"),
    ("gemm_fp8", rf"nvjet_sm\d+_[qr][qr]|{_GEMM}.*{_FP8}|{_FP8}.*{_GEMM}|^aten::_scaled_(grouped_)?mm$"),
    ("fp8_cast", r"^triton_.*(amax|_clamp_|reciprocal|abs_.*max|exp2_floor_log2|_scaled_mm)"),
    ("attention", r"flash|fmha|attention|sdpa|attn|cudnn::fusion"),
    # torchao's eager dynamic activation quantization: abs, max and clamp as kernels of their own
    ("fp8_cast", r"absfunctor|launch_clamp_scalar|maxnanfunctor"),
    ("fp8_cast", rf"{_FP8}|(?<!no)cast|quantiz|amax|scale_update|delayed_scaling"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|optimizer"),
    ("gemm_bf16", _GEMM),
    ("elementwise", r"elementwise|vectorized|unrolled|norm|gammabeta|gelu|silu|swiglu|relu|softmax|dropout|reduce|"
                    r"triton_|embedding|grad_weight|index|cross_entropy|nll|cat|gather|scatter|argmax|aten::"),
)
_COMPILED = tuple((cls, re.compile(rx)) for cls, rx in RULES)
assert all(cls in CLASSES for cls, _ in RULES)

log = logging.getLogger(__name__)

DEFAULT_STEPS = 3  # profiled steps: enough to average launch jitter, cheap next to the trial
TABLE_ROWS = 40  # kernels kept in the record's kernel_table, largest first
COMPILED_REGION = "Torch-Compiled Region"  # Dynamo's profiler event around each run of a compiled graph


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them ran.

    Kernels on several streams overlap (NCCL's beside the compute, nested in it or not); their sum counts the
    overlap twice, the union once. Where none overlap the union is their sum."""
    total = 0.0
    start = end = None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if end is None or s > end:  # a new busy stretch: close the last one
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def classify(name: str) -> str:
    """The class of one kernel (or CPU operator) name."""
    low = name.lower()
    for cls, rx in _COMPILED:
        if rx.search(low):
            return cls
    return "other"


@dataclass
class Kernel:
    name: str
    cls: str
    ms: float  # device (CPU: self) time per profiled step, ms
    calls: float  # launches per step


@dataclass
class Breakdown:
    """Per-class time of one step, and the kernels behind it."""

    steps: int
    profile_s: float
    kernels: list[Kernel] = field(default_factory=list)
    wall_ms: float | None = None  # CPU: wall clock per profiled step, profiler included; None on GPUs
    compiled_calls: float | None = None  # compiled graphs run per step (COMPILED_REGION events); None: not counted
    busy_ms: float | None = None  # GPU: per step, the time at least one kernel ran (busy_us); None: total_ms (CPU
    #                               operators' self times, which never overlap)

    def ms(self) -> dict[str, float]:
        out = dict.fromkeys(CLASSES, 0.0)
        for k in self.kernels:
            out[k.cls] += k.ms
        return out

    @property
    def total_ms(self) -> float:
        """The kernels' summed time per step: the classes' sum."""
        return sum(k.ms for k in self.kernels)

    @property
    def busy(self) -> float:
        """The time per step the device was busy: overlapping streams counted once."""
        return self.total_ms if self.busy_ms is None else self.busy_ms

    def minus(self, other: "Breakdown", per: int) -> "Breakdown":
        """(self - other) / per, kernel by kernel: a decode token's share of a whole generation, from a
        profiled generation and a profiled prefill. Kernels that differ by less than nothing are dropped."""
        theirs = {k.name: k for k in other.kernels}
        out = []
        for k in self.kernels:
            o = theirs.get(k.name)
            ms, calls = (k.ms - o.ms, k.calls - o.calls) if o else (k.ms, k.calls)
            if ms > 0:
                out.append(Kernel(k.name, k.cls, ms / per, calls / per))
        wall = (self.wall_ms - other.wall_ms) / per if self.wall_ms is not None and other.wall_ms is not None else None
        calls = (None if self.compiled_calls is None or other.compiled_calls is None
                 else (self.compiled_calls - other.compiled_calls) / per)
        busy = None if self.busy_ms is None or other.busy_ms is None else (self.busy_ms - other.busy_ms) / per
        return Breakdown(self.steps, self.profile_s + other.profile_s, sorted(out, key=lambda k: -k.ms), wall, calls,
                         busy)

    def fields(self, timed_ms: float) -> dict[str, Any]:
        """The record's breakdown fields; ``timed_ms`` is the timed p50 the kernels are set against.

        On CPU (``wall_ms`` known) every operator time is scaled by timed_ms / wall_ms: the profiled step ran
        slower than the timed one, and only shares of it compare with the wall-clock step. The classes and
        kernel_ms_total are sums; the gap is timed_ms less :attr:`busy` (overlapping streams counted once)."""
        scale = timed_ms / self.wall_ms if self.wall_ms and timed_ms == timed_ms else 1.0
        out: dict[str, Any] = {f"kernel_ms_{c}": v * scale for c, v in self.ms().items()}
        table = [{"name": k.name[:240], "class": k.cls, "ms": round(k.ms * scale, 5), "calls": round(k.calls, 2)}
                 for k in self.kernels[:TABLE_ROWS]]
        out.update(kernel_ms_total=self.total_ms * scale, kernel_gap_ms=timed_ms - self.busy * scale,
                   profile_steps=self.steps, profile_s=self.profile_s, kernel_table=json.dumps(table))
        if self.compiled_calls is not None:
            out["compiled_calls_per_step"] = self.compiled_calls
        return out


def compiled_eager_why(calls: float | None, expected: int) -> str | None:
    """Why a compiled cell's step time is not a compiled one, or None: its profiled steps ran fewer compiled
    graphs than ``expected`` (one per unit, its checkpointed recompute inside it, or one for a model compiled
    whole). A frame Dynamo gave up on (its recompile limit), a stance, or hooks that broke its graphs run eager,
    and nothing in the step time says so: an H200 timed a 32-layer model's compiled cell at its eager time
    (224.0 ms against 223.7) before measuring passes were kept out of compiled units. More than expected is
    graph breaks, each piece still compiled."""
    if calls is None or calls >= expected:
        return None
    return (f"ran eager code: {calls:g} compiled graph(s) per profiled step, {expected} expected (one per compiled "
            "unit); its time is not a compiled step's")


def profile(run: Callable[[], Any], steps: int, device: str, host_ops: bool = False,
            compiled: bool = False) -> Breakdown:
    """Run ``run()`` ``steps`` times under torch.profiler; every kernel's time per call.

    CUDA: kernel events (CUDA graph replays included, their kernels listed one by one), without
    tracing host operators unless ``host_ops`` (they cost most of the profiler's time and the
    breakdown does not read them); CPU: aten operators by self time (an operator's time without the
    operators it called, so nothing counts twice). ``compiled``: also count the compiled graphs that ran
    (Dynamo's :data:`COMPILED_REGION` events, host events: traced on CUDA too then).
    """
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    activities = ([ProfilerActivity.CPU] if host_ops or compiled or not cuda else []) + (
        [ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        t_steps = time.perf_counter()
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = None if cuda else (time.perf_counter() - t_steps) * 1e3 / steps
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    # the kernel events key_averages sums below (those with device time), each with its interval on the GPU's clock
    busy = (busy_us((e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == kind and not e.is_user_annotation and e.self_device_time_total > 0)
            / 1e3 / steps if cuda else None)
    kernels, regions = [], 0
    for e in prof.key_averages():
        if e.key.startswith(COMPILED_REGION):
            regions += e.count
        if e.device_type != kind or e.is_user_annotation:
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            kernels.append(Kernel(e.key, classify(e.key), us / 1e3 / steps, e.count / steps))
    kernels.sort(key=lambda k: -k.ms)
    return Breakdown(steps, time.perf_counter() - t0, kernels, wall_ms, regions / steps if compiled else None, busy)


def breakdown_fields(enabled: bool, run: Callable[[], Any], device: str, timed_ms: float,
                     baseline: Callable[[], Any] | None = None, per: int = 1, steps: int = DEFAULT_STEPS,
                     compiled: int | None = None) -> dict[str, Any]:
    """The record's breakdown of ``run``'s step; with ``baseline``, of (run - baseline) / ``per`` (a decode
    token from a generation less its prefill). ``compiled``: for a compiled cell, the compiled graphs a step
    should run (:func:`compiled_eager_why`). A profiler that fails costs the fields, never the trial, and never
    the steps: those it did not run, ``run``'s and ``baseline``'s, run unprofiled (:class:`Counted`)."""
    if not enabled:
        return {"breakdown_why": "profile: false"}
    runs = [Counted(run)] + ([Counted(baseline)] if baseline is not None else [])
    try:
        found = profile(runs[0], steps, device, compiled=compiled is not None)
        if baseline is not None:
            found = found.minus(profile(runs[1], steps, device, compiled=compiled is not None), per)
        out = found.fields(timed_ms)
        if compiled is not None:
            out["compiled_eager_why"] = compiled_eager_why(found.compiled_calls, compiled)
        return out
    except Exception as exc:  # noqa: BLE001 - CUPTI missing or busy (another profiler), driver limits
        log.warning("kernel breakdown failed: %s: %s", type(exc).__name__, exc)
        for counted in runs:
            counted.finish(steps)
        return {"breakdown_why": f"profiler: {type(exc).__name__}: {exc}"[:500]}


class Counted:
    """A step that counts its calls, so that a profiler failing before or between them (at start-up: CUPTI busy on
    one GPU) still leaves every step run: the ranks of a multi-rank trial profile together, and a rank that ran
    fewer steps would leave its peers waiting in their collectives. A step that itself failed is not run again:
    the cell's own failure, not the profiler's."""

    def __init__(self, step: Callable[[], Any]):
        self.step, self.calls, self.failed = step, 0, False

    def __call__(self) -> Any:
        try:
            out = self.step()
        except BaseException:
            self.failed = True
            raise
        self.calls += 1
        return out

    def finish(self, steps: int) -> None:
        """The calls left of ``steps``, unprofiled (none after a step of its own failed)."""
        while not self.failed and self.calls < steps:
            self()
