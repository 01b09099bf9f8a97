"""torchao.float8 on whatever model the spec's source builds, as torchtitan runs it: its Linears become Float8Linear.

``convert_to_float8_training`` swaps the Linears for ``Float8Linear`` with the recipe's scaling
(tensorwise, rowwise, rowwise_with_gw_hp: ``Float8LinearConfig.from_recipe_name``); weights stay
BF16 and are cast on the fly. Like torchtitan's converter, the layer that makes the logits (MiniGPT's
``head``, a transformers model's ``lm_head``) stays in BF16 (TE's models keep it in high precision
too), and so does any Linear whose dims are not multiples of 16 (FP8 GEMMs need them); with
``fp8_filter: auto`` torchao's own filter for the recipe decides instead (it also keeps small Linears,
where FP8's casts cost more than its GEMM saves). Only ``nn.Linear`` converts: GPT-2's ``Conv1D``
GEMMs stay BF16 (``convert_to_float8_training`` swaps ``nn.Linear`` modules only, and Conv1D is not one: it keeps
its weight as (in, out) and calls ``addmm`` itself). MoE experts (a module holding a 3-D weight, one matrix per
expert, run as grouped GEMMs ``torch._grouped_mm``) stay BF16, with the reason in ``fp8_skipped_why``
(:func:`moe_why`): torchao 0.18's float8 MoE training (``torchao.prototype.moe_training``,
``Float8TrainingOpConfig``) needs every expert's group of tokens padded to a multiple of 16 rows, which torchtitan's
MoE does as it permutes the tokens and transformers' MoE does not (converted, an H200 step died on a device-side
assert). torchao's FP8 is slow without
``torch.compile`` (pytorch/ao#685), so its cells are meant to run with ``compile: true``; the record says which
modules were converted, and every module holding GEMM weights that was kept, and why (``fp8_skipped_why``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.conv import _ConvNd

from .. import models
from ..models.common import WEIGHT_READ_BY_PARENT, experts, read_by_parent, written_in_place
from . import Built
from .torch import compiled

log = logging.getLogger(__name__)

FP8_DIM_MULTIPLE = 16
MOE_RECIPES = ("rowwise",)  # torchao 0.18's float8 grouped GEMM recipes (Float8TrainingRecipe: FP8_ROWWISE only)
MOE_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm's rowwise FP8 kernels: Hopper and later
MOE_GROUP_ROWS = 16  # torch._scaled_grouped_mm: each group's rows (tokens routed to one expert) a multiple of this


def version() -> str:
    """torchao's installed version, from its package's metadata. Importing torchao to ask took ~2 s of CPU (it
    imports TorchDynamo and its Triton kernels) in every process that only plans: the dry run, a sweep's driver,
    each trial's capability probe. An install that is there but does not import fails where a cell converts its
    model, in that trial's record."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ModuleNotFoundError("No module named 'torchao'")
    return importlib.metadata.version("torchao")


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

    def __init__(self, keep: str | None, auto_recipe: str | None = None) -> None:
        self.keep = keep
        self.auto = None
        if auto_recipe is not None:
            from torchao.float8 import _auto_filter_for_recipe

            self.auto = _auto_filter_for_recipe(auto_recipe, filter_fqns=[keep] if keep else [])
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}  # qualified name -> why it stays in high precision
        self.model_keeps: dict[str, str] = {}  # qualified name -> why the model needs it in high precision

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if fqn == self.keep:
            why = "the layer that makes the logits (kept in BF16, as torchtitan and TE do)"
        elif fqn in self.model_keeps:  # the model's own need (written_in_place)
            why = self.model_keeps[fqn]
        elif self.auto is not None:
            why = "" if self.auto(module, fqn) else "torchao's auto filter for the recipe (too small for FP8 to pay)"
        elif module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
            why = (f"dims {module.in_features} x {module.out_features} not multiples of {FP8_DIM_MULTIPLE} "
                   "(FP8 GEMMs need them)")
        else:
            why = ""
        if why:
            self.skipped[fqn] = why
        else:
            self.converted.append(fqn)
        return not why

    def info(self) -> dict[str, Any]:
        return {"torchao_version": version(), "fp8_converted_modules": len(self.converted),
                "fp8_converted_names": json.dumps(self.converted), "fp8_skipped_modules": json.dumps(list(self.skipped)),
                "fp8_skipped_why": json.dumps(self.skipped)}


def moe_why(recipe: str, device: str) -> str:
    """Why MoE experts stay BF16 on torchao for ``recipe`` on ``device``: one line, for ``fp8_skipped_why``.

    Always: torchao 0.18's float8 grouped GEMM (``torchao.prototype.moe_training.fp8_grouped_mm``, through
    ``Float8TrainingOpConfig`` and ``quantize_``) needs each expert's token group to be a multiple of 16 rows
    ("Group sizes must be divisible by 16"; its ``pad_token_groups_for_grouped_mm`` is off by default and its
    forward asserts "pad_token_groups_for_grouped_mm=True is not yet supported"). torchtitan's MoE pads each
    group in its own token permutation; transformers' MoE (Mixtral, Qwen-MoE, ...) routes tokens unpadded, so
    ``torch._scaled_grouped_mm`` hit a device-side assert ("expected input tensor dynamic dimension byte size to
    be non-negative multiple of 16", GroupMMCommon.cuh) that killed the process's CUDA context, and with it
    every later trial in that process (H200). No model source here pads, so none is converted. Where more would
    stand in the way too (a tensorwise cell, a CPU, an older GPU, no Triton), the line says that as well."""
    why = (f"MoE experts' grouped GEMMs (torch._grouped_mm) kept in BF16: torchao's float8 MoE training "
           f"(torchao.prototype.moe_training, Float8TrainingOpConfig) needs each expert's token group padded to a "
           f"multiple of {MOE_GROUP_ROWS} rows, which torchtitan's MoE does in its token permutation and "
           "transformers' MoE does not (torch._scaled_grouped_mm asserts it on the device, killing the CUDA context)")
    if recipe not in MOE_RECIPES:
        return f"{why}; it also has a rowwise recipe only, this cell is {recipe}"
    if device != "cuda":
        return f"{why}; it also runs on CUDA only (Triton casts, torch._scaled_grouped_mm)"
    if torch.cuda.get_device_capability() < MOE_CAPABILITY:
        return (f"{why}; it also needs compute capability {'.'.join(map(str, MOE_CAPABILITY))}+ "
                "(torch._scaled_grouped_mm)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"{why}; it also needs Triton, which is not installed"
    return why


def kept_gemms(model: nn.Module, done: set[str], why_experts: str | None) -> dict[str, str]:
    """Every module holding GEMM weights (a parameter of 2 or more dims, embeddings aside) that no conversion took
    and the Linear filter did not see, with why it stays in high precision."""
    out = {}
    for fqn, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.dim() >= 2]
        if fqn in done or not own or isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        if isinstance(m, _ConvNd):
            out[fqn] = f"{type(m).__name__}: a convolution, not a Linear (float8 training converts Linears only)"
        elif any(p.dim() == 3 for p in own):
            out[fqn] = why_experts or "MoE experts not converted"
        else:
            out[fqn] = (f"{type(m).__name__} is not an nn.Linear, the only module convert_to_float8_training swaps "
                        "(it does its own matmul on its weight: GPT-2's Conv1D addmm, a router's F.linear)")
    return out


IN_PLACE = ("the model adds to its output in place (e.g. Falcon's mlp_output += attention_output), which a float8 "
            "matmul's output (a view made inside torchao's autograd Function) cannot take")


def build(spec: Any, precision: str, device: str) -> Built:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    made = models.build(spec, "bf16" if precision == "fp8" else precision, device)
    model = made.model
    if precision != "fp8":
        return Built(model, forward=compiled(model, spec, made.units), info={"torchao_version": version()},
                     units=made.units)
    keep = _Filter(made.logits_layer, spec.recipe if spec.fp8_filter == "auto" else None)
    keep.model_keeps = {**{name: WEIGHT_READ_BY_PARENT for name in read_by_parent(model)},
                        **{name: IN_PLACE for name in written_in_place(model, device)}}
    config = Float8LinearConfig.from_recipe_name(spec.recipe)
    after_step = None
    if spec.fp8_all_gather:  # FSDP2 all-gathers the FP8 weights; their scales are made once per step for it
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)

        def after_step() -> None:
            precompute_float8_dynamic_scale_for_fsdp(model)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    why_experts = moe_why(spec.recipe, device) if experts(model) else None  # kept in BF16: moe_why says why
    keep.skipped.update(kept_gemms(model, set(keep.converted), why_experts))
    log.info("torchao %s: %d modules in float8, kept %s", spec.recipe, len(keep.converted), keep.skipped)
    return Built(model, forward=compiled(model, spec, made.units), info=keep.info(), after_step=after_step,
                 units=made.units)


def quantize_for_serving(model: nn.Module, recipe: str, logits_layer: str | None) -> dict[str, Any]:
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
