"""MiniGPT: a causal LM in Transformer Engine and as a pure-PyTorch twin, in two architectures.

``arch="gpt"`` is the tutorial's network:

    token embedding + learned position embedding
    n_layers x pre-LayerNorm block:  x += proj(causal_attn(qkv(LN1(x))));  x += fc2(gelu_tanh(fc1(LN2(x))))
    final LayerNorm, LM head without bias

``arch="llama"`` is the block most models are trained with today: RMSNorm instead of LayerNorm, no
biases, no position embedding but rotary embeddings (RoPE) on queries and keys, grouped-query
attention (``n_kv_heads`` key/value heads shared by ``n_heads`` query heads) and a SwiGLU MLP,
``fc2(silu(a) * b)`` with ``[a, b] = fc1(x)`` (fc1 is 2 x ffn wide; TE gates with the first half).

The TE variant builds each block as one fused ``te.TransformerLayer`` (``te_layer="transformer_layer"``)
or from TE's modules (``te_layer="modules"``: ``te.LayerNormLinear`` for norm+QKV,
``te.DotProductAttention``, ``te.Linear`` for the projection, ``te.LayerNormMLP``), the same math.
Tensors are (batch, seq, hidden) and attention runs with ``bshd`` (TE's default layout is
(seq, batch, hidden), which would run the causal mask over the batch axis). The twin computes
attention with ``F.scaled_dot_product_attention(is_causal=True)``; :func:`twin_state_from_te` maps
either TE layout onto it, which is how the GPU tests prove they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends import te_compat
from ..spec import TrialSpec

LN_EPS = 1e-5
INIT_STD = 0.02
ROPE_BASE = 500_000.0  # Llama 3's rotary base


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    seq_len: int
    arch: str = "gpt"
    n_kv_heads: int | None = None  # default n_heads (no GQA)
    te_layer: str = "transformer_layer"

    @classmethod
    def from_spec(cls, spec: TrialSpec) -> "ModelConfig":
        return cls(spec.vocab, spec.d_model, spec.n_layers, int(spec.n_heads), int(spec.ffn), spec.seq_len,
                   spec.arch, spec.kv_heads, spec.te_layer)

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): key/value heads x head dim."""
        return self.kv_heads * self.head_dim

    @property
    def fc1_out(self) -> int:
        return 2 * self.ffn if self.llama else self.ffn  # SwiGLU's fc1 makes gate and value at once


def _block_matmul_params(cfg: ModelConfig) -> int:
    d = cfg.d_model
    return 2 * d * d + 2 * d * cfg.kv_dim + d * cfg.fc1_out + cfg.ffn * d  # Q, proj, K and V, fc1, fc2


def param_count(cfg: ModelConfig) -> int:
    """All parameters: embeddings, blocks (GEMM weights, biases and norm gains for gpt), final norm, head."""
    d = cfg.d_model
    if cfg.llama:
        norms, biases, positions = 2 * d, 0, 0
    else:
        norms, biases, positions = 4 * d, (d + 2 * cfg.kv_dim) + d + cfg.fc1_out + d, cfg.seq_len * d
    per_block = _block_matmul_params(cfg) + biases + norms
    return cfg.vocab * d + positions + cfg.n_layers * per_block + norms // 2 + cfg.vocab * d


def matmul_param_count(cfg: ModelConfig) -> int:
    """Weights that take part in matrix products per token (blocks + LM head; not the lookups)."""
    return cfg.n_layers * _block_matmul_params(cfg) + cfg.vocab * cfg.d_model


def rope_freqs(seq_len: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    """Rotary angles, (seq_len, 1, 1, head_dim) fp32, in TE's non-interleaved layout (GPT-NeoX/Llama)."""
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).view(seq_len, 1, 1, head_dim)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: (b, t, heads, head_dim); the rotation TE's fused kernel applies, in fp32, rounded once to x's dtype."""
    f = freqs[: x.shape[1]].transpose(0, 1)  # (1, t, 1, head_dim)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * f.cos() + torch.cat((-x2, x1), dim=-1) * f.sin()).to(x.dtype)


def split_heads(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, t, d + 2 * kv_dim) -> q (b, t, n_heads, hd), k and v (b, t, kv_heads, hd)."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split([cfg.d_model, cfg.kv_dim, cfg.kv_dim], dim=-1)
    return (q.view(b, t, cfg.n_heads, cfg.head_dim), k.view(b, t, cfg.kv_heads, cfg.head_dim),
            v.view(b, t, cfg.kv_heads, cfg.head_dim))


class RMSNorm(nn.Module):
    """x / rms(x) * gain, computed in fp32 like TE's kernel, returned in x's dtype."""

    def __init__(self, d: int, eps: float, **factory: Any):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _norm(cfg: ModelConfig, **factory: Any) -> nn.Module:
    return RMSNorm(cfg.d_model, LN_EPS, **factory) if cfg.llama else nn.LayerNorm(cfg.d_model, eps=LN_EPS, **factory)


class TwinBlock(nn.Module):
    """Pure-PyTorch mirror of the TE block (pre-norm, causal self-attention, GELU or SwiGLU MLP)."""

    def __init__(self, cfg: ModelConfig, **factory: Any):
        super().__init__()
        d, bias = cfg.d_model, not cfg.llama
        self.cfg = cfg
        self.ln1 = _norm(cfg, **factory)
        self.qkv = nn.Linear(d, d + 2 * cfg.kv_dim, bias=bias, **factory)
        self.proj = nn.Linear(d, d, bias=bias, **factory)
        self.ln2 = _norm(cfg, **factory)
        self.fc1 = nn.Linear(d, cfg.fc1_out, bias=bias, **factory)
        self.fc2 = nn.Linear(cfg.ffn, d, bias=bias, **factory)

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``kv``: this layer's (k, v) cache, each (b, max_len, kv_heads, hd), written at ``positions`` (t,)."""
        cfg = self.cfg
        b, t, d = x.shape
        q, k, v = split_heads(self.qkv(self.ln1(x)), cfg)
        if rotary_pos_emb is not None:
            q, k = apply_rope(q, rotary_pos_emb), apply_rope(k, rotary_pos_emb)
        gqa = {"enable_gqa": True} if cfg.kv_dim != d else {}  # each K/V head serves n_heads/n_kv_heads queries
        if kv is None:
            mask = {"is_causal": True}
        else:  # append to the cache and attend to every cached position up to each query's own
            kv[0].index_copy_(1, positions, k)
            kv[1].index_copy_(1, positions, v)
            k, v = kv
            mask = {"attn_mask": torch.arange(k.shape[1], device=x.device)[None, :] <= positions[:, None]}  # (t, max_len)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **mask,
                                           **gqa)  # (b, h, t, hd)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.fc1(self.ln2(x))  # (b, t, fc1_out)
        if cfg.llama:
            gate, value = h.chunk(2, dim=-1)
            h = (F.silu(gate.float()) * value.float()).to(h.dtype)  # one rounding, as TE's SwiGLU kernel
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.fc2(h)


def _te_common(cfg: ModelConfig) -> dict[str, Any]:
    norm = {"normalization": "RMSNorm"} if cfg.llama else {}
    return {"bias": not cfg.llama, "device": "cuda", **norm}


def _te_block(te: Any, cfg: ModelConfig, index: int, dtype: torch.dtype, fused_qkv: bool = False) -> nn.Module:
    if cfg.te_layer == "modules":
        return TEModulesBlock(te, cfg, index, dtype)
    arch = {"activation": "swiglu", "num_gqa_groups": cfg.kv_heads} if cfg.llama else {}
    if fused_qkv:  # one [Q; K; V] weight (not per-head interleaved): the layout of fused_qkv_state
        arch.update(fuse_qkv_params=True, qkv_weight_interleaved=False)
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
        **arch,
        **_te_common(cfg),
    )


class TEModulesBlock(nn.Module):
    """The block from TE's modules, as a user composes them in their own architecture."""

    def __init__(self, te: Any, cfg: ModelConfig, index: int, dtype: torch.dtype):
        super().__init__()
        d, common = cfg.d_model, _te_common(cfg)
        self.cfg = cfg
        self.rope_fn = _te_rope(te) if cfg.llama else None
        self.qkv = te.LayerNormLinear(d, d + 2 * cfg.kv_dim, eps=LN_EPS, params_dtype=dtype, **common)
        self.attn = te.DotProductAttention(cfg.n_heads, cfg.head_dim, num_gqa_groups=cfg.kv_heads,
                                           attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal",
                                           layer_number=index + 1)
        self.proj = te.Linear(d, d, params_dtype=dtype, bias=common["bias"], device="cuda")
        self.mlp = te.LayerNormMLP(d, cfg.ffn, eps=LN_EPS, activation="swiglu" if cfg.llama else "gelu",
                                   params_dtype=dtype, **common)

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = split_heads(self.qkv(x), self.cfg)  # norm + QKV in one TE module
        if rotary_pos_emb is not None:
            q, k = (self.rope_fn(z, rotary_pos_emb, tensor_format="bshd", fused=True) for z in (q, k))
        x = x + self.proj(self.attn(q, k, v))  # attention output (b, t, h * hd)
        return x + self.mlp(x)


def _te_rope(te: Any) -> Any:
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb


class MiniGPT(nn.Module):
    """The causal LM; ``te`` is the imported ``transformer_engine.pytorch`` module or None for the twin."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, te: Any = None,
                 fused_qkv: bool = False):
        """``fused_qkv``: TE layers keep Q, K and V in one parameter (FP8-only weights cannot be split)."""
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.backend = "te" if te is not None else "torch"
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model, **factory)
        if not cfg.llama:
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model, **factory)
        if te is not None:
            self.blocks = nn.ModuleList(_te_block(te, cfg, i, dtype, fused_qkv) for i in range(cfg.n_layers))
        else:
            self.blocks = nn.ModuleList(TwinBlock(cfg, **factory) for _ in range(cfg.n_layers))
        self.ln_f = _norm(cfg, **factory)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False, **factory)
        self.register_buffer("positions", torch.arange(cfg.seq_len, device=device), persistent=False)
        rope = rope_freqs(cfg.seq_len, cfg.head_dim, device) if cfg.llama else None
        self.register_buffer("rope", rope, persistent=False)
        self.reset_parameters(te)

    @torch.no_grad()
    def reset_parameters(self, te: Any = None) -> None:
        """GPT-2 style init, applied by shape so both variants start from the same distribution.

        TE's FP8-only parameters (``quantized_model_init``) keep TE's init: a load replaces them.
        """
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if te_compat.is_quantized(te, p):
                continue
            if p.dim() >= 2:
                residual_out = name.endswith(("proj.weight", "fc2.weight", "fc2_weight"))
                p.normal_(0.0, resid_std if residual_out else INIT_STD)
            elif name.endswith("bias"):
                p.zero_()
            else:  # norm gains
                p.fill_(1.0)

    def features(self, idx: torch.Tensor, positions: torch.Tensor | None = None, cache: Any = None) -> torch.Tensor:
        """(b, t) token ids -> (b, t, d_model) final-norm hidden states (what the LM head reads).

        ``positions`` (t,): where the tokens sit (default 0..t-1); ``cache``: a KV cache from
        ``trials.workloads.decode`` that each block reads and extends (its ``block_kwargs`` say how).
        """
        t = idx.shape[1]
        positions = self.positions[:t] if positions is None else positions
        h = self.tok(idx)  # (b, t, d_model)
        if not self.cfg.llama:
            h = h + self.pos(positions)
        for i, block in enumerate(self.blocks):
            kwargs = {"rotary_pos_emb": self.rope[:t]} if self.cfg.llama else {}
            if cache is not None:
                kwargs.update(cache.block_kwargs(i))
            h = block(h, **kwargs)
        return self.ln_f(h)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(idx))  # (b, t, vocab)

    def next_logits(self, idx: torch.Tensor, pos: int) -> torch.Tensor:
        """(b, t) ids -> (b, vocab) logits at position ``pos``: the LM head runs on that position only."""
        return self.head(self.features(idx)[:, pos])


def build_model(spec: TrialSpec, backend: str, precision: str, device: str, te: Any = None) -> MiniGPT:
    """Weights in fp32 for fp32 cells, in bf16 otherwise (FP8 casts from the bf16 weights)."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return MiniGPT(ModelConfig.from_spec(spec), dtype, device, te if backend == "te" else None)


# TE parameter names (after ``blocks.<i>.``) -> twin names; fused layer first, then the modules block.
_TE_TO_TWIN = {
    "self_attention.layernorm_qkv.layer_norm_weight": "ln1.weight",
    "self_attention.layernorm_qkv.layer_norm_bias": "ln1.bias",
    "self_attention.layernorm_qkv.weight": "qkv.weight",  # as fused_qkv_state joins them
    "self_attention.layernorm_qkv.bias": "qkv.bias",
    "self_attention.proj.weight": "proj.weight",
    "self_attention.proj.bias": "proj.bias",
    "layernorm_mlp.layer_norm_weight": "ln2.weight",
    "layernorm_mlp.layer_norm_bias": "ln2.bias",
    "layernorm_mlp.fc1_weight": "fc1.weight",
    "layernorm_mlp.fc1_bias": "fc1.bias",
    "layernorm_mlp.fc2_weight": "fc2.weight",
    "layernorm_mlp.fc2_bias": "fc2.bias",
    "qkv.layer_norm_weight": "ln1.weight",
    "qkv.layer_norm_bias": "ln1.bias",
    "qkv.weight": "qkv.weight",
    "qkv.bias": "qkv.bias",
    "proj.weight": "proj.weight",
    "proj.bias": "proj.bias",
    "mlp.layer_norm_weight": "ln2.weight",
    "mlp.layer_norm_bias": "ln2.bias",
    "mlp.fc1_weight": "fc1.weight",
    "mlp.fc1_bias": "fc1.bias",
    "mlp.fc2_weight": "fc2.weight",
    "mlp.fc2_bias": "fc2.bias",
}


def twin_state_from_te(te_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a TE MiniGPT state dict onto the twin's names (Q, K and V joined first: ``fused_qkv_state``)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in fused_qkv_state(te_state).items():
        if name.endswith("_extra_state"):
            continue
        if not name.startswith("blocks."):
            out[name] = value
            continue
        _, idx, rest = name.split(".", 2)
        if rest not in _TE_TO_TWIN:
            raise KeyError(f"no twin parameter for TE parameter {name!r}")
        out[f"blocks.{idx}.{_TE_TO_TWIN[rest]}"] = value
    return out


def fused_qkv_state(te_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TE MiniGPT state dict with Q, K and V as separate parameters -> the fused_qkv model's names."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    prefix = "self_attention.layernorm_qkv."
    for name, value in te_state.items():
        head, sep, tail = name.partition(prefix)
        which, _, kind = tail.partition("_")  # query_weight -> (query, weight)
        if sep and which in ("query", "key", "value") and kind in ("weight", "bias"):
            parts.setdefault(f"{head}{prefix}{kind}", {})[which] = value
        else:
            out[name] = value
    for name, qkv in parts.items():
        out[name] = torch.cat([qkv["query"], qkv["key"], qkv["value"]], dim=0)
    return out
