"""torchao's seam for the per-layer FP8 reads (trials/measure/fp8_layers.py): its FP8 modules are ``Float8Linear``s;
the same module in BF16 is ``F.linear`` on the same BF16 weight; its operands are scaled as the module's own
``Float8LinearConfig`` says (tensorwise: one scale per tensor; rowwise: one per row along the GEMM's reduction
dim, powers of two), with torchao's own ``tensor_to_scale``.

The casts read are those of the forward GEMM (input, weight) and of the input-gradient GEMM (the output
gradient); rowwise casts each operand a second time for the other GEMM, along the other dim, which is not read.
Float8Linear keeps no state a forward changes: the read needs no context.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


def fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every Float8Linear, in model order."""
    from torchao.float8.float8_linear import Float8Linear

    return [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def read_context(step: Any) -> contextlib.AbstractContextManager:
    """Nothing to keep: torchao's dynamic scaling has no state a forward pass updates (yields None)."""
    return contextlib.nullcontext()


def fp8_context(step: Any, saved: Any = None) -> contextlib.AbstractContextManager:
    """A Float8Linear runs in FP8 whenever it is called: no autocast."""
    return contextlib.nullcontext()


def run(module: nn.Module, x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The module on ``x``: as trained (its FP8 GEMMs), or the same weights in a BF16 ``F.linear``."""
    return module(x) if fp8 else F.linear(x, module.weight, module.bias)


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [module.weight]


def casts(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, step: Any, saved: Any = None
          ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """Operand class -> (tensor, the scale the recipe gives it, its FP8 dtype), for the classes cast to FP8."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_utils import tensor_to_scale

    c = module.config
    out = {}
    for cls, tensor, cc in (("act", x, c.cast_config_input), ("weight", module.weight, c.cast_config_weight),
                            ("grad", dy, c.cast_config_grad_output)):
        if cc.scaling_type is ScalingType.DISABLED:
            continue
        t = tensor.detach().reshape(-1, tensor.shape[-1])  # (rows, reduction dim): the GEMM's 2-d operand
        axis = -1 if cc.scaling_granularity is ScalingGranularity.AXISWISE else None
        scale = tensor_to_scale(t, cc.target_dtype, scaling_granularity=cc.scaling_granularity, axiswise_dim=axis,
                                round_scales_to_power_of_2=c.round_scales_to_power_of_2)
        out[cls] = (t, scale, cc.target_dtype)
    return out
