"""Transformer Engine's seam for the per-layer FP8 reads (trials/measure/fp8_layers.py): its FP8 modules are te.Linear,
te.LayerNormLinear and te.LayerNormMLP (inside te.TransformerLayer too); the same module in BF16 is the module
called outside ``te.autocast`` (its BF16 GEMMs, the same weights); the FP8 side runs under the cell's own recipe
(``step.recipe``) through ``te_compat.read_autocast`` inside ``te_compat.fp8_meta_kept``, so delayed scaling's
amax histories and scales are as training left them after the read (as the teacher-forced read does).

Cast health reads each module's first GEMM: its input (for the LayerNorm* modules, the normalized input,
computed from the module's own norm weights), its weight (LayerNormMLP: fc1's) and the module's output gradient,
under the scale the recipe used: delayed scaling's ``fp8_meta`` scales (the amax history's, as of the last
training step), current scaling's per-tensor ``max / amax``. Block, MXFP8 and NVFP4 scale per block: not read.
Not run on this repository's CPU CI (TE needs a GPU): tests/test_gpu.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import te_compat

FWD_INPUT, FWD_WEIGHT, BWD_GRAD_OUTPUT = 0, 1, 0  # TE's FP8FwdTensors.GEMM1_INPUT/GEMM1_WEIGHT, FP8BwdTensors.GRAD_OUTPUT1


def _gemm_modules() -> tuple[type, ...]:
    import transformer_engine.pytorch as te

    return te.Linear, te.LayerNormLinear, te.LayerNormMLP


def fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    kinds = _gemm_modules()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def read_context(step: Any) -> contextlib.AbstractContextManager:
    return te_compat.fp8_meta_kept(step.model, step.recipe)


def fp8_context(step: Any) -> contextlib.AbstractContextManager:
    return te_compat.read_autocast(step.te, step.recipe)


def run(module: nn.Module, x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The module's output (its first, where it returns its bias too); FP8 when called inside ``fp8_context``."""
    out = module(x)
    return out[0] if isinstance(out, (tuple, list)) else out


def weights(module: nn.Module) -> list[torch.Tensor]:
    """The GEMM weights (every parameter of two or more dims: fc1 and fc2, split QKV weights)."""
    return [p for p in module.parameters() if p.dim() >= 2]


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


def casts(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, step: Any
          ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    recipe = step.recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        return {}
    fwd = torch.float8_e4m3fn
    bwd = torch.float8_e4m3fn if recipe.fp8_format == Format.E4M3 else torch.float8_e5m2
    operands = {"act": (_gemm_input(module, x).detach(), fwd, ("scaling_fwd", FWD_INPUT)),
                "weight": (weights(module)[0].detach(), fwd, ("scaling_fwd", FWD_WEIGHT)),
                "grad": (dy.detach(), bwd, ("scaling_bwd", BWD_GRAD_OUTPUT))}
    out = {}
    for cls, (t, dtype, (key, index)) in operands.items():
        if isinstance(recipe, DelayedScaling):
            scale = module.fp8_meta[key].scale[index]
        else:  # current scaling: this tensor's own amax
            scale = torch.finfo(dtype).max / t.abs().amax().float().clamp_min(1e-12)
        out[cls] = (t, scale, dtype)
    return out
