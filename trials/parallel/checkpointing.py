"""Activation checkpointing per unit, and the bytes a training step holds for backward.

A model's units are its decoder layers, as its source names them (trials/models: ``units``), the same
units FSDP2 shards. ``activation_checkpointing`` takes torchtitan's names:

    none       every unit keeps what its backward needs (autograd's saved tensors)
    full       every unit keeps only its input; backward re-runs its forward to get the rest
    selective  every ``ac_every``-th unit does (units ac_every-1, 2*ac_every-1, ...: torchtitan's layer-wise
               selective AC, whose default is every 2nd layer)

A unit is checkpointed in place (its ``forward`` runs under the checkpoint), so qualified names and
state-dict keys stay as they were: FSDP2, a per-unit ``torch.compile`` and TE's FP8 master weights see
the module they would see without it. torch's non-reentrant ``torch.utils.checkpoint.checkpoint`` for
torch and torchao cells; Transformer Engine's ``te.distributed.checkpoint`` for TE cells, which
recomputes the forward with the FP8 scales the first forward used (delayed scaling would otherwise
update its amax history twice and recompute with other scales than the ones its saved tensors carry).

:class:`SavedBytes` measures what the step holds for backward with
``torch.autograd.graph.saved_tensors_hooks`` (CPU and GPU alike): the distinct storages autograd packs
during the forward, parameters excluded (they are held anyway), plus the inputs a checkpointed unit keeps
for its recompute (held by the checkpoint, not by autograd, so no hook sees them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

log = logging.getLogger(__name__)
Unit = TypeVar("Unit")


def chosen(units: tuple[Unit, ...], mode: str, every: int) -> tuple[Unit, ...]:
    """The units ``mode`` recomputes: all (full), every ``every``-th (selective), none; the one rule, which the
    memory plan (trials/measure/memory_plan.py) follows too."""
    if mode == "full":
        return tuple(units)
    if mode == "selective":
        return tuple(name for i, name in enumerate(units) if (i + 1) % every == 0)
    return ()


@dataclass
class Checkpointed:
    """The units whose forward runs under a checkpoint; ``tally``: the :class:`SavedBytes` counting now, if any."""

    units: tuple[str, ...] = ()
    tally: "SavedBytes | None" = field(default=None, repr=False)


def apply(model: nn.Module, units: tuple[str, ...], mode: str, every: int, te: Any = None) -> Checkpointed:
    """Checkpoint ``model``'s units (qualified names) as ``mode`` says, in place; ``te``: TE's module for TE cells
    (its checkpoint keeps the FP8 scales), else None (torch's)."""
    handle = Checkpointed(chosen(units, mode, every))
    for name in handle.units:
        unit = model.get_submodule(name)
        unit.forward = _recomputed(unit.forward, handle, te)  # an instance attribute: __call__ finds it first
    if handle.units:
        log.info("activation checkpointing %s: %d of %d units recomputed in backward%s", mode, len(handle.units),
                 len(units), " (te.distributed.checkpoint)" if te is not None else "")
    return handle


def _recomputed(forward: Callable[..., Any], handle: Checkpointed, te: Any) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if handle.tally is not None:
            handle.tally.hold((args, kwargs))  # what the checkpoint keeps for the recompute
        if te is not None:
            return te.distributed.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


class SavedBytes:
    """``with SavedBytes(model, checkpointed) as saved: step(x, y)``, then ``saved.bytes``: the bytes held for
    backward by the step's forward (see the module's docstring). The pack hook hands autograd a detached alias of
    each tensor (the same storage and version counter), so the step computes what it would without the hooks;
    they cost a Python call per saved tensor, which is why the trial counts an untimed step.

    Not the tensor itself: autograd passes the pack hook an output its own node saves (``exp``'s, ``softmax``'s,
    attention's) with that node as its ``grad_fn``, and the packed object is held by the node, a cycle through
    autograd's C++ graph that Python's gc cannot see. A backward frees the packed objects and so the cycle; a
    forward that raises before its backward (an OOM in a trial's first step) or is never backed (the memory
    plan's fake pass) left its whole graph, every activation of that forward, alive for the life of the process
    (an H200 OOM trial kept 14.3 GB allocated after it returned: tests/test_gpu.py).

    Storages are told apart by their StorageImpl (``untyped_storage()._cdata``), so it counts fake tensors too
    (they have no data): the memory plan (trials/measure/memory_plan.py) runs it under FakeTensorMode with ``units``,
    the qualified names of the model's units, to tell apart the storages each unit's forward saves (``per_unit``,
    seen before or not; the rest: ``outside``) and those each unit is handed (``unit_inputs``: its args and kwargs,
    what the unit keeps if checkpointed), each a mapping storage -> bytes.
    """

    def __init__(self, model: nn.Module, checkpointed: Checkpointed | None = None, units: tuple[str, ...] = ()):
        self.model, self.checkpointed = model, checkpointed
        self.units = units
        self.storages: dict[int, int] = {}  # storage identity -> bytes
        self.outside: dict[int, int] = {}
        self.per_unit: list[dict[int, int]] = [{} for _ in units]
        self.unit_inputs: list[dict[int, int]] = [{} for _ in units]
        self._current: int | None = None  # the unit whose forward runs now
        # the units' inputs, alive till the end: a storage nothing saves is freed after its unit, and a later one
        # at its address would pass for it
        self._handed: list[torch.Tensor] = []
        self._counting = True  # off once a step's first micro-batch is counted (:meth:`stop`)
        self._params: set[int] = set()
        self._handles: list[Any] = []
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())  # each storage once, wherever it was saved

    def __enter__(self) -> "SavedBytes":
        self._params = {_storage(p)[0] for p in self.model.parameters()}
        for i, name in enumerate(self.units):
            unit = self.model.get_submodule(name)
            self._handles.append(unit.register_forward_pre_hook(self._enter_unit(i), with_kwargs=True))
            self._handles.append(unit.register_forward_hook(self._leave_unit))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        if self.checkpointed is not None:
            self.checkpointed.tally = self
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.checkpointed is not None:
            self.checkpointed.tally = None
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._handed.clear()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count(tensor)
        return tensor.detach()  # never the tensor itself: see the class docstring

    def hold(self, values: Any) -> None:
        """Count the tensors in ``values`` (what a checkpointed unit keeps for its recompute)."""
        for value in tree_leaves(values):
            if isinstance(value, torch.Tensor):
                self._count(value)

    def stop(self) -> None:
        """Count nothing more: under gradient accumulation a step's first micro-batch is what one forward holds
        (each one's saved tensors are freed by its backward before the next runs)."""
        self._counting = False

    def _count(self, tensor: torch.Tensor) -> None:
        if not self._counting:
            return
        found = self._kept(tensor)
        if found is not None:
            key, size = found
            self.storages[key] = size
            (self.outside if self._current is None else self.per_unit[self._current])[key] = size

    def _kept(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(storage, bytes) of what holding ``tensor`` for backward adds, or None: nothing, or a weight."""
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return None  # a weight (or its transpose) held for the backward's GEMM: held by the model anyway
        key, size = _storage(tensor)
        return (key, size) if size and key not in self._params else None

    def _enter_unit(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._current = i
            handed = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self._handed.extend(handed)
            self.unit_inputs[i] = dict(kept for kept in map(self._kept, handed) if kept is not None)
        return hook

    def _leave_unit(self, module: nn.Module, args: Any, out: Any) -> None:
        self._current = None


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(an identity of the memory ``tensor`` lives in, its bytes): the storage (its StorageImpl, which fake
    tensors have too) where it has one, else (tensor subclasses such as FP8 or sharded tensors) the tensor
    itself at its element size."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        storage = local.untyped_storage()
        return storage._cdata, int(storage.nbytes())
    except Exception:  # noqa: BLE001 - a subclass without one storage
        return id(local), int(local.numel() * local.element_size())
