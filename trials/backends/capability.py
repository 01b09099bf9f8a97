"""What this device can run, and what a spec turns into on it.

A cell that cannot run as asked is never quietly run as something else: :func:`resolve` returns the
effective backend/precision/recipe, or the reason the cell is ``unsupported``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import backends
from . import te_compat
from . import STACKS
from ..spec import TrialSpec

log = logging.getLogger(__name__)


@dataclass
class Capability:
    """Device facts plus Transformer Engine availability and FP8 support per recipe."""

    device_type: str
    gpu_name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    total_memory_bytes: int | None = None
    cuda_version: str | None = None
    te_available: bool = False
    te_version: str | None = None
    te_error: str | None = None
    torchao_version: str | None = None
    torchao_error: str | None = None
    fp8: dict[str, tuple[bool, str]] = field(default_factory=dict)  # every stack's recipe -> (supported, why not)

    @property
    def cc_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "gpu_name": self.gpu_name,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
            "total_memory_bytes": self.total_memory_bytes,
            "cuda_version": self.cuda_version,
            "te_available": self.te_available,
            "te_version": self.te_version,
            "te_error": self.te_error,
            "torchao_version": self.torchao_version,
            "torchao_error": self.torchao_error,
            "fp8": {k: {"supported": v[0], "reason": v[1]} for k, v in self.fp8.items()},
        }


def wants_torchao(spec: TrialSpec) -> bool:
    """Whether to probe torchao for ``spec``: its own cells, and FP8 cells on ``auto`` where no GPU is visible
    (Transformer Engine cannot run there, and the reason then names the FP8 path that does)."""
    no_gpu = spec.device == "cpu" or not torch.cuda.is_available()
    return spec.backend == "torchao" or (spec.backend == "auto" and spec.precision == "fp8" and no_gpu)


def probe(device: str = "auto", want_te: bool = True, want_torchao: bool = False) -> Capability:
    """Look at the device (and TE and torchao, when wanted) without allocating anything large."""
    cap = _probe_te(device, want_te)
    if want_torchao:
        ao = STACKS["torchao"].recipes
        cap.torchao_version, cap.torchao_error, support = backends.implementation("torchao").recipe_support(
            cap.device_type, ao)
        cap.fp8.update(support)
    return cap


def _probe_te(device: str, want_te: bool) -> Capability:
    use_cuda = torch.cuda.is_available() and device != "cpu"
    te_recipes = STACKS["te"].recipes
    if not use_cuda:
        cap = Capability(device_type="cpu")
        reason = "no CUDA device" if device != "cpu" else "device is cpu"
        cap.te_error = reason
        cap.fp8 = {r: (False, f"{r} needs a CUDA GPU of compute capability {cc}+ ({reason})")
                   for r, cc in te_recipes.items()}
        return cap
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cap = Capability(
        device_type="cuda",
        gpu_name=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        total_memory_bytes=int(props.total_memory),
        cuda_version=torch.version.cuda,
    )
    if not want_te:
        cap.te_error = "not probed"
        return cap
    if (props.major, props.minor) < (8, 0):
        cap.te_error = f"Transformer Engine needs compute capability 8.0+, this GPU is {cap.compute_capability}"
    else:
        try:
            te = te_compat.import_te()
            cap.te_available = True
            cap.te_version = te_compat.te_version()
        except Exception as exc:  # noqa: BLE001 - import failures of a compiled extension vary
            cap.te_error = f"{type(exc).__name__}: {exc}"
    if cap.te_available:
        for r in te_recipes:
            try:
                cap.fp8[r] = te_compat.fp8_support(te, r)
            except Exception as exc:  # noqa: BLE001
                cap.fp8[r] = (False, f"{type(exc).__name__}: {exc}")
    else:
        cap.fp8 = {r: (False, f"Transformer Engine unavailable: {cap.te_error}") for r in te_recipes}
    return cap


@dataclass(frozen=True)
class Resolution:
    """What a spec becomes on a device; ``unsupported`` holds the reason it cannot run as asked."""

    device: str
    backend: str | None
    precision: str | None
    recipe: str | None
    unsupported: str | None = None


def _fp8_here(cap: Capability) -> str:
    """Which FP8 path does run on this device (from the probe), for a reason that says what to ask for."""
    runs: dict[str, list[str]] = {}
    for recipe, (ok, _) in cap.fp8.items():
        if ok:
            runs.setdefault(backends.recipe_owner(recipe) or "?", []).append(recipe)
    if runs:
        return "FP8 that runs here: " + "; ".join(f"backend {b}, recipe {' or '.join(r)}" for b, r in runs.items())
    probed = any(backends.recipe_owner(r) != "te" for r in cap.fp8)
    return ("no FP8 path runs here" if probed else
            "backend torchao may run FP8 here (juicytalk doctor lists what does)")


def resolve(spec: TrialSpec, cap: Capability) -> Resolution:
    device = "cuda" if cap.device_type == "cuda" else "cpu"
    recipe = spec.recipe if spec.precision == "fp8" else None

    def no(reason: str) -> Resolution:
        return Resolution(device, None, None, None, unsupported=reason)

    if spec.device == "cuda" and device != "cuda":
        return no("device cuda requested but no CUDA device is visible")
    if spec.cuda_graphs and device != "cuda":
        return no("cuda_graphs needs a CUDA device")
    if spec.backend == "te" and not cap.te_available:
        return no(f"backend te: {cap.te_error}")
    te_not = spec.source.te_unsupported(spec.workload, spec.te_layer)  # what TE does not run on this model
    if spec.backend == "te" and te_not:
        return no(f"backend te: {te_not}")
    if spec.backend == "auto":  # te where TE runs and builds the spec's model, else torch
        te_ok = (cap.te_available and (cap.cc_tuple or (0, 0)) >= (8, 0) and "te" in spec.source.stacks
                 and not te_not)
        backend = "te" if te_ok else "torch"
    else:
        backend = spec.backend
    if backend == "torchao" and cap.torchao_error:
        return no(f"backend torchao: {cap.torchao_error}")
    if spec.precision == "fp8":
        if not STACKS[backend].recipes:  # auto resolved to the twin
            return no(f"fp8 on backend auto needs Transformer Engine ({cap.te_error or 'backend resolved to torch'})"
                      f"; {_fp8_here(cap)}")
        ok, reason = cap.fp8.get(spec.recipe, (False, "not probed"))
        if not ok:
            return no(f"fp8 recipe {spec.recipe}: {reason or 'not supported on this GPU'}")
        if spec.workload == "infer" and STACKS[backend].serve_needs_cuda and device != "cuda":
            return no(f"{backend} serves FP8 on CUDA GPUs only (compute capability "
                      f"{STACKS[backend].recipes[spec.recipe]}+)")
    if spec.precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        return no("bf16 is not supported on this GPU")
    return Resolution(device, backend, spec.precision, recipe)
