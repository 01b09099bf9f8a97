"""CUDA graphs of a model's units for training: each unit (decoder layer) a forward and a backward graph, root eager.

Why per unit: a transformers model's root runs host code around its layers (its mask and position code inspects
its inputs on the host), which a capture of the whole forward cannot hold; a decoder layer runs none. So the units
the model source declares (trials/models ``units``: the ones FSDP2 shards and checkpointing recomputes) are
graphed, as Megatron's per-layer ``CudaGraphManager`` ("CUDA graph local") graphs its layers, and the root
(embeddings, final norm, LM head), the loss and the optimizer run eager between them. MiniGPT's forward runs no
host code and is captured whole instead (trials/workloads/train_step.py ``TrainStep.capture``).

How a unit is called is recorded first: one forward of the model on a sample batch, a pre-hook on each unit (removed
after) keeping the arguments the root hands it: the hidden states, and for transformers' decoder layers their
keywords (the rotary ``position_embeddings`` pair, the mask, the position ids, ``use_cache=False``, ...). The
tensors among them are the graph's inputs, in order, through :class:`_Positional`, a module that puts them back in
their places before calling the unit: torch's ``make_graphed_callables`` takes positional tensors only, and TE's
(whose ``sample_kwargs`` would take keywords) takes the same module, so one recording serves both. What is not a
tensor (None, flags) is a constant of the graph, checked again, with every tensor's shape and dtype, at each replay.

    te             ``te.make_graphed_callables`` over every unit in one call (one memory pool), with the cell's
                   recipe (trials/backends/te_compat.py): at each replay TE registers the unit's FP8 modules in its
                   amax buffers, the step's autocast reduces them and updates delayed scaling's scales at its exit as
                   it does eagerly (outside the graphs, in place: the graphs read the new scales), and the first
                   unit's backward updates the backward scales; under accumulation its graphs cast the FP8 weights
                   on a step's first micro-batch only (``cache_quantized_params``, told ``is_first_microbatch``).
    torch, torchao ``torch.cuda.make_graphed_callables`` over every unit in one call; torchao's dynamic scales (amax,
                   scale, cast) are kernels inside the graphs. Compiled units (``compile: true``) are graphed as
                   they are, Inductor's kernels captured into torch's graphs, rather than compiled with
                   ``mode="reduce-overhead"`` (Inductor's own cudagraph trees): one mechanism and one pool on every
                   stack, and no cudagraph-tree output buffers that a later replay overwrites under the root's feet
                   (benchmarks/hf_loop.py ``--graphs reduce-overhead`` times that way beside this one).

Each unit's ``forward`` is then replaced (as torch and TE replace a graphed module's) by a dispatcher: inside
:meth:`UnitGraphs.replaying` (the training step's forward) it replays the unit's graph; anywhere else (generation,
the teacher-forced and per-layer FP8 reads, which hook the modules inside units) the unit runs eager, as before.
Dropout inside a unit draws from torch's CUDA generator, which every graph registers, so each replay draws fresh
masks. What cannot be graphed is said in one line (:func:`refusal`), and the step then runs eager with that line in
the record (``cuda_graphs_why``): a model with no units, a unit holding MoE experts (its routing sends a
data-dependent number of tokens to each expert), a unit the root calls other than once per forward. A unit whose
capture fails (host code inside it: a ``.item()``, data-dependent control flow) fails the trial as unsupported.

The optimizer step stays eager: fused AdamW is one multi-tensor launch per parameter group, so a graph would save a
few launches of host time; its cost at full depth (43 ms of an 8B step) is the kernel's own traffic over the
parameters, gradients and moments, which a graph does not shorten (``capturable=True`` would also need gradients
at fixed addresses across steps).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..backends import te_compat
from ..models.common import experts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphFacts:
    """What a graphed step's capture did, for the record: graph replays per optimizer step (forward and backward
    graphs, once per micro-batch; 0: nothing was graphed), the capture's seconds (warm-up passes included), the
    bytes the graphs' private memory pool holds after it and of those the ones free to the allocator, which the
    replays use (trials/measure/memory.py ``graph_pools``; None where the allocator does not say), and what runs
    outside the graphs, or why nothing was graphed."""

    graphs_per_step: int
    capture_s: float | None = None
    pool_bytes: int | None = None
    pool_free_bytes: int | None = None
    why: str = ""

    def record(self) -> dict[str, Any]:
        return {"graphs_per_step": self.graphs_per_step, "graph_capture_s": self.capture_s,
                "graph_pool_bytes": self.pool_bytes, "graph_pool_free_bytes": self.pool_free_bytes,
                "cuda_graphs_why": self.why or None}


ROOT_EAGER = ("the root (embeddings, final norm, LM head), the loss and the optimizer step run eager between them "
              "(a transformers model's root runs host code around its layers)")


class Mismatch(RuntimeError):
    """A unit was called, inside a graphed step, otherwise than it was captured."""


@dataclass(frozen=True)
class Call:
    """How the root calls one unit: the tree of its (args, kwargs), where its tensors sit among the leaves (the
    graph's inputs, in order) and the other leaves (constants a replay must see again), each tensor's shape and
    dtype, and the static tensors the capture runs on (detached copies, ``requires_grad`` as handed)."""

    tree: TreeSpec
    constants: tuple[Any, ...]  # every leaf, None where a tensor goes
    where: tuple[int, ...]  # the leaves that are tensors
    metas: tuple[tuple[torch.Size, torch.dtype], ...]
    samples: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "Call":
        leaves, tree = tree_flatten((tuple(args), dict(kwargs)))
        where = tuple(i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor))
        tensors = [leaves[i] for i in where]
        return cls(tree, tuple(None if i in where else v for i, v in enumerate(leaves)), where,
                   tuple((t.shape, t.dtype) for t in tensors),
                   tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors))

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's inputs in a call of the unit (Mismatch where the call is not the one captured)."""
        leaves, tree = tree_flatten((tuple(args), dict(kwargs)))
        if tree != self.tree:
            raise Mismatch(f"arguments {tree} where the capture had {self.tree}")
        tensors = []
        for i, (v, c) in enumerate(zip(leaves, self.constants)):
            if isinstance(v, torch.Tensor):
                tensors.append(v)
            elif not _same(v, c):
                raise Mismatch(f"argument {i} is {v!r} where the capture had {c!r}")
        if len(tensors) != len(self.where) or any((t.shape, t.dtype) != m for t, m in zip(tensors, self.metas)):
            raise Mismatch(f"tensors {[(tuple(t.shape), t.dtype) for t in tensors]} where the capture had "
                           f"{[(tuple(s), d) for s, d in self.metas]}")
        return tensors

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        """(args, kwargs) of the call, ``tensors`` in their places."""
        leaves = list(self.constants)
        for i, t in zip(self.where, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self.tree)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality is the same only as itself
        return False


class _Positional(nn.Module):
    """A unit called with its call's tensors alone, positionally (what a graph takes): the rest of the call, its
    constants, put back as recorded."""

    def __init__(self, unit: nn.Module, call: Call):
        super().__init__()
        self.unit = unit
        self.call = call

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = self.call.rebuild(tensors)
        return self.unit(*args, **kwargs)


def refusal(model: nn.Module, units: tuple[str, ...]) -> str:
    """Why ``model``'s units cannot be graphed, in one line ('' where they can), from the model alone."""
    if not units:
        return ("the model has no units (decoder layers) to graph one by one, and its forward is not captured whole "
                "(its root may run host code); its source says how it finds units (trials/models)")
    held = experts(model)
    for name in units:
        moe = [e for e in held if e == name or e.startswith(f"{name}.")]
        if moe:
            return (f"unit {name} holds MoE experts ({moe[0]}): its router sends a data-dependent number of tokens "
                    "to each expert, which a CUDA graph cannot replay")
    return ""


def record_calls(model: nn.Module, units: tuple[str, ...], sample: torch.Tensor
                 ) -> tuple[tuple[str, ...], list[Call], str]:
    """The units in the order one forward of ``model`` on ``sample`` runs them, how it calls each, and '' (or why
    the units cannot be graphed: one called other than once). That order, not the one the model source names them
    in, is the one their graphs are captured in: they share one memory pool, which stays sound only where the
    graphs replay in the order they were captured (torch's ``make_graphed_callables``). The forward runs eager,
    outside FP8 autocast (only the calls' shapes, dtypes and constants are kept; no FP8 state moves) and with the
    RNG restored after it."""
    seen: dict[int, list[Call]] = {i: [] for i in range(len(units))}
    ran: list[int] = []  # unit indices, as called

    def keep(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[i].append(Call.of(args, kwargs))
            ran.append(i)
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(keep(i), with_kwargs=True)
               for i, name in enumerate(units)]
    devices = [sample.device] if sample.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model(sample)
    finally:
        for h in handles:
            h.remove()
    for i, name in enumerate(units):
        if len(seen[i]) != 1:
            return (), [], (f"unit {name} runs {len(seen[i])} times in one forward: a graph replays its unit's one "
                            "call, into one set of buffers")
    return tuple(units[i] for i in ran), [seen[i][0] for i in ran], ""


def torch_graphed(modules: Any, samples: tuple, **kwargs: Any) -> Any:
    """``torch.cuda.make_graphed_callables`` with the CUDA generator left as it found it: its warm-up runs the modules
    eagerly (three forward and backward passes), and dropout inside them draws masks the eager step never draws, so a
    graphed loss curve would part from the eager one at the same seed. TE's graphing restores it the same way."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    state = generator.get_state()
    try:
        return torch.cuda.make_graphed_callables(modules, samples, **kwargs)
    finally:
        generator.set_state(state)


class UnitGraphs:
    """A model's units captured as CUDA graphs (:meth:`capture`), replayed inside :meth:`replaying`."""

    def __init__(self, model: nn.Module, units: tuple[str, ...], calls: list[Call], graphed: tuple[nn.Module, ...],
                 cache_weights: bool):
        self.units, self.calls, self.graphed = units, calls, graphed
        self.cache_weights = cache_weights  # TE: every replay is told is_first_microbatch
        self.armed = False
        self.inside = False  # a replay's own call: a graph not yet captured runs its unit eager through it
        self.first: bool | None = None
        self.replayed: set[int] = set()
        for i, name in enumerate(units):
            unit = model.get_submodule(name)
            unit.forward = self._dispatch(i, unit.forward)

    @classmethod
    def capture(cls, model: nn.Module, units: tuple[str, ...], calls: list[Call], te: Any, recipe: Any,
                cache_weights: bool) -> "UnitGraphs":
        """Graph every unit, in one call (one memory pool, captured in the order they run): TE's graphing where the
        stack is TE (``recipe``: its FP8 recipe, None for BF16), torch's elsewhere."""
        holder = type("GraphedUnit", (_Positional,), {})  # TE patches the class's __call__ while it captures
        wrapped = tuple(holder(model.get_submodule(name), call).train(model.get_submodule(name).training)
                        for name, call in zip(units, calls))
        samples = tuple(call.samples for call in calls)
        if te is not None:
            graphed = te_compat.make_graphed_callables(te, wrapped, samples, recipe, cache_weights)
        else:
            graphed = torch_graphed(wrapped, samples, allow_unused_input=True)
        return cls(model, units, calls, tuple(graphed), cache_weights)

    def _dispatch(self, i: int, eager: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.armed or self.inside:
                return eager(*args, **kwargs)
            if i in self.replayed:
                raise Mismatch(f"unit {self.units[i]} called twice in one graphed forward")
            self.replayed.add(i)
            try:
                tensors = self.calls[i].tensors(args, kwargs)
            except Mismatch as exc:
                raise Mismatch(f"unit {self.units[i]}: {exc}") from None
            told = {"is_first_microbatch": bool(self.first)} if self.cache_weights else {}
            self.inside = True
            try:
                return self.graphed[i](*tensors, **told)
            finally:
                self.inside = False
        return forward

    @contextlib.contextmanager
    def replaying(self, first: bool | None) -> Iterator[None]:
        """Units replay their graphs inside (one forward; ``first``: whether it is its step's first micro-batch,
        None where the step is not split); eager outside."""
        self.armed, self.first, self.replayed = True, first, set()
        try:
            yield
        finally:
            self.armed, self.first = False, None
