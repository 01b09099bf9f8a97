"""Plain PyTorch, FP32 or BF16, eager or ``torch.compile``'d (``compile: true``): the spec's model as its source
builds it (``trials/models``: MiniGPT's twin with nn.Linear and SDPA, a transformers model, your own module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import models
from . import Built


def compiled(model: nn.Module, spec: Any) -> Any:
    """``torch.compile(model)`` for ``compile: true`` cells, else None (the step calls the model).

    Compiling happens on the first call, so its cost lands in the trial's first training step
    (``first_step_s``) and never in a timed one; Inductor's cache is the launcher's persistent one.
    """
    return torch.compile(model) if spec.compile else None


def build(spec: Any, precision: str, device: str) -> Built:
    made = models.build(spec, precision, device)
    return Built(made.model, forward=compiled(made.model, spec), units=made.units)
