"""Greedy decoding check: does the trained model continue a fresh prompt's constant stride?

Decoding feeds a fixed (batch, window) of tokens, window = prompt + generated length rounded up to
16, and reads the logits at the last filled position (``next_logits``: MiniGPT runs its LM head there
only, since at a 128k vocabulary and seq 8192 full logits for every position would be tens of GB;
other models return the window's logits, at most 8 x 48 rows here). The model is causal, so the
unfilled tail cannot change them, and FP8 GEMMs keep their token count divisible by 16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends import te_compat
from .data import ArithmeticSequences
from ..models.common import next_logits

N_PROMPTS = 8
WINDOW_MULTIPLE = 16


@dataclass
class GenerationResult:
    tokens: list[int]  # first prompt + its continuation
    stride_accuracy: float  # share of generated steps that keep the prompt's stride, all prompts


@torch.no_grad()
def generation_check(model: Any, prompt_len: int, gen_len: int, seed: int, vocab: int, seq_len: int,
                     te: Any = None, recipe: Any = None) -> GenerationResult:
    """``model``: MiniGPT or any model mapping ids (b, t) -> logits (b, t, vocab) (trials/models)."""
    device = next(model.parameters()).device
    data = ArithmeticSequences(vocab, seq_len, device, seed)
    prompts, stride = data.sequences(N_PROMPTS, prompt_len)
    end = min(seq_len, prompt_len + gen_len)
    width = min(seq_len, -(-end // WINDOW_MULTIPLE) * WINDOW_MULTIPLE)
    window = torch.zeros(N_PROMPTS, width, dtype=torch.long, device=device)  # (prompts, width)
    window[:, :prompt_len] = prompts
    was_training = model.training
    model.eval()
    try:
        for pos in range(prompt_len, end):
            with te_compat.autocast(te if getattr(model, "backend", None) == "te" else None, recipe):
                window[:, pos] = next_logits(model, window, pos - 1).argmax(-1)  # (prompts, vocab) -> (prompts,)
    finally:
        model.train(was_training)
    accuracy = stride_accuracy(window[:, prompt_len - 1:end], stride, data.vocab)
    return GenerationResult(tokens=window[0, :end].tolist(), stride_accuracy=accuracy)


def stride_accuracy(seq: torch.Tensor, stride: torch.Tensor, vocab: int) -> float:
    """Share of steps in ``seq`` (rows, n) that keep each row's stride: seq[:, i+1] - seq[:, i] = stride (mod vocab)."""
    hits = ((seq[:, 1:] - seq[:, :-1]) % vocab) == stride.unsqueeze(1)
    return float(hits.float().mean().item()) if hits.numel() else float("nan")
