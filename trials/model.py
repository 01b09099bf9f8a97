"""MiniGPT: a small GPT-style causal LM, in Transformer Engine and as a pure-PyTorch twin.

Both variants are the same network, parameter for parameter:

    token embedding + learned position embedding
    n_layers x pre-LayerNorm block:  x += proj(causal_attn(qkv(LN1(x))));  x += fc2(gelu_tanh(fc1(LN2(x))))
    final LayerNorm, LM head without bias

The TE variant uses one fused ``te.TransformerLayer`` per block with ``attn_input_format="bshd"``
(our tensors are (batch, seq, hidden); TE's default layout is (seq, batch, hidden), which would run
the causal mask over the batch axis). The twin computes attention with
``F.scaled_dot_product_attention(is_causal=True)`` and TE's GELU (the tanh approximation), and
:func:`twin_state_from_te` maps a TE state dict onto it, which is how the GPU tests prove they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from .spec import TrialSpec

LN_EPS = 1e-5
INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    seq_len: int

    @classmethod
    def from_spec(cls, spec: TrialSpec) -> "ModelConfig":
        return cls(spec.vocab, spec.d_model, spec.n_layers, int(spec.n_heads), int(spec.ffn), spec.seq_len)


def param_count(cfg: ModelConfig) -> int:
    """Total parameters: embeddings + blocks (QKV, proj, FC1, FC2 with biases, two LayerNorms) + LN_f + head."""
    d, f = cfg.d_model, cfg.ffn
    per_block = 4 * d * d + 2 * d * f + 9 * d + f
    return cfg.vocab * d + cfg.seq_len * d + cfg.n_layers * per_block + 2 * d + cfg.vocab * d


def matmul_param_count(cfg: ModelConfig) -> int:
    """Weights that take part in matrix products per token (blocks + LM head; not the lookups)."""
    d, f = cfg.d_model, cfg.ffn
    return cfg.n_layers * (4 * d * d + 2 * d * f) + cfg.vocab * d


class TwinBlock(nn.Module):
    """Pure-PyTorch mirror of ``te.TransformerLayer`` (pre-LN, causal self-attention, GELU MLP)."""

    def __init__(self, cfg: ModelConfig, **factory: Any):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d, eps=LN_EPS, **factory)
        self.qkv = nn.Linear(d, 3 * d, **factory)
        self.proj = nn.Linear(d, d, **factory)
        self.ln2 = nn.LayerNorm(d, eps=LN_EPS, **factory)
        self.fc1 = nn.Linear(d, cfg.ffn, **factory)
        self.fc2 = nn.Linear(cfg.ffn, d, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _te_block(te: Any, cfg: ModelConfig, index: int, dtype: torch.dtype) -> nn.Module:
    return te.TransformerLayer(
        hidden_size=cfg.d_model,
        ffn_hidden_size=cfg.ffn,
        num_attention_heads=cfg.n_heads,
        layernorm_epsilon=LN_EPS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        attn_input_format="bshd",
        layer_number=index + 1,
        params_dtype=dtype,
        device="cuda",
    )


class MiniGPT(nn.Module):
    """The causal LM; ``te`` is the imported ``transformer_engine.pytorch`` module or None for the twin."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, te: Any = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.backend = "te" if te is not None else "torch"
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model, **factory)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model, **factory)
        if te is not None:
            self.blocks = nn.ModuleList(_te_block(te, cfg, i, dtype) for i in range(cfg.n_layers))
        else:
            self.blocks = nn.ModuleList(TwinBlock(cfg, **factory) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=LN_EPS, **factory)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False, **factory)
        self.register_buffer("positions", torch.arange(cfg.seq_len, device=device), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init, applied by shape so both variants start from the same distribution."""
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual_out = name.endswith(("proj.weight", "fc2.weight", "fc2_weight"))
                p.normal_(0.0, resid_std if residual_out else INIT_STD)
            elif name.endswith("bias"):
                p.zero_()
            else:  # LayerNorm gains
                p.fill_(1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(self.positions[:t])
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_model(spec: TrialSpec, backend: str, precision: str, device: str, te: Any = None) -> MiniGPT:
    """Weights in fp32 for fp32 cells, in bf16 otherwise (FP8 casts from the bf16 weights)."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return MiniGPT(ModelConfig.from_spec(spec), dtype, device, te if backend == "te" else None)


_TE_TO_TWIN = {
    "self_attention.layernorm_qkv.layer_norm_weight": "ln1.weight",
    "self_attention.layernorm_qkv.layer_norm_bias": "ln1.bias",
    "self_attention.proj.weight": "proj.weight",
    "self_attention.proj.bias": "proj.bias",
    "layernorm_mlp.layer_norm_weight": "ln2.weight",
    "layernorm_mlp.layer_norm_bias": "ln2.bias",
    "layernorm_mlp.fc1_weight": "fc1.weight",
    "layernorm_mlp.fc1_bias": "fc1.bias",
    "layernorm_mlp.fc2_weight": "fc2.weight",
    "layernorm_mlp.fc2_bias": "fc2.bias",
}


def twin_state_from_te(te_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a TE MiniGPT state dict onto the twin's names (TE keeps Q, K and V as separate tensors)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in te_state.items():
        if name.endswith("_extra_state"):
            continue
        if not name.startswith("blocks."):
            out[name] = value
            continue
        _, idx, rest = name.split(".", 2)
        if rest in _TE_TO_TWIN:
            out[f"blocks.{idx}.{_TE_TO_TWIN[rest]}"] = value
            continue
        prefix = "self_attention.layernorm_qkv."
        part = rest[len(prefix):] if rest.startswith(prefix) else ""
        which, _, kind = part.partition("_")  # query_weight -> (query, weight)
        if which not in ("query", "key", "value") or kind not in ("weight", "bias"):
            raise KeyError(f"no twin parameter for TE parameter {name!r}")
        qkv.setdefault(f"blocks.{idx}.qkv.{kind}", {})[which] = value
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["query"], parts["key"], parts["value"]], dim=0)
    return out
