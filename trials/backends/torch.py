"""Plain PyTorch, FP32 or BF16, eager or ``torch.compile``'d (``compile: true``): the spec's model as its source
builds it (``trials/models``: MiniGPT's twin with nn.Linear and SDPA, a transformers model, your own module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import models
from . import Built


def compiled(model: nn.Module, spec: Any, units: tuple[str, ...]) -> Any:
    """``torch.compile(model)`` for ``compile: true`` cells of a model without units, else None (the step calls
    the model). A model with units (decoder layers) is compiled unit by unit by the train step instead, after
    checkpointing wraps them (torchtitan's ``apply_compile``): every layer runs the same code, so Inductor
    compiles one layer once, where a whole 32-layer model took minutes to compile.

    Compiling happens on the first call, so its cost lands in the trial's first training step
    (``first_step_s``) and never in a timed one; Inductor's cache is the launcher's persistent one.
    """
    return torch.compile(model) if spec.compile and not units else None


def build(spec: Any, precision: str, device: str) -> Built:
    made = models.build(spec, precision, device)
    return Built(made.model, forward=compiled(made.model, spec, made.units), units=made.units)
