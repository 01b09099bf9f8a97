"""Numerics stacks: what each backend is, declared once; how it builds and runs, one module each.

    te       NVIDIA Transformer Engine: te.TransformerLayer (or TE's modules) under te.autocast
    torch    the pure-PyTorch twin: nn.Linear, SDPA; BF16 or FP32, no FP8
    torchao  the twin with its Linears converted to torchao.float8's Float8Linear (as torchtitan does);
             serving: its Linears quantized to FP8 weights with dynamic FP8 activations (quantize_)

The table below is what the rest of JuicyTalk reads: the spec's validation (which recipes belong
to which stack, where ``compile`` and inference apply), the sweep's collapse rules, capability
resolution, ``juicytalk doctor`` and the report's pairing (each FP8 cell against the BF16 cell of
its ``bf16_partner`` stack). Importing this package imports nothing heavy; :func:`implementation`
loads a stack's module (``trials/backends/<name>.py``) when a trial needs it. A fourth stack is one
entry here and one module with ``build(spec, precision, device) -> Built``: it converts whatever model
the spec's source builds (``trials/models``: MiniGPT, a transformers model, your own module); which
sources a stack builds is declared with the sources, in ``trials/models/__init__.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..models import CONVERTED_TE_LAYERS  # the ways te converts a model it did not build (te_convert.py)


@dataclass(frozen=True)
class Stack:
    name: str
    recipes: dict[str, str]  # FP8 recipe -> compute capability it needs (empty: no FP8 on this stack)
    # the stack whose BF16 cell an FP8 cell of this one is paired with (speedup, loss, teacher-forced numerics):
    # the BF16 model closest to the FP8 one but for FP8, so that what differs is FP8's doing. te: te itself, the
    # same te_layer (TE's fused kernels in BF16; the torch twin would add TE-vs-PyTorch kernel differences);
    # torchao: torch (torchao converts the twin's Linears, the rest is the twin's)
    bf16_partner: str
    compiles: bool  # ``compile: true`` applies (torch.compile of the model)
    needs_cuda: bool  # the backend itself needs a GPU (else only its FP8 may)
    infer: bool  # builds the inference workload
    infer_recipes: tuple[str, ...] | None = None  # FP8 recipes inference serves (None: all of ``recipes``)
    serve_needs_cuda: bool = False  # its FP8 inference runs on CUDA only (torchao's dynamic quantization)
    fp8_rows: int = 8  # FP8 GEMMs need the token count in multiples of this (serving pads its batch to it)
    fp8_all_gather: tuple[str, ...] = ()  # FP8 recipes whose weights FSDP2 all-gathers in FP8 (``fp8_all_gather``)
    fp8_all_gather_masters: bool = False  # there, weights exist only in FP8: the optimizer keeps fp32 masters
    fp8_filter_auto: tuple[str, ...] = ()  # FP8 recipes with the stack's own small-layer filter (``fp8_filter: auto``)
    # bytes per GEMM weight its FP8 cells keep in FP8 beside the high-precision weight, from one step to the next
    # (the memory plan, trials/measure/memory_plan.py): TE caches each weight's FP8 cast and its transpose; torchao casts
    # its weights afresh in every step
    fp8_weight_cache_bytes: int = 0
    # its FP8 casts (amax, scale, cast) run as separate kernels unless torch.compile fuses them into the ops around
    # them: an eager FP8 cell times them unfused (torchao: slower than its BF16 twin eager), not the stack's best
    fp8_casts_need_compile: bool = False

    def serves(self, recipe: str) -> bool:
        return recipe in (self.recipes if self.infer_recipes is None else self.infer_recipes)


STACKS: dict[str, Stack] = {s.name: s for s in (
    # TE: delayed and current scaling on Ada/Hopper, block scaling on Hopper, MXFP8 and NVFP4 on Blackwell.
    Stack("te", {"delayed": "8.9", "current": "8.9", "block": "9.0", "mxfp8": "10.0", "nvfp4": "10.0"}, "te",
          compiles=False, needs_cuda=True, infer=True,
          # FP8 primary weights (quantized_model_init): TE's Float8Tensor and Float8BlockwiseTensor implement
          # FSDP2's fsdp_pre/post_all_gather, so the all-gather moves their FP8 data and scales.
          fp8_all_gather=("delayed", "current", "block"), fp8_all_gather_masters=True, fp8_weight_cache_bytes=2),
    Stack("torch", {}, "torch", compiles=True, needs_cuda=False, infer=True),
    # torchao's recipe names (Float8LinearConfig.from_recipe_name); float8 matmuls need sm_89+ on GPUs.
    # Serving: quantize_ with Float8DynamicActivationFloat8WeightConfig, per tensor or per row
    # (rowwise_with_gw_hp differs from rowwise only in the backward pass).
    Stack("torchao", {"tensorwise": "8.9", "rowwise": "8.9", "rowwise_with_gw_hp": "8.9"}, "torch",
          compiles=True, needs_cuda=False, infer=True, infer_recipes=("tensorwise", "rowwise"),
          serve_needs_cuda=True, fp8_rows=16,  # cuBLASLt's row-scaled FP8 GEMM refuses 8 rows on H200
          fp8_all_gather=("tensorwise",),  # enable_fsdp_float8_all_gather is tensorwise only
          fp8_filter_auto=("tensorwise", "rowwise"),  # torchao.float8._auto_filter_for_recipe
          fp8_casts_need_compile=True),  # torchao's float8 training README: use torch.compile for performance
)}
BACKENDS = ("auto", *STACKS)  # auto: te where Transformer Engine runs, else torch
RECIPES = tuple(r for s in STACKS.values() for r in s.recipes)


def recipe_owner(recipe: str) -> str | None:
    """The stack a recipe name belongs to (names are unique across stacks)."""
    return next((s.name for s in STACKS.values() if recipe in s.recipes), None)


def fp8_stacks() -> list[str]:
    return [s.name for s in STACKS.values() if s.recipes]


# config.model_type values whose decoder layers te_layer transformer_layer takes (te_convert.py converts them)
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def layer_refusal(te_layer: str, model_type: str | None) -> str:
    """Why ``te_layer`` cannot convert a model of this transformers ``model_type`` (None: not a transformers
    model), in one line; '' when it can. Here, beside the stack table, so that the spec asks it before any trial
    starts without importing the converter (te_convert.py, which imports torch; its ``plan`` raises it too).
    The line starts with the value, not the field: whoever shows it names the field once (a SpecError reads
    ``te_layer: transformer_layer applies to ...``, a ConvertError and a skipped grid cell ``te_layer ...``)."""
    if te_layer not in CONVERTED_TE_LAYERS:
        return (f"{te_layer!r} is not one of {', '.join(CONVERTED_TE_LAYERS)} "
                "(the ways to convert a model that is not TE's own)")
    if te_layer == "transformer_layer" and model_type not in LLAMA_FAMILY:
        what = f"a transformers {model_type!r} model" if model_type else "not a transformers model"
        return (f"transformer_layer applies to transformers' {', '.join(LLAMA_FAMILY)} models; "
                f"this one is {what}: use te_layer swap")
    return ""


def implementation(name: str) -> ModuleType:
    """The module that builds and runs stack ``name`` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{name}")


@dataclass
class Built:
    """A stack's model for one cell, and what running it needs.

    ``te``/``recipe``: Transformer Engine's module and FP8 recipe object (te only: the step runs under
    ``te.autocast``); ``forward``: what the step calls when it is not the model itself (a
    ``torch.compile``'d model); ``info``: record fields the stack sets (versions, converted modules).
    """

    model: Any
    te: Any = None
    recipe: Any = None
    forward: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    after_step: Any = None  # called after each optimizer step (torchao: FP8 scales for FSDP's FP8 all-gather)
    # ``make_optimizer(model, lr)``, called once the model is wrapped or sharded, when the stack needs its own
    # optimizer (TE's FP8 primary weights: FusedAdam with fp32 master weights); None: AdamW
    make_optimizer: Any = None
    # qualified names of the model's units (its decoder layers, as its source names them: trials/models), which
    # the stack's in-place conversion keeps: FSDP2 shards each, activation checkpointing recomputes them
    units: tuple[str, ...] = ()


def numerics(name: str) -> ModuleType | None:
    """Stack ``name``'s seam for the per-layer FP8 reads (trials/measure/fp8_layers.py): ``<name>_numerics.py`` here says
    how to find its FP8 modules, run one in BF16 and scale its operands. None for a stack without FP8."""
    return importlib.import_module(f"{__name__}.{name}_numerics") if STACKS[name].recipes else None


def build(spec: Any, backend: str, precision: str, device: str) -> Built:
    """Seeded model of ``spec`` on stack ``backend`` (resolved: never ``auto``)."""
    return implementation(backend).build(spec, precision, device)
