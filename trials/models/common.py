"""What the model sources share: the built model a stack converts, the adapter to a logits tensor, and a look at
which of a model's Linears it modifies in place (a fact of any module, asked by the stacks that cannot take it)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.conv import _ConvNd

log = logging.getLogger(__name__)


@dataclass
class Built:
    """A source's seeded model for one cell: ``model`` maps ids (b, t) -> logits (b, t, vocab) (a tensor);
    ``logits_layer`` is the qualified name of the Linear that makes the logits (stacks keep it in high
    precision); ``info``: record fields (model_class, model_config, n_params)."""

    model: nn.Module
    vocab: int
    logits_layer: str | None
    info: dict[str, Any] = field(default_factory=dict)
    units: tuple[str, ...] = ()  # qualified names of its units (decoder layers), its source's rule; () where none


def dtype_of(precision: str) -> torch.dtype:
    """Weights in fp32 for fp32 cells, in bf16 otherwise (FP8 stacks cast from the bf16 weights)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def logits_of(out: Any) -> torch.Tensor:
    """A model's output -> its logits tensor: the tensor itself, the first item of a tuple (nanoGPT's
    ``(logits, loss)``), or ``.logits`` (transformers' output objects)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits


class Logits(nn.Module):
    """ids (b, t) -> logits (b, t, vocab) tensor, for a model that returns ``(logits, ...)`` or an object with
    ``.logits`` (or takes keyword arguments the harness gives: ``use_cache=False`` for transformers)."""

    backend = "torch"

    def __init__(self, model: nn.Module, **call_kwargs: Any):
        super().__init__()
        self.model = model
        self.call_kwargs = call_kwargs

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(idx, **self.call_kwargs))


def inner(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module a source built, its qualified name in ``model``): through the :class:`Logits` adapter."""
    return (model.model, "model") if isinstance(model, Logits) else (model, "")


@torch.no_grad()
def output_vocab(model: nn.Module, device: str) -> int:
    """The vocabulary a built model's logits span, read off one tiny forward: for a factory's model that could not
    say it before it existed (the record's ``vocab`` is then unset)."""
    return int(model(torch.zeros(1, 2, dtype=torch.long, device=device)).shape[-1])


def next_logits(model: nn.Module, idx: torch.Tensor, pos: int) -> torch.Tensor:
    """Logits (b, vocab) at position ``pos`` of ids (b, t): the model's own ``next_logits`` where it has one
    (MiniGPT runs its LM head at that position only), else its full logits' row."""
    own = getattr(model, "next_logits", None)
    return own(idx, pos) if own is not None else model(idx)[:, pos]


def param_count(model: nn.Module) -> int:
    """Parameters, each counted once (tied embeddings are one tensor)."""
    return sum(p.numel() for p in model.parameters())


def to_json(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True, default=str)


def largest_module_list(model: nn.Module, prefix: str = "") -> tuple[str, ...]:
    """Qualified names of the children of ``model``'s largest ``nn.ModuleList`` (by parameters, then by length):
    a stack of layers; () where it has none."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return ()
    name, best = max(lists, key=lambda nm: (sum(p.numel() for p in nm[1].parameters()), len(nm[1])))
    return tuple(_join(prefix, name, child) for child, _ in best.named_children())


def experts(model: nn.Module) -> list[str]:
    """Qualified names of the modules holding a 3-D weight (one matrix per expert: MoE experts, whose forward runs
    grouped GEMMs), found by structure, not by name; convolutions (an nn.Conv1d's weight is 3-D too: Mamba's,
    Jamba's, LFM2's) are not experts."""
    return [fqn for fqn, m in model.named_modules()
            if not isinstance(m, _ConvNd) and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


# Why a Linear its parent reads by weight stays in high precision: converting it would run nothing in FP8
WEIGHT_READ_BY_PARENT = ("its parent, nn.MultiheadAttention, reads its weight and bias without calling it "
                         "(F.multi_head_attention_forward): a converted module's FP8 forward would never run")


def read_by_parent(model: Any) -> list[str]:
    """The Linears (qualified names) whose parent uses their parameters without calling them: every
    ``nn.MultiheadAttention``'s ``out_proj``. A stack that swaps them (TE's te.Linear, torchao's Float8Linear)
    would list them as converted while their GEMM runs in BF16 inside the parent."""
    return [f"{name}.out_proj" if name else "out_proj" for name, m in model.named_modules()
            if isinstance(m, torch.nn.MultiheadAttention) and isinstance(getattr(m, "out_proj", None),
                                                                        torch.nn.Linear)]


def written_in_place(model: Any, device: str) -> list[str]:
    """The Linears (qualified names) whose output the model's own code modifies in place (e.g. Falcon's
    ``mlp_output += attention_output``), seen on one 2-token forward of ``model`` (ids -> logits; the output's
    version counter moves after the Linear returned it). An FP8 stack's matmul output may be a view that
    autograd forbids modifying so; these stay in high precision. The RNG is left as it was."""
    if torch.device(device).type == "meta":  # nothing runs there (the memory plan's probe, the dry run)
        return []
    seen: dict[str, tuple[Any, int]] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, _inputs: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                seen.setdefault(name, (out, out._version))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception as exc:  # noqa: BLE001 - a look, not the trial: the step itself says what fails
        log.info("no in-place check of the model's Linears (%s: %s)", type(exc).__name__, exc)
        return []
    finally:
        for handle in handles:
            handle.remove()
    return [name for name, (out, version) in seen.items() if out._version != version]
