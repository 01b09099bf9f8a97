"""Transformer Engine on a model someone else wrote (``te_layer`` for ``hf:`` and ``py:`` models).

Two ways to put TE into an ``nn.Module``, each a pure :func:`plan` (which modules change and which stay,
with the reason; no TE needed, so CPU tests check it) and :func:`convert` (applies the plan with TE's
modules, in place, copying the seeded BF16 weights, so the TE model starts where the other stacks start):

    swap               every nn.Linear -> te.Linear, nn.LayerNorm -> te.LayerNorm and RMSNorm module ->
                       te.RMSNorm, for any module. An RMSNorm is recognised by what it is and computes, not
                       by its class name: torch.nn.RMSNorm, or a leaf module whose only parameter is a 1-D
                       ``weight`` with an ``eps``/``variance_epsilon`` and whose output on a probe row is
                       x / rms(x) * w (Llama, Mistral, Qwen2) or x / rms(x) * (1 + w) (Gemma: TE's
                       ``zero_centered_gamma``). A module with a dimension not a multiple of 16 (FP8 GEMMs
                       need it) stays BF16 and the walk goes on with its siblings (some accelerate versions
                       ``return`` there, leaving the rest unconverted). The layer that makes the logits stays
                       BF16, as on torchao; so does a Linear whose weight is tied to another module.
    transformer_layer  each decoder layer of a transformers llama, mistral or qwen2 model (RMSNorm, SwiGLU,
                       GQA, RoPE) -> one te.TransformerLayer with the same weights, as TE's te_llama example
                       does: q/k/v -> the query/key/value weights of its LayerNormLinear, input_layernorm ->
                       that module's norm weight, o -> proj, [gate; up] -> fc1 (TE's SwiGLU gates with the
                       first half), down -> fc2, post_attention_layernorm -> the LayerNormMLP's norm weight.
                       Rotary angles come from the model's own rotary embedding (its ``inv_freq``, so
                       ``rope_theta`` and static scalings such as Llama 3's apply as in transformers), in TE's
                       non-interleaved layout, which is transformers' rotate-half convention. Where HF has some
                       biases (qwen2: q/k/v) TE's layer takes biases everywhere: the ones HF lacks are zero and
                       frozen, so the math is HF's. Embeddings, the final norm and the LM head stay as they are.

The record fields are torchao's (``fp8_converted_modules``, ``fp8_converted_names``,
``fp8_skipped_modules``): the modules TE runs, and those kept in BF16. :func:`fp8_gemms` names the source model's
Linears whose GEMMs a plan has TE run in FP8, whose FLOPs, counted before the conversion, are the cell's
``fp8_flop_share`` (trials/backends/te.py). No Ray, no orchestrator here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import layer_refusal  # the stack table's: the spec asks it too, before any trial (and without torch)
from .torchao import FP8_DIM_MULTIPLE
from ..models.common import WEIGHT_READ_BY_PARENT, read_by_parent

log = logging.getLogger(__name__)

HEAD_DIM_MULTIPLE = 8  # TE's fused attention kernels need the head dimension in multiples of 8
STATIC_ROPE = ("default", "linear", "llama3")  # rope types whose angles are fixed at init (no per-call update)
# a Llama-family decoder layer's projections (transformers' names), which transformer_layer maps onto TE's layer
DECODER_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


class ConvertError(ValueError):
    """This conversion does not apply to this model (one line saying what it applies to)."""


LOGITS_KEPT = "makes the logits (stays BF16, as on torchao)"


@dataclass(frozen=True)
class Step:
    """One module of the plan: ``kind`` linear | layernorm | rmsnorm | decoder_layer; ``action`` convert | keep;
    ``reason``: why it is kept ('' when converted)."""

    name: str
    kind: str
    action: str
    reason: str = ""

    @property
    def converts(self) -> bool:
        return self.action == "convert"


def plan(model: nn.Module, te_layer: str = "swap", logits_layer: str | None = None) -> list[Step]:
    """What :func:`convert` would do to ``model`` (nothing is changed). ``logits_layer``: the qualified name of
    the module that makes the logits, when the model's source knows it (else it is found, see
    :func:`find_logits_layer`). Raises ConvertError when ``te_layer`` does not apply to this model."""
    if te_layer == "transformer_layer":
        return decoder_plan(model, logits_layer)
    if why := layer_refusal(te_layer, None):
        raise ConvertError(f"te_layer {why}")
    return swap_plan(model, logits_layer)


def convert(model: nn.Module, te: Any, te_layer: str = "swap", logits_layer: str | None = None,
            steps: list[Step] | None = None) -> list[Step]:
    """Apply :func:`plan` with ``te`` (``transformer_engine.pytorch``), in place; returns the plan it applied
    (``steps``: that plan, made already on this model)."""
    steps = plan(model, te_layer, logits_layer) if steps is None else steps
    if te_layer == "swap":
        for s in steps:
            if s.converts:
                _replace(model, s.name, _te_leaf(te, model.get_submodule(s.name), s.kind))
    else:
        _convert_decoders(model, te, steps)
    kept = [f"{s.name} ({s.reason})" for s in steps if not s.converts]
    log.info("te %s: %d modules converted, kept %s", te_layer, sum(s.converts for s in steps), kept)
    return steps


def record(steps: list[Step]) -> dict[str, Any]:
    """The record fields of a conversion (the ones torchao's conversion sets)."""
    done = [s.name for s in steps if s.converts]
    return {"fp8_converted_modules": len(done), "fp8_converted_names": json.dumps(done),
            "fp8_skipped_modules": json.dumps([s.name for s in steps if not s.converts])}


def fp8_gemms(steps: list[Step]) -> list[str]:
    """The qualified names of the source model's nn.Linears whose GEMMs TE runs in FP8 (under ``te.autocast``) once
    :func:`convert` applies ``steps``: the swapped Linears (the norms do no GEMM); for a decoder layer replaced by a
    te.TransformerLayer, its seven projections, each one GEMM of TE's layer (:func:`decoder_state`: q/k/v ->
    layernorm_qkv, o -> proj, gate and up -> fc1, down -> fc2). Its attention is no GEMM of these: TE runs it in
    BF16 (its FP8 attention is not asked for), and the FLOP count adds it by the formula. Kept modules stay BF16."""
    names = []
    for s in steps:
        if not s.converts:
            continue
        if s.kind == "linear":
            names.append(s.name)
        elif s.kind == "decoder_layer":
            names += [f"{s.name}.{owner}.{lin}" for owner, linears in DECODER_LINEARS.items() for lin in linears]
    return names


# ---------------------------------------------------------------------------------------------- shared


def find_logits_layer(model: nn.Module, vocab: int | None = None) -> str | None:
    """Qualified name of the module that makes the logits: a transformers model's output embeddings
    (``get_output_embeddings()``, found on whichever submodule has it), else the last nn.Linear with
    ``out_features == vocab`` (``vocab`` default: the first nn.Embedding's size)."""
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                out = get()
            except (AttributeError, NotImplementedError, TypeError):
                out = None
            if isinstance(out, nn.Module) and id(out) in names:
                return names[id(out)]
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    heads = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


@dataclass(frozen=True)
class RMSNormSpec:
    eps: float
    zero_centered: bool  # the gain is 1 + weight (TE's zero_centered_gamma), not weight


def rmsnorm_spec(module: nn.Module) -> RMSNormSpec | str | None:
    """An RMSNorm's settings; a string when the module looks like one but computes something else (why);
    None when it is no candidate at all. See the module docstring for what is recognised."""
    if isinstance(module, nn.RMSNorm):
        if module.weight is None:
            return "torch.nn.RMSNorm without a gain"
        eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
        return RMSNormSpec(float(eps), False)
    params = dict(module.named_parameters(recurse=False))
    if next(module.children(), None) is not None or list(params) != ["weight"] or params["weight"].dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, float):
        return None
    return _probe_rmsnorm(module, params["weight"], eps)


@torch.no_grad()
def _probe_rmsnorm(module: nn.Module, weight: torch.Tensor, eps: float) -> RMSNormSpec | str | None:
    """Run the module on two probe rows (mean far from 0, so a LayerNorm would differ) and see which RMSNorm it is."""
    if weight.is_meta:
        return "on the meta device: cannot tell what it computes"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, weight.numel(), generator=g) * 2 + 1).to(weight.device, weight.dtype)
    try:
        y = module(x)
    except Exception:  # noqa: BLE001 - a module that cannot take a (rows, hidden) tensor is no norm
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2  # bf16: two roundings in transformers' RMSNorm
    for zero_centered in (False, True):
        if torch.allclose(y.float(), normed * (weight.float() + float(zero_centered)), rtol=tol, atol=tol):
            return RMSNormSpec(eps, zero_centered)
    return "normalises by neither x/rms(x)*w nor x/rms(x)*(1+w)"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _not_multiple(**dims: int) -> str:
    bad = [f"{k} {v}" for k, v in dims.items() if v % FP8_DIM_MULTIPLE]
    return f"{', '.join(bad)} not a multiple of {FP8_DIM_MULTIPLE} (FP8 GEMMs need it)" if bad else ""


# ---------------------------------------------------------------------------------------------- swap


def swap_plan(model: nn.Module, logits_layer: str | None = None) -> list[Step]:
    """Every Linear, LayerNorm and RMSNorm of ``model``, converted or kept with the reason."""
    head = logits_layer if logits_layer is not None else find_logits_layer(model)
    tied = _tied_weights(model)
    by_parent = set(read_by_parent(model))
    steps = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            kind, why = "linear", _not_multiple(in_features=m.in_features, out_features=m.out_features)
        elif isinstance(m, nn.LayerNorm):
            kind = "layernorm"
            why = ("not a 1-D LayerNorm with weight and bias" if len(m.normalized_shape) != 1 or m.weight is None
                   or m.bias is None else _not_multiple(hidden=m.normalized_shape[0]))
        else:
            spec = rmsnorm_spec(m)
            if spec is None:
                continue
            kind = "rmsnorm"
            why = spec if isinstance(spec, str) else _not_multiple(hidden=m.weight.numel())
        if name == head:
            why = LOGITS_KEPT
        elif kind == "linear" and len(holders := tied.get(id(m.weight), [name])) > 1:
            why = f"weight tied to {', '.join(h for h in holders if h != name)}"
        elif name in by_parent:
            why = WEIGHT_READ_BY_PARENT
        steps.append(Step(name, kind, "keep" if why else "convert", why))
    return steps


def _tied_weights(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the names of the modules holding it (a tied weight has more than one)."""
    holders: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    return holders


@torch.no_grad()
def _te_leaf(te: Any, old: nn.Module, kind: str) -> nn.Module:
    """TE's module for one Linear or norm, with ``old``'s weights (same dtype and device)."""
    w = old.weight
    if kind == "linear":
        new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None, params_dtype=w.dtype,
                        device=w.device)
    elif kind == "layernorm":
        new = te.LayerNorm(old.normalized_shape[0], eps=old.eps, dtype=w.dtype, device=w.device)
    else:
        spec = rmsnorm_spec(old)
        new = te.RMSNorm(w.numel(), eps=spec.eps, zero_centered_gamma=spec.zero_centered, dtype=w.dtype,
                         device=w.device)
    for pname, p in new.named_parameters():
        p.copy_(getattr(old, pname))
    new.train(old.training)
    return new


# ---------------------------------------------------------------------------------------------- transformer_layer


def hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model`` (the first submodule with a config naming its model_type)."""
    return next((m for m in model.modules() if isinstance(getattr(getattr(m, "config", None), "model_type", None), str)),
                None)


def _decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.Module, str]:
    """(the transformers model, its decoder layers ModuleList, that list's qualified name); ConvertError where
    transformer_layer does not apply."""
    hf = hf_model(model)
    if why := layer_refusal("transformer_layer", getattr(getattr(hf, "config", None), "model_type", None)):
        raise ConvertError(f"te_layer {why}")
    cfg = hf.config
    if getattr(cfg, "hidden_act", None) != "silu":
        raise ConvertError(f"te_layer transformer_layer: hidden_act {cfg.hidden_act!r}, TE's swiglu is silu-gated")
    base = hf.get_decoder() if callable(getattr(hf, "get_decoder", None)) else hf.model
    rotary = getattr(base, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if rope_type not in STATIC_ROPE or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ConvertError(f"te_layer transformer_layer: rope type {rope_type!r} (scaled or updated per call); "
                           f"it takes {', '.join(STATIC_ROPE)}")
    names = {id(m): n for n, m in model.named_modules()}
    return base, base.layers, names[id(base.layers)]


def decoder_plan(model: nn.Module, logits_layer: str | None = None) -> list[Step]:
    """Each decoder layer, replaced by a te.TransformerLayer or kept with the reason; then the layer that makes
    the logits, kept (it stays a BF16 Linear, as under swap: the record lists it among the kept modules)."""
    _, layers, prefix = _decoder_layers(model)
    steps = [Step(f"{prefix}.{i}", "decoder_layer", *(("keep", why) if (why := _decoder_misfit(layer)) else
                                                      ("convert",)))
             for i, layer in enumerate(layers)]
    head = logits_layer if logits_layer is not None else find_logits_layer(model)
    return steps + ([Step(head, "linear", "keep", LOGITS_KEPT)] if head else [])


def _decoder_misfit(layer: nn.Module) -> str:
    """Why this decoder layer cannot become one te.TransformerLayer ('' when it can)."""
    for owner, linears in DECODER_LINEARS.items():
        for lin in linears:
            if not isinstance(getattr(getattr(layer, owner, None), lin, None), nn.Linear):
                return f"no Linear {owner}.{lin}: not a Llama-family decoder layer"
    specs = [rmsnorm_spec(getattr(layer, n, nn.Identity())) for n in ("input_layernorm", "post_attention_layernorm")]
    if not all(isinstance(s, RMSNormSpec) and not s.zero_centered for s in specs):
        return "input_layernorm / post_attention_layernorm are not x/rms(x)*w RMSNorms"
    if specs[0].eps != specs[1].eps:
        return f"the two norms' eps differ ({specs[0].eps}, {specs[1].eps}); TE's layer has one"
    a, m = layer.self_attn, layer.mlp
    if (m.gate_proj.bias is None) != (m.up_proj.bias is None):
        return "gate_proj and up_proj differ in having a bias"
    if a.head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim {a.head_dim} not a multiple of {HEAD_DIM_MULTIPLE} (TE's fused attention)"
    return _not_multiple(hidden=a.q_proj.in_features, q=a.q_proj.out_features, kv=a.k_proj.out_features,
                         ffn=m.gate_proj.out_features)


def decoder_state(layer: nn.Module) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """te.TransformerLayer parameter name -> value, from a transformers Llama-family decoder layer; and the names of
    the zero biases TE's layer needs where the HF layer has none (to be frozen). TE's layer has biases on all of its
    GEMMs or none (``bias``): they are present iff any HF projection has one."""
    a, m = layer.self_attn, layer.mlp
    qkv = "self_attention.layernorm_qkv."
    state = {
        qkv + "layer_norm_weight": layer.input_layernorm.weight,
        qkv + "query_weight": a.q_proj.weight,
        qkv + "key_weight": a.k_proj.weight,
        qkv + "value_weight": a.v_proj.weight,
        "self_attention.proj.weight": a.o_proj.weight,
        "layernorm_mlp.layer_norm_weight": layer.post_attention_layernorm.weight,
        "layernorm_mlp.fc1_weight": torch.cat([m.gate_proj.weight, m.up_proj.weight]),  # (2 ffn, d): gate first
        "layernorm_mlp.fc2_weight": m.down_proj.weight,
    }
    fc1_bias = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
    biases = {qkv + "query_bias": (a.q_proj.bias, a.q_proj.out_features),
              qkv + "key_bias": (a.k_proj.bias, a.k_proj.out_features),
              qkv + "value_bias": (a.v_proj.bias, a.v_proj.out_features),
              "self_attention.proj.bias": (a.o_proj.bias, a.o_proj.out_features),
              "layernorm_mlp.fc1_bias": (fc1_bias, 2 * m.gate_proj.out_features),
              "layernorm_mlp.fc2_bias": (m.down_proj.bias, m.down_proj.out_features)}
    if all(b is None for b, _ in biases.values()):
        return state, ()
    w = a.q_proj.weight
    for name, (b, n) in biases.items():
        state[name] = torch.zeros(n, dtype=w.dtype, device=w.device) if b is None else b
    return state, tuple(name for name, (b, _) in biases.items() if b is None)


class RotaryAngles:
    """The model's rotary angles for positions 0..t-1 in TE's layout, (t, 1, 1, head_dim) fp32: transformers'
    ``inv_freq`` with each angle twice (rotate-half, TE's non-interleaved format); one table shared by every
    layer, grown to the longest sequence seen."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().float().clone()
        self.table: torch.Tensor | None = None

    def __call__(self, t: int, device: torch.device) -> torch.Tensor:
        if self.table is None or self.table.shape[0] < t or self.table.device != device:
            freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), self.inv_freq.to(device))
            self.table = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return self.table[:t]


class TEDecoderLayer(nn.Module):
    """A te.TransformerLayer in a transformers decoder layer's place. It takes that layer's call (hidden states
    (b, t, d) and keyword arguments it does not need: the mask is causal, positions are 0..t-1) and returns the
    hidden states. A sliding window (mistral, qwen2's sliding layers) is passed on only where the sequence is
    longer than the window (shorter, it changes nothing and would pick another attention kernel). Training only:
    it keeps no transformers KV cache."""

    def __init__(self, layer: nn.Module, rope: RotaryAngles, window: int | None):
        super().__init__()
        self.layer = layer
        self.rope = rope
        self.window = window

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None or kwargs.get("use_cache"):
            raise NotImplementedError("te_layer transformer_layer keeps no transformers KV cache (training only)")
        t = hidden_states.shape[1]
        extra = {"window_size": (self.window - 1, 0)} if self.window is not None and t > self.window else {}
        return self.layer(hidden_states, rotary_pos_emb=self.rope(t, hidden_states.device), **extra)


@torch.no_grad()
def _convert_decoders(model: nn.Module, te: Any, steps: list[Step]) -> None:
    base, layers, _ = _decoder_layers(model)
    rope = RotaryAngles(base.rotary_emb.inv_freq)
    for i, (step, layer) in enumerate(zip([s for s in steps if s.kind == "decoder_layer"], layers)):
        if step.converts:
            layers[i] = _te_decoder(te, layer, i, rope, getattr(base, "config", None))


def _te_decoder(te: Any, layer: nn.Module, index: int, rope: RotaryAngles, cfg: Any) -> TEDecoderLayer:
    a, m = layer.self_attn, layer.mlp
    state, frozen = decoder_state(layer)
    w = a.q_proj.weight
    new = te.TransformerLayer(
        hidden_size=a.q_proj.in_features,
        ffn_hidden_size=m.gate_proj.out_features,
        num_attention_heads=a.q_proj.out_features // a.head_dim,
        num_gqa_groups=a.k_proj.out_features // a.head_dim,
        kv_channels=a.head_dim,  # HF's scaling is head_dim ** -0.5, TE's 1/sqrt(kv_channels)
        layernorm_epsilon=rmsnorm_spec(layer.input_layernorm).eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        attn_input_format="bshd",
        normalization="RMSNorm",
        activation="swiglu",
        bias=any(n.endswith("bias") for n in state),  # all of TE's GEMMs have one, or none
        fuse_qkv_params=False,
        layer_number=index + 1,
        params_dtype=w.dtype,
        device=w.device,
    )
    params = dict(new.named_parameters())
    if set(params) != set(state):
        raise RuntimeError(f"te.TransformerLayer parameters {sorted(params)} != mapped {sorted(state)}")
    for name, p in params.items():
        p.copy_(state[name])
        p.requires_grad_(name not in frozen)
    new.train(layer.training)
    # mistral's window is its config's; qwen2's attention says per layer (None on full-attention layers)
    window = getattr(a, "sliding_window", getattr(cfg, "sliding_window", None))
    return TEDecoderLayer(new, rope, window)
