"""A ``py:`` model for JuicyTalk: your own module, benchmarked on every stack that converts plain PyTorch.

    juicytalk trial --model py:examples.my_model:build --d-model 256 --n-layers 2 --vocab 512 --device cpu

JuicyTalk calls ``build(spec)`` with the trial's spec (its shape fields as given, None where not) under
``torch.device(<the trial's device>)`` with the trial's seed set, casts the module to the cell's precision
and trains it on its synthetic sequences; the module maps token ids (batch, seq) to logits (batch, seq,
vocab). Its ``nn.Linear`` layers are what torchao converts to FP8 (``lm_head``, which makes the logits,
stays BF16); the attention's projections stay BF16 too (``nn.MultiheadAttention`` multiplies by its weights itself,
never calling a Linear), so about 44% of a step's FLOPs run in FP8 at d_model 64 (``fp8_flop_share``).
A plain pre-norm transformer with ``nn.TransformerEncoderLayer`` blocks and a causal mask.
It trains on every stack but does not serve (``workload: infer`` is ``unsupported``): serving hands the model a
KV cache, which only a transformers causal LM takes (a factory returning one serves like an ``hf:`` model).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, ffn: int, max_len: int):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, ffn, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's init: small logits at the start, so a short run learns
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))  # (b, t, d_model)
        for block in self.blocks:
            h = block(h, is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(t, device=ids.device))
        return self.lm_head(self.norm(h))  # (b, t, vocab)


def build(spec) -> nn.Module:
    """The factory JuicyTalk calls: shape fields the spec leaves unset take this model's own defaults."""
    d_model = spec.d_model or 256
    return TinyLM(vocab=spec.vocab or 512, d_model=d_model, n_layers=spec.n_layers or 2,
                  n_heads=spec.n_heads or max(1, d_model // 64), ffn=spec.ffn or 4 * d_model, max_len=spec.seq_len)
