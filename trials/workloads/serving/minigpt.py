"""Serving MiniGPT: a fresh MiniGPT of the spec's shape (TE's te.TransformerLayer blocks on the te stack, the
pure-PyTorch twin elsewhere) holding the trained weights, generated from by trials/workloads/decode.py's Generator
(TE's InferenceParams or the twin's K/V buffers; ``cuda_graphs`` graphs its decode step)."""

from __future__ import annotations

from typing import Any

import torch

from ...backends import te_compat
from ..decode import Generator
from ...models.minigpt_net import MiniGPT, ModelConfig, fused_qkv_state
from ...models.minigpt import LOGITS_LAYER


def refusal(model: Any) -> str:
    return ""  # every MiniGPT serves


def load(spec: Any, state: dict, dtype: torch.dtype, device: str, te: Any, fp8_recipe: Any = None) -> MiniGPT:
    """The inference MiniGPT holding ``state``; with ``fp8_recipe``, built under TE's ``quantized_model_init`` (its
    block weights exist only in FP8; the fused QKV layout ``quantized_model_init`` builds)."""
    from ...backends.te import load_fp8_weights

    cfg = ModelConfig.from_spec(spec)
    if fp8_recipe is None:
        model = MiniGPT(cfg, dtype, device, te).eval()
        model.load_state_dict(state)
        return model
    with te_compat.quantized_model_init(te, fp8_recipe):
        model = MiniGPT(cfg, dtype, device, te, fused_qkv=True).eval()
    load_fp8_weights(model, fused_qkv_state(state))
    return model


def logits_layer(model: Any) -> str:
    return LOGITS_LAYER


def generator(model: MiniGPT, rows: int, max_len: int, te: Any = None, recipe: Any = None,
              graphs: bool = False) -> Generator:
    return Generator(model, rows, max_len, te, recipe, graphs=graphs)
