"""JuicyTalk's own MiniGPT (``trials/models/minigpt_net.py``), gpt or llama ``arch``: the pure-PyTorch twin a stack converts.

TE builds its own te blocks of the same network (``trials/backends/te.py``), so this module serves the
torch and torchao stacks; its parameter count and FLOPs have closed forms (``trials/models/minigpt_net.py``,
``trials/measure/metrics.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from . import Facts

if TYPE_CHECKING:
    from .common import Built

LOGITS_LAYER = "head"


# trials/models/minigpt_net.py and .common (torch) are imported where a model is built or described, not here: the driver
# validates a sweep's MiniGPT cells through this module (check), and torch took seconds of its start.


def build(spec: Any, precision: str, device: str) -> Built:
    from .minigpt_net import build_model
    from .common import Built

    model = build_model(spec, "torch", precision, device)
    return Built(model, model.cfg.vocab, LOGITS_LAYER, units=units(model))


def units(model: Any) -> tuple[str, ...]:
    """Each of MiniGPT's blocks (torch's twin and TE's own blocks alike)."""
    return tuple(f"blocks.{name}" for name, _ in model.blocks.named_children())


def describe(spec: Any) -> Facts:
    from .minigpt_net import MiniGPT, ModelConfig, param_count
    from .common import to_json

    cfg = ModelConfig.from_spec(spec)
    shape = {"vocab": cfg.vocab, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
             "n_kv_heads": spec.n_kv_heads, "ffn": cfg.ffn, "head_dim": cfg.d_model // cfg.n_heads}
    return Facts(MiniGPT.__name__, to_json(dataclasses.asdict(cfg)), param_count(cfg), shape, analytic=cfg,
                 attn_width=cfg.d_model)


def check(spec: Any) -> None:
    """The spec's own validation covers MiniGPT."""
