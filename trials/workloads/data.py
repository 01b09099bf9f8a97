"""Deterministic synthetic data: arithmetic sequences token_t = (phase + stride * t) mod task_vocab.

The task uses the first ``task_vocab = min(vocab, TASK_VOCAB)`` token ids, so it stays learnable in
a short run however large the vocabulary is, while the embedding, the LM head and the loss still run
over the full vocabulary: a 128k-way softmax costs the same whichever ids the targets are, so the
timing is that of the user's vocabulary. (The tutorial's vocabulary, 96, is below TASK_VOCAB: its
data is unchanged.) Made on the trial's device from a seeded generator, always outside the timed
regions. A model that has learned the task continues any prompt with its constant stride, which is
what the generation check measures.
"""

from __future__ import annotations

import torch

MAX_STRIDE = 6  # strides are drawn from 1..MAX_STRIDE
TASK_VOCAB = 128  # token ids the sequences use, at most


def task_vocab(vocab: int) -> int:
    return min(vocab, TASK_VOCAB)


class ArithmeticSequences:
    """Seeded batches of (inputs, next-token targets), each of shape (batch, seq_len)."""

    def __init__(self, vocab: int, seq_len: int, device: str | torch.device, seed: int):
        self.vocab = task_vocab(vocab)
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._steps = torch.arange(seq_len + 1, device=self.device).unsqueeze(0)

    def sequences(self, batch: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens of shape (batch, length), stride per row)."""
        length = self.seq_len + 1 if length is None else length
        phase = torch.randint(0, self.vocab, (batch, 1), generator=self.generator, device=self.device)
        stride = torch.randint(1, MAX_STRIDE + 1, (batch, 1), generator=self.generator, device=self.device)
        return (phase + stride * self._steps[:, :length]) % self.vocab, stride.squeeze(1)

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq, _ = self.sequences(batch)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
