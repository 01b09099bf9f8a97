"""Transformer Engine: te.TransformerLayer blocks (or TE's modules), FP8 under ``te.autocast`` with TE's recipe.

MiniGPT TE builds from its own modules (``te_layer`` transformer_layer or modules). Any other model (an ``hf:``
or ``py:`` source, trials/models) is built by its source, seeded, in BF16 (FP32 for fp32 cells) as on the other
stacks, and converted in place (``te_layer`` swap or transformer_layer, trials/backends/te_convert.py); which of
the two a source gets is its table entry's ``te_own``. The converted model's FLOPs are counted before it is
converted: FlopCounterMode sees aten's GEMMs, not TE's, and the conversion keeps the math. So is the share of them
TE runs in FP8 (``fp8_flop_share``): the GEMMs of the source model's Linears that the conversion plan turns into
TE's modules (te_convert.fp8_gemms), not by their operands as on torchao; MiniGPT's is its formula's, the blocks'.

With ``fp8_all_gather`` (FSDP2 only) the blocks' weights exist only in FP8 (``quantized_model_init``):
FSDP2 then all-gathers their FP8 data and scales instead of BF16 (TE's quantized tensors implement
``fsdp_pre_all_gather``), and the optimizer is TE's FusedAdam with fp32 master weights, which
re-quantizes each FP8 weight from its master after every step (an update applied to FP8 itself would
mostly round away). The masters start from the same seeded init as the BF16-weight cell.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..parallel import ranks as distributed
from .. import models
from . import te_compat
from ..measure.metrics import blocks_fp8_share, count_flops
from ..models.minigpt_net import MiniGPT, ModelConfig, build_model, fused_qkv_state
from . import Built, te_convert

def fp8_recipe(spec: Any) -> Any:
    """TE's recipe object for an fp8 cell's recipe, format and amax settings."""
    return te_compat.make_recipe(spec.recipe, spec.fp8_format, spec.amax_history_len, spec.amax_compute_algo)


def build(spec: Any, precision: str, device: str) -> Built:
    te = te_compat.import_te()
    recipe = None
    info: dict[str, Any] = {"te_torch_compile": te_compat.te_torch_compile()}
    if precision == "fp8":
        recipe = fp8_recipe(spec)
        info["fp8_recipe_repr"] = repr(recipe)
    if not spec.source.te_own:
        return _converted(spec, te, recipe, precision, device, info)
    # MiniGPT's FLOPs are its formula's (trials/trial.py), and so is the share of them TE runs in FP8: its blocks'
    info["fp8_flop_share"] = blocks_fp8_share(ModelConfig.from_spec(spec)) if precision == "fp8" else 0.0
    if spec.fp8_all_gather:
        built = _fp8_weights(spec, te, recipe, device, info)
    else:
        built = Built(build_model(spec, "te", precision, device, te), te=te, recipe=recipe, info=info)
    built.units = models.units(spec, built.model)  # TE's own blocks
    return built


def source_model(spec: Any, precision: str, device: str) -> tuple[Any, list[te_convert.Step], dict[str, Any]]:
    """The spec's model as its source builds it (a ``models.common.Built``: seeded, BF16 for bf16 and fp8 cells,
    FP32 for fp32 cells), TE's conversion plan for it, and its counted FLOPs as record fields, taken now, before
    TE converts it. ``fp8_flop_share``: the FLOPs of the GEMMs the plan has TE run in FP8 (fp8 cells;
    ``te_convert.fp8_gemms``), counted on the source model's Linears that become them; 0 on bf16 and fp32 cells."""
    made = models.build(spec, "bf16" if precision == "fp8" else precision, device)
    steps = te_convert.plan(made.model, spec.te_layer, made.logits_layer)
    fp8 = te_convert.fp8_gemms(steps) if precision == "fp8" else ()
    return made, steps, count_flops(spec, made.model, made.vocab, device, spec.world_size, fp8)


def _converted(spec: Any, te: Any, recipe: Any, precision: str, device: str, info: dict[str, Any]) -> Built:
    """A model TE did not build, converted in place (``te_layer``); the record lists what TE runs and what stays."""
    made, steps, flops = source_model(spec, precision, device)
    te_convert.convert(made.model, te, spec.te_layer, made.logits_layer, steps)
    made.model.backend = "te"  # generation runs it under te.autocast, as MiniGPT's te blocks
    info.update(flops)
    info.update(te_convert.record(steps))
    return Built(made.model, te=te, recipe=recipe, info=info, units=made.units)


def load_fp8_weights(model: nn.Module, state: dict) -> None:
    """Load BF16 weights into FP8 parameters (``quantized_model_init``) with the calibrated scales.

    Copying a BF16 tensor into an FP8 parameter quantizes it with the parameter's current scale, and
    a TE module's FP8 scales arrive with its ``_extra_state``, which ``load_state_dict`` applies after
    the parameters (and which re-points the weights' quantizers at the loaded scales). The first load
    brings the scales, the second quantizes every weight with them. Current scaling takes each
    tensor's own amax and needs no scales; loading twice does no harm there.
    """
    with te_compat.own_extra_state():  # the state this trial just calibrated, never a file
        model.load_state_dict(state)
        model.load_state_dict(state)


def _fp8_weights(spec: Any, te: Any, recipe: Any, device: str, info: dict[str, Any]) -> Built:
    """The model with FP8 primary weights, loaded from the seeded BF16 init; FusedAdam seeds its masters
    from that init too (not from the FP8 values, which would start training from quantization noise)."""
    init = fused_qkv_state(build_model(spec, "te", "fp8", device, te).state_dict())
    with te_compat.quantized_model_init(te, recipe):
        model = MiniGPT(ModelConfig.from_spec(spec), torch.bfloat16, device, te, fused_qkv=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])  # into an FP8 parameter: quantized with its quantizer's scale
    info["optimizer"] = "te FusedAdam, fp32 master weights"

    def make_optimizer(wrapped: nn.Module, lr: float) -> torch.optim.Optimizer:
        from ..workloads.train_step import WEIGHT_DECAY  # the BF16-weight cells' AdamW decay (train imports this package)

        opt = te.optimizers.FusedAdam(wrapped.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, master_weights=True,
                                      master_weight_dtype=torch.float32)
        for name, p in wrapped.named_parameters():
            master = distributed.local_shard(init[name].float(), p)  # this rank's shard of the init
            opt.initialize_state(p, store_param_remainders=False)
            opt.set_scaled_state(p, "master_param", master.contiguous())
        init.clear()  # the BF16 init copy is not needed once the masters hold it
        return opt

    return Built(model, te=te, recipe=recipe, info=info, make_optimizer=make_optimizer)
