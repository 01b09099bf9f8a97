"""torchao.float8 on whatever model the spec's source builds, as torchtitan runs it: its Linears become Float8Linear.

``convert_to_float8_training`` swaps the Linears for ``Float8Linear`` with the recipe's scaling
(tensorwise, rowwise, rowwise_with_gw_hp: ``Float8LinearConfig.from_recipe_name``); weights stay
BF16 and are cast on the fly. Like torchtitan's converter, the layer that makes the logits (MiniGPT's
``head``, a transformers model's ``lm_head``) stays in BF16 (TE's models keep it in high precision
too), and so does any Linear whose dims are not multiples of 16 (FP8 GEMMs need them); with
``fp8_filter: auto`` torchao's own filter for the recipe decides instead (it also keeps small Linears,
where FP8's casts cost more than its GEMM saves). Only ``nn.Linear`` converts: GPT-2's ``Conv1D``
GEMMs stay BF16. torchao's FP8 is slow without ``torch.compile`` (pytorch/ao#685), so its cells are
meant to run with ``compile: true``; the record says which modules were converted and which kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch
import torch.nn as nn

from .. import models
from ..models.minigpt import LOGITS_LAYER
from . import Built
from .torch import compiled

log = logging.getLogger(__name__)

FP8_DIM_MULTIPLE = 16


def version() -> str:
    import torchao

    return str(torchao.__version__)


def recipe_support(device: str, recipes: dict[str, str]) -> tuple[str | None, str | None, dict[str, tuple[bool, str]]]:
    """(torchao version, why it is unavailable, recipe -> (supported, reason)) on this device."""
    try:
        found = version()
    except Exception as exc:  # noqa: BLE001 - an import failure of any kind means no torchao
        why = f"torchao not importable ({type(exc).__name__}: {exc}); pip install 'juicytalk[torchao]'"
        return None, why, {r: (False, why) for r in recipes}
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        out = {}
        for recipe, cc in recipes.items():
            need = tuple(int(v) for v in cc.split("."))
            ok = (major, minor) >= need
            out[recipe] = (ok, "" if ok else f"{recipe} needs compute capability {cc}+, this GPU is {major}.{minor}")
        return found, None, out
    why = _cpu_float8_matmul()
    return found, None, {r: (why is None, why or "") for r in recipes}


def _cpu_float8_matmul() -> str | None:
    """None when this torch multiplies float8 tensors on CPU (torch._scaled_mm), else why not."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        torch._scaled_mm(a, a.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"this torch ({torch.__version__}) has no float8 matmul on CPU: {type(exc).__name__}: {exc}"


class _Filter:
    """The Linears torchao converts: every Linear with dims in multiples of 16 but the logits layer (``keep``),
    or those torchao's own filter for the recipe takes (``auto``: ``_auto_filter_for_recipe``, the logits
    layer kept too). Remembers which it took and which it kept, for the record."""

    def __init__(self, keep: str | None = LOGITS_LAYER, auto_recipe: str | None = None) -> None:
        self.keep = keep
        self.auto = None
        if auto_recipe is not None:
            from torchao.float8 import _auto_filter_for_recipe

            self.auto = _auto_filter_for_recipe(auto_recipe, filter_fqns=[keep] if keep else [])
        self.converted: list[str] = []
        self.skipped: list[str] = []
        self.model_keeps: dict[str, str] = {}  # qualified name -> why the model needs it in high precision

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if fqn in self.model_keeps:
            ok = False
        elif self.auto is not None:
            ok = fqn != self.keep and bool(self.auto(module, fqn))
        else:
            ok = (fqn != self.keep and module.in_features % FP8_DIM_MULTIPLE == 0
                  and module.out_features % FP8_DIM_MULTIPLE == 0)
        (self.converted if ok else self.skipped).append(fqn)
        return ok

    def info(self) -> dict[str, Any]:
        return {"torchao_version": version(), "fp8_converted_modules": len(self.converted),
                "fp8_converted_names": json.dumps(self.converted), "fp8_skipped_modules": json.dumps(self.skipped)}


def build(spec: Any, precision: str, device: str) -> Built:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    made = models.build(spec, "bf16" if precision == "fp8" else precision, device)
    model = made.model
    if precision != "fp8":
        return Built(model, forward=compiled(model, spec), info={"torchao_version": version()})
    keep = _Filter(made.logits_layer, spec.recipe if spec.fp8_filter == "auto" else None)
    keep.model_keeps = made.keep  # Linears the model needs in high precision (trials/models: Built.keep)
    config = Float8LinearConfig.from_recipe_name(spec.recipe)
    after_step = None
    if spec.fp8_all_gather:  # FSDP2 all-gathers the FP8 weights; their scales are made once per step for it
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)

        def after_step() -> None:
            precompute_float8_dynamic_scale_for_fsdp(model)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    log.info("torchao %s: %d Linears in float8, kept %s", spec.recipe, len(keep.converted), keep.skipped)
    return Built(model, forward=compiled(model, spec), info=keep.info(), after_step=after_step)


def quantize_for_serving(model: nn.Module, recipe: str, logits_layer: str | None = LOGITS_LAYER) -> dict[str, Any]:
    """Quantize ``model``'s Linears in place for inference: FP8 (e4m3) weights, each activation cast to
    FP8 as it arrives, scales per tensor (``tensorwise``) or per row (``rowwise``), torchao's
    ``Float8DynamicActivationFloat8WeightConfig``; ``logits_layer`` (the qualified name of the layer that
    makes the logits) and Linears with a dimension not a multiple of 16 stay BF16, as in training.
    Returns the record fields it sets."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    granularity = {"tensorwise": PerTensor, "rowwise": PerRow}[recipe]()
    keep = _Filter(logits_layer)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity), filter_fn=keep)
    log.info("torchao serving %s: %d Linears with FP8 weights, kept %s", recipe, len(keep.converted), keep.skipped)
    return keep.info()
