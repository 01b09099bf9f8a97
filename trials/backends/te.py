"""Transformer Engine: te.TransformerLayer blocks (or TE's modules), FP8 under ``te.autocast`` with TE's recipe."""

from __future__ import annotations

from typing import Any

from .. import te_compat
from ..model import build_model
from . import Built


def fp8_recipe(spec: Any) -> Any:
    """TE's recipe object for an fp8 cell's recipe, format and amax settings."""
    return te_compat.make_recipe(spec.recipe, spec.fp8_format, spec.amax_history_len, spec.amax_compute_algo)


def build(spec: Any, precision: str, device: str) -> Built:
    te = te_compat.import_te()
    recipe = None
    info: dict[str, Any] = {"te_torch_compile": te_compat.te_torch_compile()}
    if precision == "fp8":
        recipe = fp8_recipe(spec)
        info["fp8_recipe_repr"] = repr(recipe)
    return Built(build_model(spec, "te", precision, device, te), te=te, recipe=recipe, info=info)
