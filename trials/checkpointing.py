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
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

log = logging.getLogger(__name__)


def chosen(units: tuple[str, ...], mode: str, every: int) -> tuple[str, ...]:
    """The units ``mode`` recomputes: all (full), every ``every``-th (selective), none."""
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
    backward by the step's forward (see the module's docstring). The hooks return each tensor as it is, so the
    step computes what it would without them; they cost a Python call per saved tensor, which is why the
    trial counts an untimed step."""

    def __init__(self, model: nn.Module, checkpointed: Checkpointed | None = None):
        self.model, self.checkpointed = model, checkpointed
        self.storages: dict[int, int] = {}  # storage address -> bytes
        self._params: set[int] = set()
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedBytes":
        self._params = {_storage(p)[0] for p in self.model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        if self.checkpointed is not None:
            self.checkpointed.tally = self
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.checkpointed is not None:
            self.checkpointed.tally = None
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._count(tensor)
        return tensor

    def hold(self, values: Any) -> None:
        for value in tree_leaves(values):
            if isinstance(value, torch.Tensor):
                self._count(value)

    def _count(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return  # a weight (or its transpose) held for the backward's GEMM: held by the model anyway
        key, size = _storage(tensor)
        if size and key not in self._params:
            self.storages[key] = size


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(an identity of the memory ``tensor`` lives in, its bytes): the storage where it has one, else (tensor
    subclasses such as FP8 or sharded tensors) the tensor itself at its element size."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), int(storage.nbytes())
    except Exception:  # noqa: BLE001 - a subclass without one storage
        return id(local), int(local.numel() * local.element_size())
