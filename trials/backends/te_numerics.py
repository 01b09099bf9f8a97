"""Transformer Engine's seam for the per-layer FP8 reads (trials/measure/fp8_layers.py): its FP8 modules are te.Linear,
te.LayerNormLinear and te.LayerNormMLP (inside te.TransformerLayer too); the same module in BF16 is the module
called outside ``te.autocast`` (its BF16 GEMMs, the same weights); the FP8 side runs under the cell's own recipe
(``step.recipe``) through ``te_compat.read_autocast`` inside ``te_compat.fp8_meta_kept``, so delayed scaling's
amax histories and scales are as training left them after the read (as the teacher-forced read does).

Delayed scaling: training's scales, throughout. The read's whole-model backward, and each module's FP8 pass,
end in TE's backward reduce-and-update (the first FP8 module's backward of an autocast rolls every registered
module's gradient amaxes into ``scaling_bwd`` and sets new scales; ``_graph`` only skips the forward's update),
which would put the held gradient's own amax into the scale it is then judged and cast with (every delayed
record read cast_saturation_grad 0.0 so) and let each pass run under the scales the passes before it left.
``read_context`` keeps the snapshot ``fp8_meta_kept`` takes as the read starts; ``fp8_context`` puts it back
before every FP8 pass, and ``casts`` judges by it: the scales the last training step left, those the next one
would cast with.

Cast health reads each module's operands (:data:`SLOTS` says which scale each is cast with): its first GEMM's
input (for the LayerNorm* modules, the normalized input, computed from the module's own norm weights), every
GEMM weight (split QKV's query, key and value weights, cast as one tensor; LayerNormMLP's fc1 and fc2 weights,
each under its own scale) and the module's output gradient (LayerNormMLP: fc2's), under the scale the recipe
casts it with: delayed scaling's saved ``fp8_meta`` scales, current scaling's per-tensor ``max / amax``.
LayerNormMLP's fc2 input (the activation product) is no module's input: not read. Block, MXFP8 and NVFP4 scale
per block: not read. Not run on this repository's CPU CI (TE needs a GPU): tests/test_gpu_fp8_layers.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import te_compat

# TE's FP8 scale slots (transformer_engine/pytorch/csrc/common.h: FP8FwdTensors, FP8BwdTensors)
GEMM1_INPUT, GEMM1_WEIGHT, GEMM2_WEIGHT = 0, 1, 4
GRAD_OUTPUT1, GRAD_OUTPUT2 = 0, 2


@dataclass(frozen=True)
class Slots:
    """Which scale slot each operand of a module kind is cast with: its input's and its output gradient's, and
    per GEMM weight (a parameter name, or None: every GEMM weight of the module as one tensor) the weight's."""

    weights: tuple[tuple[str | None, int], ...]
    grad: int
    act: int = GEMM1_INPUT


# per TE module class name (TE is imported lazily). Linear and LayerNormLinear quantize their (possibly split:
# query, key, value) weight as one tensor. LayerNormMLP quantizes the gradient of its output, fc2's grad output,
# with GRAD_OUTPUT2 and fc1's with GRAD_OUTPUT1 (layernorm_mlp.py ``_get_quantizers``): the module's output
# gradient is slot 2, not 0 (slot 0 is fc1's, a tensor the read never has)
SLOTS = {"Linear": Slots(((None, GEMM1_WEIGHT),), GRAD_OUTPUT1),
         "LayerNormLinear": Slots(((None, GEMM1_WEIGHT),), GRAD_OUTPUT1),
         "LayerNormMLP": Slots((("fc1_weight", GEMM1_WEIGHT), ("fc2_weight", GEMM2_WEIGHT)), GRAD_OUTPUT2)}

def _gemm_modules() -> tuple[type, ...]:
    import transformer_engine.pytorch as te

    return te.Linear, te.LayerNormLinear, te.LayerNormMLP


def fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    kinds = _gemm_modules()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def read_context(step: Any) -> contextlib.AbstractContextManager:
    """TE's scaling state kept (``te_compat.fp8_meta_kept``); yields its snapshot (None but for delayed
    scaling), which the read hands to ``fp8_context`` and ``casts`` (the module docstring)."""
    return te_compat.fp8_meta_kept(step.model, step.recipe)


@contextlib.contextmanager
def fp8_context(step: Any, saved: te_compat.Fp8MetaSaved | None = None) -> Iterator[None]:
    """TE's FP8 autocast for a read (``te_compat.read_autocast``), started from training's delayed-scaling state:
    ``saved`` (``read_context``'s snapshot) is put back first, undoing what an earlier pass's backward updated."""
    if saved is not None:
        saved.restore()
    with te_compat.read_autocast(step.te, step.recipe):
        yield


def run(module: nn.Module, x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The module's output (its first, where it returns its bias too); FP8 when called inside ``fp8_context``."""
    out = module(x)
    return out[0] if isinstance(out, (tuple, list)) else out


def weights(module: nn.Module) -> list[torch.Tensor]:
    """The GEMM weights (every parameter of two or more dims: fc1 and fc2, split QKV weights)."""
    return [p for p in module.parameters() if p.dim() >= 2]


def _slots(module: nn.Module) -> Slots:
    return next(SLOTS[c.__name__] for c in type(module).__mro__ if c.__name__ in SLOTS)


def _gemm_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the first GEMM reads: ``x``, or the module's own norm of it (LayerNormLinear, LayerNormMLP)."""
    gamma = getattr(module, "layer_norm_weight", None)
    if gamma is None:
        return x
    gamma = gamma.float() + (1 if getattr(module, "zero_centered_gamma", False) else 0)
    shape = (x.shape[-1],)
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        return F.rms_norm(x.float(), shape, gamma, module.eps)
    beta = getattr(module, "layer_norm_bias", None)
    return F.layer_norm(x.float(), shape, gamma, None if beta is None else beta.float(), module.eps)


def _scale(module: nn.Module, key: str, index: int, saved: te_compat.Fp8MetaSaved | None) -> torch.Tensor:
    """Delayed scaling's scale for slot ``index`` of ``key``: the read's snapshot (training's), or the module's
    own without one."""
    scale = saved.scale(module, key, index) if saved is not None else None
    return module.fp8_meta[key].scale[index] if scale is None else scale


def _scaled(t: torch.Tensor, dtype: torch.dtype, delayed: bool, key: str, index: int, module: nn.Module,
            saved: te_compat.Fp8MetaSaved | None) -> torch.Tensor:
    """``t`` times the scale the recipe casts it with, as a flat fp32 tensor: delayed scaling's slot, current
    scaling's ``max / amax`` of ``t`` itself."""
    t = t.detach().float().flatten()
    scale = (_scale(module, key, index, saved).float() if delayed
             else torch.finfo(dtype).max / t.abs().amax().clamp_min(1e-12))
    return t * scale


def casts(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, step: Any,
          saved: te_compat.Fp8MetaSaved | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """Operand class -> (tensor, scale, FP8 dtype) as ``fp8_layers.cast_health`` takes them. Each operand comes
    already multiplied by its own scale, with scale 1: a module's GEMM weights (LayerNormMLP's two) are one
    operand class under scales of their own, and ``x * scale`` is what the cast sees either way."""
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    recipe = step.recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return {}
    delayed = isinstance(recipe, DelayedScaling)
    fwd = torch.float8_e4m3fn
    bwd = torch.float8_e4m3fn if recipe.fp8_format == Format.E4M3 else torch.float8_e5m2
    slots = _slots(module)
    params = dict(module.named_parameters())
    weight = torch.cat([_scaled(torch.cat([w.detach().float().flatten() for w in
                                           (weights(module) if name is None else [params[name]])]),
                                fwd, delayed, "scaling_fwd", index, module, saved) for name, index in slots.weights])
    one = torch.ones((), device=x.device)
    return {"act": (_scaled(_gemm_input(module, x), fwd, delayed, "scaling_fwd", slots.act, module, saved), one, fwd),
            "weight": (weight, one, fwd),
            "grad": (_scaled(dy, bwd, delayed, "scaling_bwd", slots.grad, module, saved), one, bwd)}
