"""Teacher-forced FP8 numerics: does the FP8 model predict what its BF16 partner predicts, at every position?

Greedy generation compared token by token (``gen_match_rate``) is ruined by one early divergence: after it,
the two models read different tokens. Here both read the same held sequence (seeded apart from the training
data), and at every position we compare their next-token distributions:

    tf_top1_agreement  share of positions where argmax FP8 == argmax BF16
    tf_kl_mean         mean over positions of KL(FP8 || BF16) = sum_v p8(v) (log p8(v) - log p16(v)), nats

The held sequence is one row of HELD_LEN positions. The BF16 partner is the cell's ``bf16_partner`` stack (torchao: torch), built from the same seeded init and
trained on the same batches for the same steps, eager. The FP8 side is read right after its training, before
the benchmark trains it further; its stack must keep no scaling state that a forward pass would change
(``Stack.fp8_state``: TE's delayed scaling does), so later timing and losses are those of a trial without it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .data import ArithmeticSequences

log = logging.getLogger(__name__)

HELD_ROWS = 1  # one sequence, every position of its first HELD_LEN (fp32 log-probs: 131 MB at a 128k vocabulary)
HELD_LEN = 256
HELD_SEED_OFFSET = 3  # the held sequence's generator: seed + 3 (training uses seed, generation seed + 1)


def held_batch(vocab: int, seq_len: int, device: str, seed: int) -> torch.Tensor:
    """(HELD_ROWS, min(seq_len, HELD_LEN)) token ids no training step has seen."""
    return ArithmeticSequences(vocab, min(seq_len, HELD_LEN), device, seed + HELD_SEED_OFFSET).batch(HELD_ROWS)[0]


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """(rows, t) ids -> (rows, t, vocab) fp32 next-token log-probabilities on the host (they wait there while the
    cell is timed, out of its device memory), the model in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    try:
        return model(ids).float().log_softmax(-1).cpu()
    finally:
        model.train(was_training)


def compare(fp8: torch.Tensor, bf16: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(FP8 || BF16) of two (rows, t, vocab) log-probability tensors."""
    agreement = (fp8.argmax(-1) == bf16.argmax(-1)).float().mean()
    kl = (fp8.exp() * (fp8 - bf16)).sum(-1).clamp_min(0).mean()  # rounding can make a zero KL slightly negative
    return {"tf_top1_agreement": float(agreement), "tf_kl_mean": float(kl)}
