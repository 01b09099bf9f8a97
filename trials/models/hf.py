"""Hugging Face transformers causal LMs, from a config alone: random seeded weights, no download, no network.

``hf:<model_type>`` takes transformers' own config class for the type (``AutoConfig.for_model``: its
defaults are the full-size model, e.g. Llama-2-7B's shape for ``llama``); ``hf:<path>`` reads a local
``config.json`` (or the folder holding one), as published beside a model on the Hub. The spec's shape
fields override the config's values where given (SHAPE_TO_HF), and ``max_position_embeddings`` is raised
to ``seq_len`` where it is shorter; every other value is the config's and the resolved config is
recorded. The model is ``AutoModelForCausalLM.from_config`` with SDPA attention, ``use_cache=False``
(training keeps no KV cache) and every dropout at 0 (MiniGPT has none; a benchmark step should not
draw random masks). The harness computes the loss from the logits: no ``labels`` are handed over.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import logging
from typing import Any

from . import Facts, ModelError, not_found, parse, user_path
from .common import Built, Logits, dtype_of, inner, largest_module_list, param_count, to_json

log = logging.getLogger(__name__)

# trial shape field -> transformers' config attribute (configs map their own names, e.g. GPT-2's n_embd,
# through ``attribute_map``)
SHAPE_TO_HF = {"vocab": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn": "intermediate_size"}
POSITIONS = ("max_position_embeddings",)  # raised to seq_len where shorter
NOT_CONFIG = ("model_type", "transformers_version", "architectures", "torch_dtype", "dtype", "auto_map",
              "_name_or_path", "quantization_config")  # a config.json's keys that describe a checkpoint, not a shape
INSTALL = "pip install 'juicytalk[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(f"hf: models need transformers, which is not installed: {INSTALL}") from None
    return transformers


@functools.lru_cache(maxsize=None)
def _causal_types() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every config model type transformers knows, those with a causal LM class)."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(CONFIG_MAPPING_NAMES), tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_path(target: str) -> bool:
    return "/" in target or "\\" in target or target.endswith(".json") or user_path(target).exists()


@functools.lru_cache(maxsize=64)
def _base(target: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """(model type, the config file's values) for ``hf:<target>``; ModelError for what cannot be built."""
    values: dict[str, Any] = {}
    if _is_path(target):
        path = user_path(target)  # relative: to the folder juicytalk ran in, the sweep's trials too
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ModelError(f"hf:{target}: {not_found(target, file, 'config file')} (give a config.json or a "
                             "folder holding one)")
        try:
            values = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ModelError(f"hf:{target}: cannot read {file} as JSON: {exc}") from None
        if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
            raise ModelError(f"hf:{target}: {file} has no model_type (a transformers config.json names its type)")
        model_type = values["model_type"]
    else:
        model_type = target
    known, causal = _causal_types()
    if model_type not in causal:
        what = "has no causal LM class in" if model_type in known else "is not a model type of"
        close = difflib.get_close_matches(model_type, causal, n=5, cutoff=0.6)
        raise ModelError(f"hf:{target}: {model_type!r} {what} transformers {_transformers().__version__}"
                         + (f"; close: {', '.join('hf:' + c for c in close)}" if close else ""))
    return model_type, tuple(sorted((k, v) for k, v in values.items() if k not in NOT_CONFIG))


def _overrides(spec: Any) -> tuple[tuple[str, int], ...]:
    return tuple((f, getattr(spec, f)) for f in SHAPE_TO_HF if getattr(spec, f) is not None)


def config(spec: Any) -> Any:
    """The resolved transformers config of ``spec``: the type's defaults or the file's values, the spec's shape
    fields over them, positions at least ``seq_len``, no KV cache, no dropout."""
    return _config(parse(spec.model).target, _overrides(spec), spec.seq_len)


@functools.lru_cache(maxsize=64)
def _config(target: str, overrides: tuple[tuple[str, int], ...], seq_len: int) -> Any:
    _transformers()
    from transformers import AutoConfig

    model_type, items = _base(target)
    values = dict(items)
    defaults = AutoConfig.for_model(model_type)
    given = dict(overrides)
    for field_name, value in given.items():
        name = SHAPE_TO_HF[field_name]
        if not hasattr(defaults, name):
            raise ModelError(f"hf:{target}: {type(defaults).__name__} has no {name}, so {field_name} cannot set it",
                             field_name)
        values[name] = value
    if {"d_model", "n_heads"} & set(given):  # a head_dim written for the file's own shape would no longer fit
        values.pop("head_dim", None)
    if "vocab" in given:  # special token ids past a smaller vocabulary mean nothing here (the data has none)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token = values.get(key, getattr(defaults, key, None))
            if isinstance(token, int) and token >= given["vocab"]:
                values[key] = None
    try:
        cfg = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # noqa: BLE001 - a config class's own validation, in its words
        raise ModelError(f"hf:{target}: transformers refuses the config: {type(exc).__name__}: {exc}") from None
    for name in POSITIONS:
        if hasattr(cfg, name) and getattr(cfg, name) < seq_len:
            setattr(cfg, name, seq_len)
    cfg.use_cache = False
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value:
            setattr(cfg, key, 0.0)
    return cfg


def _shape(cfg: Any) -> dict[str, Any]:
    heads = getattr(cfg, "num_attention_heads", None)
    return {"vocab": cfg.vocab_size, "d_model": cfg.hidden_size, "n_layers": cfg.num_hidden_layers,
            "n_heads": heads, "n_kv_heads": getattr(cfg, "num_key_value_heads", heads),
            "ffn": getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size}


def _from_config(cfg: Any, precision: str) -> Any:
    """The model of ``cfg`` (a copy: transformers writes the dtype and attention choice into the config it gets)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype_of(precision), attn_implementation="sdpa")


def build(spec: Any, precision: str, device: str) -> Built:
    import torch

    cfg = config(spec)
    with torch.device(device):
        model = _from_config(cfg, precision)
    model.train()
    wrapped = Logits(model, use_cache=False)
    head = model.get_output_embeddings()
    logits_layer = next((f"model.{n}" for n, m in model.named_modules() if m is head), None)
    return Built(wrapped, cfg.vocab_size, logits_layer, units=units(wrapped))


def units(model: Any) -> tuple[str, ...]:
    """Each module of a class the transformers model's ``_no_split_modules`` names (its decoder layers: what
    transformers itself keeps whole when it splits a model over devices), the outermost where they nest; else
    each child of its largest nn.ModuleList."""
    hf, prefix = inner(model)
    classes = set(getattr(hf, "_no_split_modules", None) or ())
    found: list[str] = []
    for name, module in hf.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f"{u}.") for u in found):
            found.append(name)
    if found:
        return tuple(".".join(p for p in (prefix, n) if p) for n in found)
    return largest_module_list(hf, prefix)


def describe(spec: Any) -> Facts:
    return _describe(parse(spec.model).target, _overrides(spec), spec.seq_len)


@functools.lru_cache(maxsize=64)
def _describe(target: str, overrides: tuple[tuple[str, int], ...], seq_len: int) -> Facts:
    """Built on the meta device (no memory, no init): the class and the exact parameter count of the full model."""
    import torch

    cfg = _config(target, overrides, seq_len)
    try:
        with torch.device("meta"):
            model = _from_config(cfg, "bf16")
    except Exception as exc:  # noqa: BLE001 - the modelling code's own checks (heads dividing hidden, ...)
        raise ModelError(f"hf:{target}: transformers cannot build it: {type(exc).__name__}: {exc}") from None
    shape = _shape(cfg)
    heads = shape["n_heads"] or 1
    head_dim = getattr(cfg, "head_dim", None) or shape["d_model"] // heads
    values = {k: v for k, v in cfg.to_dict().items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    return Facts(type(model).__name__, to_json(values), param_count(model), shape,
                 attn_width=heads * head_dim, model_type=cfg.model_type)


def check(spec: Any) -> None:
    from . import check_units, needs_units

    describe(spec)
    if needs_units(spec):  # the units, from the model built on the meta device (no memory, no init)
        import torch

        with torch.device("meta"):
            check_units(spec, _from_config(config(spec), "bf16"))
