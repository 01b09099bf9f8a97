"""The one place that touches Transformer Engine's version-dependent names.

TE 2.x renamed ``fp8_autocast`` -> ``autocast``, ``fp8.check_fp8_support`` -> ``is_fp8_available``
and the graphing arguments ``fp8_enabled/fp8_recipe`` -> ``enabled/recipe``. This shim prefers the
new names and falls back to the older ones, so the rest of ``trials`` never asks which TE it has.
TE is imported lazily: importing ``trials`` must work on machines without it (CI, CPU hosts).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import os
from types import ModuleType
from typing import Any, Callable, Iterator

from ..runtime.environ import environ

log = logging.getLogger(__name__)


# TE wraps its small fused element-wise helpers (bias-GELU, bias-dropout-add and their backward) in
# torch.compile unless NVTE_TORCH_COMPILE=0. JuicyTalk leaves TE's default alone. Measured on an H200
# (TE 2.20, batch 32 x seq 256, docs/results/h200): turning it off saves ~5 s of compile per trial
# process but makes eager TE BF16 steps 20% slower at d_model 4096 (72.3 -> 87.8 ms) while FP8 barely
# moves (47.1 -> 48.3 ms), which inflates the FP8 speedup from 1.53x to 1.82x. Records carry the
# value in effective use (te_torch_compile) so such runs are never mistaken for each other.
TE_TORCH_COMPILE_ENV = "NVTE_TORCH_COMPILE"


def import_te() -> ModuleType:
    """Import ``transformer_engine.pytorch`` (raises ImportError with TE's reason when absent)."""
    os.environ.setdefault("NVTE_FRAMEWORK", "pytorch")  # silences the missing-JAX-extension warning
    return importlib.import_module("transformer_engine.pytorch")


# What torch.compile loads at its first call (Dynamo's frame converter, Inductor's compiler, its GPU code generator),
# not at ``import torch._dynamo``: where TE compiles its fusers, its first fused call pays for these imports.
FUSER_COMPILER_MODULES = ("torch._dynamo.convert_frame", "torch._inductor.compile_fx",
                          "torch._inductor.codegen.cuda_combined_scheduling")


def import_fuser_compiler() -> None:
    """Import, ahead of TE's first fused call, what that call would import (:data:`FUSER_COMPILER_MODULES`):
    a trial server that preloads TE does it while the sweep's Ray starts, instead of inside the first
    training step. Imports only: nothing is compiled and CUDA is not touched (forked trials need it
    uninitialised). A module torch moved is skipped: the first step then imports what it needs itself."""
    if not te_torch_compile():
        return
    for name in FUSER_COMPILER_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optimisation, never a failure
            log.info("not preloaded: %s (%s: %s)", name, type(exc).__name__, exc)


def te_torch_compile() -> bool:
    """Whether TE compiled its fusers: the same parse TE's jit module applies to the variable."""
    return bool(int(os.environ.get(TE_TORCH_COMPILE_ENV, "1")))


def te_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformer_engine")
    except Exception:  # noqa: BLE001 - any metadata problem means "unknown"
        return None


# Block-scaled recipes and TE's check for each (TE >= 2.x); MXFP8 and NVFP4 need Blackwell.
BLOCK_RECIPE_CHECKS = {"mxfp8": ("is_mxfp8_available", "MXFP8BlockScaling"),
                       "nvfp4": ("is_nvfp4_available", "NVFP4BlockScaling")}


def fp8_support(te: ModuleType, recipe: str) -> tuple[bool, str]:
    """(supported, reason) for one recipe name, in TE's own words."""
    if recipe in BLOCK_RECIPE_CHECKS:
        check, cls = BLOCK_RECIPE_CHECKS[recipe]
        fn = getattr(te, check, None)
        if fn is None:
            return False, f"this Transformer Engine ({te_version()}) has no {cls}"
        return _as_pair(fn(return_reason=True))
    if recipe == "block":
        fn = getattr(te, "is_fp8_block_scaling_available", None)
        if fn is not None:
            return _as_pair(fn(return_reason=True))
        legacy = getattr(getattr(te, "fp8", None), "check_fp8_block_scaling_support", None)
        if legacy is None:
            return False, f"this Transformer Engine ({te_version()}) has no Float8BlockScaling"
        return _as_pair(legacy())
    fn = getattr(te, "is_fp8_available", None)
    if fn is not None:
        return _as_pair(fn(return_reason=True))
    return _as_pair(te.fp8.check_fp8_support())  # TE 1.x compatibility


def _as_pair(value: Any) -> tuple[bool, str]:
    if isinstance(value, tuple):
        ok, reason = value
        return bool(ok), str(reason or "")
    return bool(value), ""


def make_recipe(recipe: str, fp8_format: str, amax_history_len: int, amax_compute_algo: str) -> Any:
    """Build TE's recipe object; TE's own assertions surface as exceptions (recorded as unsupported)."""
    from transformer_engine.common import recipe as te_recipe

    fmt = {"hybrid": te_recipe.Format.HYBRID, "e4m3": te_recipe.Format.E4M3}[fp8_format]
    if recipe == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=fmt, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo
        )
    if recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if recipe == "block":
        return te_recipe.Float8BlockScaling(fp8_format=fmt)
    if recipe == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    if recipe == "nvfp4":
        return te_recipe.NVFP4BlockScaling()  # FP4 (E2M1) data with FP8 block scales; fp8_format does not apply
    raise ValueError(f"unknown recipe {recipe!r}")


def autocast(te: ModuleType | None, recipe_obj: Any, group: Any = None) -> contextlib.AbstractContextManager:
    """FP8 autocast for ``recipe_obj``; a no-op context when there is no recipe. ``group``: the process
    group over which delayed scaling reduces its amaxes (None: this process's own)."""
    if te is None or recipe_obj is None:
        return contextlib.nullcontext()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe_obj, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe_obj, fp8_group=group)  # older TE compatibility


def read_autocast(te: ModuleType | None, recipe_obj: Any) -> contextlib.AbstractContextManager:
    """FP8 autocast for a forward pass outside training (the teacher-forced read) that must not join TE's amax
    bookkeeping: TE's ``_graph=True``, which its own CUDA-graph warm-up passes use. A module's first FP8 forward
    otherwise registers its amax and scale tensors in TE's global reduction buffers, and a graphed trial never
    registers its non-FP8 attention (``make_graphed_callables`` leaves it out): an eager read would add it to
    every later step's amax update. With ``_graph`` nothing is registered and nothing is reduced at exit; what
    the read's casts still write into the amax histories, :func:`fp8_meta_kept` restores. Every weight is cast
    afresh, even after CUDA-graphed accumulation (:func:`_weights_cast_afresh`). A no-op context without a recipe;
    plain autocast where TE has no ``_graph``."""
    if te is None or recipe_obj is None:
        return contextlib.nullcontext()
    if hasattr(te, "autocast"):
        graph = {"_graph": True} if "_graph" in inspect.signature(te.autocast).parameters else {}
        return _weights_cast_afresh(te.autocast(enabled=True, recipe=recipe_obj, **graph))
    graph = {"_graph": True} if "_graph" in inspect.signature(te.fp8_autocast).parameters else {}
    return _weights_cast_afresh(te.fp8_autocast(enabled=True, fp8_recipe=recipe_obj, **graph))  # older TE


@contextlib.contextmanager
def _weights_cast_afresh(autocast_cm: contextlib.AbstractContextManager) -> Iterator[None]:
    """``autocast_cm`` with TE's graphed-accumulation flag (``skip_fp8_weight_update_tensor``, which
    ``cache_quantized_params`` graphs set) hidden: under ``_graph`` TE's modules obey it as a graph does, and after a
    step's last micro-batch it says skip, so a read would reuse the FP8 weights cast before the last optimizer step."""
    manager = _fp8_state_manager()
    holder = getattr(manager, "quantization_state", manager)  # TE 2.20: a state object; older TE: the class
    skip = getattr(holder, "skip_fp8_weight_update_tensor", None)
    if skip is not None:
        holder.skip_fp8_weight_update_tensor = None
    try:
        with autocast_cm:
            yield
    finally:
        if skip is not None:
            holder.skip_fp8_weight_update_tensor = skip


def calibration(te: ModuleType, recipe_obj: Any) -> contextlib.AbstractContextManager:
    """TE's calibration mode: a high-precision forward that records the amaxes FP8 scales are made from."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=False, calibrating=True, recipe=recipe_obj)
    return te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe_obj)  # older TE compatibility


def quantized_model_init(te: ModuleType, recipe_obj: Any) -> contextlib.AbstractContextManager:
    """Build TE modules whose parameters exist only in FP8 (``fp8_model_init`` in older TE)."""
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=True, recipe=recipe_obj)
    return te.fp8_model_init(enabled=True, recipe=recipe_obj)  # older TE compatibility


def is_quantized(te: ModuleType | None, tensor: Any) -> bool:
    """Whether ``tensor`` is one of TE's quantized tensors (an FP8-only parameter of ``quantized_model_init``).

    Asked of TE's own base class: duck typing cannot tell, since every ``torch.Tensor`` has a
    ``dequantize`` method (checking for it once skipped the init of every parameter).
    """
    if te is None:
        return False
    tensor_mod = importlib.import_module("transformer_engine.pytorch.tensor")
    return isinstance(tensor, tensor_mod.QuantizedTensor)


@contextlib.contextmanager
def own_extra_state() -> Any:
    """Let TE load FP8 metadata this process itself just produced.

    TE 2.x refuses pickled ``_extra_state`` (delayed-scaling scales and amax histories) unless
    ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``, because unpickling a checkpoint from elsewhere can run
    code. The state loaded here never left this process's memory; the variable is set only around
    that load and restored after it.
    """
    with environ(NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE="1"):
        yield


class Fp8MetaSaved:
    """Every TE module's delayed-scaling state as it was when taken: TE's ``get_fp8_meta_tensors()`` per module
    (clones: ``{"scaling_fwd": [scale, amax_history], "scaling_bwd": [...]}``, None for a module with no FP8
    state yet), to put back (:meth:`restore`) and to read the scales from (:meth:`scale`)."""

    def __init__(self, model: Any):
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        # TE's modules, as its graph.py selects them (te.TransformerLayer is a plain nn.Module holding them)
        self.tensors = {m: m.get_fp8_meta_tensors() for m in model.modules()
                        if isinstance(m, TransformerEngineBaseModule)}

    def restore(self) -> None:
        """Copy the saved scales and histories back in place (``reset_fp8_meta_tensors``: ``copy_``, so the
        quantizers, TE's global amax-reduction buffers and any captured CUDA graph, which hold views of these very
        tensors, see them); a module that had no state is reset to TE's initial one (scale 1, zero history)."""
        for module, tensors in self.tensors.items():
            module.reset_fp8_meta_tensors(tensors)

    def scale(self, module: Any, key: str, index: int) -> Any:
        """The saved ``fp8_meta[key].scale[index]`` of ``module`` (key: scaling_fwd or scaling_bwd), None where it
        had no state when taken or is no module this snapshot holds."""
        tensors = self.tensors.get(module)
        return None if tensors is None else tensors[key][0][index]


@contextlib.contextmanager
def fp8_meta_kept(model: Any, recipe_obj: Any) -> Iterator[Fp8MetaSaved | None]:
    """Run a forward pass that leaves TE's delayed-scaling state exactly as it found it; yields the
    :class:`Fp8MetaSaved` it restores at exit (None for recipes without that state), for a read that needs
    training's scales in the middle too (trials/backends/te_numerics.py).

    Under delayed scaling every FP8 forward max-accumulates its tensors' amaxes into row 0 of each module's
    ``fp8_meta['scaling_fwd'].amax_history``; TE folds that row into the history and a new ``scale`` when the
    outermost autocast of a training step exits (TE 2.20: ``FP8GlobalStateManager.autocast_exit``, with grad
    enabled). A no-grad read's amaxes would wait in row 0 for the next training step to fold in with its own, so
    they would change the scales, the FP8 casts and the losses of every step after it. A read with a backward
    changes more: the backward of the first FP8 module of an autocast folds every registered module's gradient
    amaxes into ``scaling_bwd`` and sets new backward scales (``reduce_and_update_fp8_tensors(forward=False)``
    in TE's Linear, LayerNormLinear and LayerNormMLP backward), whether or not the autocast was ``_graph``.
    TE's own CUDA-graph capture faces the same problem
    with its warm-up passes and solves it this way (``transformer_engine.pytorch.graph.save_fp8_tensors`` /
    ``restore_fp8_tensors``): each module's ``get_fp8_meta_tensors()`` (clones of scale and amax_history for
    the forward and backward sets) before, ``reset_fp8_meta_tensors(saved)`` after (:class:`Fp8MetaSaved`).
    Nothing else the read touches persists: under :func:`read_autocast` it registers no module in TE's global
    amax buffers and reduces nothing at the autocast's exit, no weight is cached without
    ``is_first_microbatch``, quantizer usage flags are set again by every forward, and dropout is off.
    Recipes without delayed scaling (current, block, MXFP8, NVFP4) keep no such state: nothing to restore.
    """
    from transformer_engine.common.recipe import DelayedScaling

    if not isinstance(recipe_obj, DelayedScaling):
        yield None
        return
    saved = Fp8MetaSaved(model)
    try:
        yield saved
    finally:
        saved.restore()


def make_graphed_callables(te: ModuleType, module: Callable | tuple, sample_args: tuple, recipe_obj: Any,
                           cache_weights: bool = False) -> Any:
    """CUDA-graph ``module`` forward+backward with TE, FP8 state included when a recipe is given; ``module`` may be a
    tuple of modules (a model's units), each graphed with its own tuple of ``sample_args``, in one memory pool, in
    the order they run (TE's per-callable form; the recipe applies to every one). Parameter gradients come back in
    the graphs' static buffers, as torch's graphs return them (``clone_param_grads_on_return=False`` where this TE
    has it; its default clones each, a second copy of every gradient, 16 GB at 8B parameters): the training step
    consumes them before the next replay, its optimizer step, or under accumulation its own ``.grad`` buffers that
    autograd adds each replay's into (trials/workloads/train_step.py).
    ``cache_weights`` (gradient accumulation, FP8): the graphs cast each weight to FP8 only where the call says
    ``is_first_microbatch=True`` and reuse the cast otherwise (TE's ``cache_quantized_params``, older TE's
    ``fp8_weight_caching``); every call must then pass it."""
    params = inspect.signature(te.make_graphed_callables).parameters
    kwargs: dict[str, Any] = {}
    if recipe_obj is not None:
        if "recipe" in params:
            kwargs.update(enabled=True, recipe=recipe_obj)
        else:  # older TE compatibility
            kwargs.update(fp8_enabled=True, fp8_recipe=recipe_obj)
        if cache_weights:
            kwargs["cache_quantized_params" if "cache_quantized_params" in params else "fp8_weight_caching"] = True
    if "clone_param_grads_on_return" in params:
        kwargs["clone_param_grads_on_return"] = False
    if "allow_unused_input" in params:  # as torch's graphs are made (unit_graphs.py): a unit may ignore an input
        kwargs["allow_unused_input"] = True
    collecting = gc.isenabled()
    try:
        return te.make_graphed_callables(module, sample_args, **kwargs)
    except Exception:
        # a capture that raised leaves TE's process-wide "capturing" flag set (TE ends it on success only), and TE's
        # modules then skip delayed scaling's backward scale update in every later eager step of the process
        end = getattr(importlib.import_module("transformer_engine.pytorch.graph"), "set_capture_end", None)
        if end is not None:
            end()
        if collecting:  # TE stops Python's gc around each graph's capture and starts it again on success only
            gc.enable()
        raise


def reset_te_state() -> None:
    """Clear TE's process-wide state between trials: FP8 globals and the cached cuBLAS workspaces.

    A process that runs several trials must not let one trial's amax history or recipe reach the next,
    nor TE's 32 MiB cuBLAS workspace (allocated on TE's first GEMM and cached) count in the next trial's
    peak memory: measured on an H200, torch-bf16 cells run after TE cells in one process reported
    32 MiB more than in a fresh process. TE 2.x caches its workspaces and constant tensors with
    ``functools.lru_cache`` in ``cpp_extensions.gemm`` (TE 1.x: a ``module.base`` global).
    Only acts when TE is already imported: a process that never used TE has no state to clear.
    """
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return
    gemm = sys.modules.get("transformer_engine.pytorch.cpp_extensions.gemm")
    for value in list(vars(gemm).values()) if gemm is not None else []:
        if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == gemm.__name__:
            value.cache_clear()
    base = sys.modules.get("transformer_engine.pytorch.module.base")
    if base is not None:
        if getattr(base, "_cublas_workspace", None) is not None:  # older TE
            base._cublas_workspace = None
        for name in ("_multi_stream_cublas_workspace", "_dummy_wgrads"):
            cached = getattr(base, name, None)
            if hasattr(cached, "clear"):
                cached.clear()
    manager = _fp8_state_manager()
    if manager is None:
        log.warning("this Transformer Engine has no FP8GlobalStateManager.reset(); FP8 state not cleared")
        return
    manager.reset()


def _fp8_state_manager() -> Any:
    """TE's ``FP8GlobalStateManager`` class (None where this TE has none)."""
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):  # newer, older TE
        try:
            return getattr(importlib.import_module(name), "FP8GlobalStateManager")
        except (ImportError, AttributeError):
            continue
    return None


def registered_amax_tensors() -> int | None:
    """How many amax tensors TE's delayed-scaling reduction runs over at each autocast exit, forward and backward
    together: every FP8 module that ever ran under delayed scaling in this process since the last
    :func:`reset_te_state`, of this model or any earlier one (TE registers a module on its first FP8 forward and
    never forgets it). None where TE is not imported or keeps these buffers elsewhere."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return None
    manager = _fp8_state_manager()
    state = getattr(manager, "quantization_state", manager)  # TE 2.20 keeps them on a state object; older TE on the class
    buffers = getattr(state, "global_amax_buffer", None)
    return None if buffers is None else sum(len(v) for v in buffers.values())
