"""TE's FP8 weight casts once per optimizer step under gradient accumulation (``grad_accum`` > 1).

TE's modules take ``is_first_microbatch``: True casts each weight to FP8 and keeps the cast, False reuses it
(the weights do not change between a step's micro-batches), as Megatron passes it. The models TE runs call
those modules from their own forward, which never passes it (MiniGPT's blocks, transformers' decoder layers a
conversion swapped, a factory's code), so a forward pre-hook on each outermost TE module that takes it adds the
keyword while a step's micro-batch runs; outside one (generation, the FP8 reads) nothing is added and TE casts
as it does without accumulation. A CUDA-graphed step gets it from TE's own graphing instead
(trials/backends/te_compat.py ``make_graphed_callables``, ``cache_quantized_params``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch.nn as nn

KEYWORD = "is_first_microbatch"


def takes_it(module: nn.Module) -> bool:
    """Whether the module's class forward takes ``is_first_microbatch`` (the class's: a checkpointed unit's
    instance ``forward`` is a wrapper passing keywords on)."""
    try:
        return KEYWORD in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


class FirstMicroBatch:
    """``with first.micro_batch(i == 0): model(x)``: the outermost modules of ``model`` that take
    ``is_first_microbatch`` get it (a te.TransformerLayer hands it on to its own modules)."""

    def __init__(self, model: nn.Module):
        self.first: bool | None = None
        named = [(name, m) for name, m in model.named_modules() if takes_it(m)]
        names = {name for name, _ in named}
        self.modules = [m for name, m in named
                        if not any(name.startswith(f"{other}.") for other in names if other and other != name)]
        self.handles = [m.register_forward_pre_hook(self._add, with_kwargs=True) for m in self.modules]

    def _add(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.first is None:
            return None
        return args, {**kwargs, KEYWORD: self.first}

    @contextlib.contextmanager
    def micro_batch(self, first: bool) -> Iterator[None]:
        self.first = first
        try:
            yield
        finally:
            self.first = None
