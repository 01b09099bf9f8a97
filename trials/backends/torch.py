"""The pure-PyTorch twin (nn.Linear, SDPA), FP32 or BF16, eager or ``torch.compile``'d (``compile: true``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..model import build_model
from . import Built


def compiled(model: nn.Module, spec: Any) -> Any:
    """``torch.compile(model)`` for ``compile: true`` cells, else None (the step calls the model).

    Compiling happens on the first call, so its cost lands in the trial's first training step
    (``first_step_s``) and never in a timed one; Inductor's cache is the launcher's persistent one.
    """
    return torch.compile(model) if spec.compile else None


def build(spec: Any, precision: str, device: str) -> Built:
    model = build_model(spec, "torch", precision, device)
    return Built(model, forward=compiled(model, spec))
