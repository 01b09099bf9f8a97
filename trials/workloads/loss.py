"""The trial's loss, declared once: the fp32 cross-entropy of a model's logits against the next tokens.

The training step minimises it, the per-layer FP8 read backs it, and the memory plan runs it under fake tensors
to count what it keeps for backward (its fp32 log-softmax, the targets), as the trial's own step does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (b, t, vocab), in fp32 whatever their dtype, against ``targets`` (b, t):
    each row shifted, so a target is its input's next token."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
