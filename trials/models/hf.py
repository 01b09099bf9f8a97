"""Hugging Face transformers causal LMs, from a config alone: random seeded weights, no download, no network.

``hf:<model_type>`` takes transformers' own config class for the type (``AutoConfig.for_model``: its
defaults are the full-size model, e.g. Llama-2-7B's shape for ``llama``); ``hf:<path>`` reads a local
``config.json`` (or the folder holding one), as published beside a model on the Hub. The spec's shape
fields override the config's values where given (SHAPE_NAMES), and ``max_position_embeddings`` is raised
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
from dataclasses import dataclass
from typing import Any

from . import Facts, ModelError, not_found, parse, user_path
from .common import Built, Logits, dtype_of, experts, inner, largest_module_list, param_count, to_json

log = logging.getLogger(__name__)

# trial shape field -> the config attributes that hold it, by the names transformers' types use (configs also map
# their own names through ``attribute_map``, e.g. GPT-2's n_embd). A spec value sets every name the type has (ffn:
# its dense MLP, each expert and the shared expert alike); the first name the type has is read back for the record.
# A field none of whose names the type has is refused (BLOOM's MLP is 4 x hidden_size, no knob).
SHAPE_NAMES = {
    "vocab": ("vocab_size",),
    "d_model": ("hidden_size",),
    "n_layers": ("decoder_layers", "num_hidden_layers"),  # encoder-decoder types' causal LM is their decoder
    "n_heads": ("decoder_attention_heads", "num_attention_heads"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads"),  # Falcon derives the first from the second
    "ffn": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim", "d_ff", "dim_ff",
            "moe_intermediate_size", "shared_expert_intermediate_size"),
}
# a config that derives the first name from the second (Falcon's KV heads from num_kv_heads and multi_query): a
# spec value sets the second, and the first is read back
DERIVED_FROM = {"num_key_value_heads": "num_kv_heads"}
# types whose FFN width may be None in the config: the MLP is then 4 x hidden_size (GPT-2's n_inner, GPT-Neo's)
FFN_UNSET_IS = 4
# multi-head latent attention (DeepSeek-V2/V3 and their kin): each head's query/key is a rope part and a no-rope
# part, its value a width of its own, from low-rank projections; none of them is hidden / heads (DeepSeek-V3:
# 7168 / 128 = 56 against 192-wide queries), so they stay the type's own, and ``head_dim`` (the rope part there)
# does not follow d_model / n_heads
MLA_QK = ("qk_rope_head_dim", "qk_nope_head_dim")  # a query's (and key's) two parts
MLA_SIZES = (*MLA_QK, "v_head_dim", "kv_lora_rank", "q_lora_rank")
# a rotary width in channels (GPT-J's and CodeGen's 64 of a 256-wide head): it keeps its share of the head when
# d_model / n_heads change the head's width (types with partial_rotary_factor keep theirs by themselves)
ROTARY_WIDTH = "rotary_dim"
# a per-layer pattern written as [[pattern, repeats], ...] (GPT-Neo's [[["global", "local"], 12]] for 24 layers):
# with n_layers given, the first pattern repeats to fill them
LAYER_PATTERN = "attention_types"
# config settings that make a type's causal LM class attend causally, name -> (the value that reads ahead, the
# causal one): an encoder type's LM head (transformers' BertLMHeadModel and kin: "add is_decoder=True" to use it
# standalone), XLM's ``causal``, XLNet's ``attn_type`` ("bi" without a permutation mask, "uni" causal). Set for
# every type that has one, over a config.json's value too: each position would otherwise read the token its
# loss predicts
CAUSAL = {"is_decoder": (False, True), "causal": (False, True), "attn_type": ("bi", "uni")}
# a head's width under the names the types give it: it follows d_model / n_heads when the spec sets either
HEAD_WIDTHS = ("head_dim", "d_head")
# types whose causal LM class, as transformers builds it, attends both ways whatever the config says
READS_AHEAD = {"cpmant": "transformers' CPM-Ant forward makes every position context (its attention mask is all "
                         "ones), so each position reads the token its next-token loss predicts"}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # the types' names
# other config values that set the model's size: shown beside the shape fields where transformers' defaults
# supplied them (a bare ``hf:qwen2_moe`` keeps its 60 experts of 1408)
SIZE_NAMES = ("head_dim", *EXPERT_COUNTS, "num_experts_per_tok", "n_shared_experts", "num_shared_experts",
              *MLA_SIZES)
# config values that say which decoder layers get experts (the rest are dense): DeepSeek's first 3 of 61 are dense,
# Qwen-MoE's every decoder_sparse_step-th is MoE, ...; shown beside what the built model has, which can be no MoE
# layer at all (a 2-layer hf:deepseek_v3)
MOE_LAYER_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_freq", "decoder_sparse_step",
                  "mlp_only_layers", "interleave_moe_layer_step", "expert_layer_period", "expert_layer_offset",
                  "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
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
    return tuple((f, getattr(spec, f)) for f in SHAPE_NAMES if getattr(spec, f) is not None)


def _has(cfg: Any, name: str) -> bool:
    """``cfg`` has attribute ``name`` (a per-layer attribute of a heterogeneous config raises on access: no)."""
    try:
        return hasattr(cfg, name)
    except Exception:  # noqa: BLE001 - transformers' per-layer attributes refuse a global read
        return False


def _names(cfg: Any, field_name: str) -> tuple[str, ...]:
    """The config attributes of ``cfg``'s type that hold the trial field ``field_name`` (SHAPE_NAMES)."""
    return tuple(n for n in SHAPE_NAMES[field_name] if _has(cfg, n))


def _settable(cfg: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """Of ``names``, those a value is written to: not one the config derives from another it has (DERIVED_FROM)."""
    return tuple(n for n in names if not (n in DERIVED_FROM and _has(cfg, DERIVED_FROM[n])))


@dataclass(frozen=True)
class Resolved:
    """A spec's transformers config and where its size values came from: ``given`` the config names the sweep's
    shape fields set, ``derived`` those that follow from them (head_dim from d_model / n_heads, KV heads at the
    config's ratio), ``defaults`` the size values transformers' config class supplied (neither the sweep nor the
    config file gave them: a bare type's full-size model, a config.json without vocab_size)."""

    cfg: Any
    given: tuple[str, ...]
    derived: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]


def config(spec: Any) -> Any:
    """The resolved transformers config of ``spec``: the type's defaults or the file's values, the spec's shape
    fields over them, positions at least ``seq_len``, no KV cache, no dropout."""
    return _config(parse(spec.model).target, _overrides(spec), spec.seq_len).cfg


def _refused(target: str, exc: Exception, given: tuple[str, ...]) -> ModelError:
    """transformers' refusal of a config, in one line (its messages span lines), naming the spec field at fault:
    the shape field given whose config name the message names (``The hidden size (100) is not a multiple of the
    number of attention heads``: d_model), else the one shape field given, else ``model``."""
    text = " ".join(str(exc).split())
    lowered = text.lower()
    named = [f for f in given if any(n in lowered or n.replace("_", " ").removeprefix("num ") in lowered
                                     for n in SHAPE_NAMES.get(f, ()))]
    blamed = named[0] if named else given[0] if len(given) == 1 else "model"
    return ModelError(f"hf:{target}: transformers refuses the config: {type(exc).__name__}: {text}", blamed)


@functools.lru_cache(maxsize=64)
def _config(target: str, overrides: tuple[tuple[str, int], ...], seq_len: int) -> Resolved:
    _transformers()
    from transformers import AutoConfig

    model_type, items = _base(target)
    if model_type in READS_AHEAD:
        raise ModelError(f"hf:{target}: not a causal LM to train: {READS_AHEAD[model_type]}")
    values = dict(items)
    try:
        base = AutoConfig.for_model(model_type, **values)  # the file's values over the type's defaults
    except Exception as exc:  # noqa: BLE001 - a config class's own validation, in its words
        raise _refused(target, exc, ()) from None
    aliases = getattr(base, "attribute_map", {}) or {}
    in_file = {n for n in values} | {n for n, alias in aliases.items() if alias in values}
    given = dict(overrides)
    set_names: list[str] = []
    for field_name, value in given.items():
        names = _names(base, field_name)
        if not names:
            raise ModelError(f"hf:{target}: {type(base).__name__} has no {' or '.join(SHAPE_NAMES[field_name])}, "
                             f"so {field_name} cannot set it; leave {field_name} unset", field_name)
        for name in _settable(base, names):
            values[name] = value
        set_names += names
    derived: list[str] = []
    hidden = given.get("d_model", getattr(base, "hidden_size", None))
    heads = given.get("n_heads", _first(base, "n_heads"))
    hidden0, heads0 = getattr(base, "hidden_size", None), _first(base, "n_heads")
    reshaped = bool({"d_model", "n_heads"} & set(given)) and isinstance(hidden, int) and isinstance(heads, int) \
        and heads > 0
    if reshaped and not _has(base, MLA_QK[0]):
        # the type's head width was for its own shape: it follows (a type that computes it, as Falcon does,
        # follows by itself; MLA's is its rope part, MLA_SIZES)
        for width in (w for w in HEAD_WIDTHS if w in base.to_dict()):
            values[width] = hidden // heads
            derived.append(width)
    rotary0 = getattr(base, ROTARY_WIDTH, None) if _has(base, ROTARY_WIDTH) else None
    if reshaped and isinstance(rotary0, int) and isinstance(hidden0, int) and isinstance(heads0, int) and heads0:
        head0, head = hidden0 // heads0, hidden // heads  # the rotary width keeps its share of the head, even
        values[ROTARY_WIDTH] = max(2, rotary0 * head // head0 // 2 * 2) if head0 else rotary0
        derived.append(ROTARY_WIDTH)
    pattern = getattr(base, LAYER_PATTERN, None) if _has(base, LAYER_PATTERN) else None
    if "n_layers" in given and LAYER_PATTERN not in values and _repeated(pattern):
        cycle = pattern[0][0]
        if given["n_layers"] % len(cycle):
            raise ModelError(f"hf:{target}: n_layers={given['n_layers']} is not a whole number of its layer pattern "
                             f"{cycle}; give a multiple of {len(cycle)}", "n_layers")
        values[LAYER_PATTERN] = [[cycle, given["n_layers"] // len(cycle)]]
        derived.append(LAYER_PATTERN)
    kv_names = _names(base, "n_kv_heads")
    if "n_heads" in given and "n_kv_heads" not in given and kv_names:  # keep the config's query/KV head ratio
        kv0 = getattr(base, _settable(base, kv_names)[0], None)
        if isinstance(kv0, int) and isinstance(heads0, int) and heads0:
            for name in _settable(base, kv_names):
                values[name] = _kv_heads(given["n_heads"], given["n_heads"] * kv0 // heads0)
            derived += kv_names
    if "n_kv_heads" not in given and isinstance(heads, int):
        # None KV heads: transformers' documented default, as many as heads (Nemotron's config leaves it None)
        for name in (n for n in _settable(base, kv_names) if values.get(n, getattr(base, n, None)) is None):
            values[name] = heads
            derived.append(name)
    if "vocab" in given:  # special token ids past a smaller vocabulary mean nothing here (the data has none)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token = values.get(key, getattr(base, key, None))
            if isinstance(token, int) and token >= given["vocab"]:
                values[key] = None
    if values.get("default_language", getattr(base, "default_language", None)) is None \
            and getattr(base, "languages", None):  # X-MOD's adapters need a language for input without lang_ids
        values["default_language"] = base.languages[0]
        derived.append("default_language")
    for name, (ahead, causal) in CAUSAL.items():
        if name in base.to_dict() and values.get(name, getattr(base, name)) == ahead:
            values[name] = causal
            derived.append(name)
    try:
        cfg = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # noqa: BLE001 - a config class's own validation, in its words
        raise _refused(target, exc, tuple(given)) from None
    if any(isinstance(getattr(cfg, n, None), int) and getattr(cfg, n) > 0 for n in EXPERT_COUNTS if _has(cfg, n)) \
            and _has(cfg, "num_experts_per_tok") and cfg.num_experts_per_tok is None:
        raise ModelError(f"hf:{target}: {type(cfg).__name__} has routed experts but num_experts_per_tok is None "
                         "(transformers' default for the type), so its router has no top-k: give "
                         "num_experts_per_tok in a config.json (hf:path/to/config.json)")
    for name in POSITIONS:  # (a negative one is no limit: XLNet's -1, which refuses to be set)
        if hasattr(cfg, name) and 0 <= getattr(cfg, name) < seq_len:
            setattr(cfg, name, seq_len)
    cfg.use_cache = False
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value:
            setattr(cfg, key, 0.0)
    for field_name, value in given.items():  # a value the type's own logic overrides never reached the model
        kept = {n: getattr(cfg, n) for n in _names(cfg, field_name)}
        if field_name == "ffn":
            kept = {n: FFN_UNSET_IS * cfg.hidden_size if v is None else v for n, v in kept.items()}
        if any(v != value for v in kept.values()):
            wrong = ", ".join(f"{n}={v}" for n, v in kept.items() if v != value)
            raise ModelError(f"hf:{target}: {field_name}={value} does not reach the model: {type(cfg).__name__} "
                             f"keeps {wrong}; leave {field_name} unset or set the config's own flags in a "
                             "config.json", field_name)
    sizes = [n for f in SHAPE_NAMES for n in _names(cfg, f)] + [n for n in SIZE_NAMES if _has(cfg, n)]
    # a default is a value nobody gave that is the bare type's own (one the config computes from the given
    # shape, as llama's KV heads from its heads or Falcon's head_dim property, is not a default; nor is None, a
    # rule such as GPT-2's 4 x hidden MLP)
    stored, bare = cfg.to_dict(), _bare(model_type)
    defaults = tuple((n, stored[n]) for n in dict.fromkeys(sizes)
                     if n in stored and stored[n] is not None and stored[n] == bare.get(n)
                     and n not in set_names and n not in derived and n not in in_file)
    if defaults and in_file:
        log.warning("hf:%s: %s from transformers' defaults (neither the sweep nor the config file gives them)",
                    target, ", ".join(f"{n}={v}" for n, v in defaults))
    return Resolved(cfg, tuple(set_names), tuple(derived), defaults)


def _repeated(pattern: Any) -> bool:
    """``pattern`` is written as [[pattern, repeats]] (LAYER_PATTERN)."""
    return isinstance(pattern, list) and len(pattern) == 1 and isinstance(pattern[0], (list, tuple)) \
        and len(pattern[0]) == 2 and isinstance(pattern[0][0], list) and isinstance(pattern[0][1], int)


def _kv_heads(heads: int, kv: int) -> int:
    """KV heads for ``heads`` query heads where the config's ratio gives ``kv``: the largest count at most ``kv``
    (at least one) that divides ``heads``. A ratio past ``heads`` (MiMo-V2-Flash's 64 queries over 4 KV heads at
    4 heads) keeps one KV head, as multi-query attention, rather than turning the type's GQA into full MHA."""
    return max(d for d in range(1, max(1, min(kv, heads)) + 1) if heads % d == 0)


@functools.lru_cache(maxsize=None)
def _bare(model_type: str) -> dict[str, Any]:
    """transformers' default config of ``model_type``, as a dict."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).to_dict()


def _first(cfg: Any, field_name: str) -> Any:
    """The value of ``field_name`` as ``cfg`` holds it: its type's first name for it (None where it has none)."""
    names = _names(cfg, field_name)
    return getattr(cfg, names[0]) if names else None


def _shape(cfg: Any) -> dict[str, Any]:
    """The trial's shape fields read back from the built config (what the model has, not what was asked)."""
    hidden = cfg.hidden_size
    heads = _first(cfg, "n_heads")
    kv = _first(cfg, "n_kv_heads")
    ffn = _first(cfg, "ffn")
    return {"vocab": cfg.vocab_size, "d_model": hidden, "n_layers": _first(cfg, "n_layers"), "n_heads": heads,
            "n_kv_heads": heads if kv is None else kv,
            "ffn": FFN_UNSET_IS * hidden if ffn is None else ffn}


def _attention(cfg: Any) -> str:
    """The attention implementation the type's model class has: SDPA where it has it, else eager (Gemma 2's
    soft-capped logits and BLOOM's ALiBi have no SDPA path in transformers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _from_config(cfg: Any, precision: str) -> Any:
    """The model of ``cfg`` (a copy: transformers writes the dtype and attention choice into the config it gets)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype_of(precision),
                                            attn_implementation=_attention(cfg))


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

    resolved = _config(target, overrides, seq_len)
    cfg = resolved.cfg
    try:
        with torch.device("meta"):
            model = _from_config(cfg, "bf16")
    except Exception as exc:  # noqa: BLE001 - the modelling code's own checks (heads dividing hidden, ...)
        raise ModelError(f"hf:{target}: transformers cannot build it: {type(exc).__name__}: {exc}") from None
    shape = _shape(cfg)
    head = model.get_output_embeddings()
    width = head.weight.shape[0] if head is not None and getattr(head, "weight", None) is not None else None
    if width is not None and width != shape["vocab"]:  # the logits are the head's, whatever vocab_size says
        if "vocab" in dict(overrides):
            raise ModelError(f"hf:{target}: vocab={shape['vocab']} does not reach the model: its LM head "
                             f"({type(model).__name__}) makes {width} logits; leave vocab unset", "vocab")
        shape["vocab"] = width
    heads = shape["n_heads"] or 1
    head_dim = (getattr(cfg, "head_dim", None) if _has(cfg, "head_dim") else None) or shape["d_model"] // heads
    if all(isinstance(getattr(cfg, n, None), int) for n in MLA_QK):  # MLA: a query/key is both parts
        head_dim = sum(getattr(cfg, n) for n in MLA_QK)
    shape["head_dim"] = head_dim
    values = {k: v for k, v in cfg.to_dict().items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    return Facts(type(model).__name__, to_json(values), param_count(model), shape,
                 attn_width=heads * head_dim, model_type=cfg.model_type,
                 defaults=dict(resolved.defaults), attn_implementation=model.config._attn_implementation,
                 moe_layers=moe_layers(model, cfg))


def moe_layers(model: Any, cfg: Any) -> str:
    """Which of ``model``'s decoder layers hold experts, where its config has any ('' where it has none), with the
    config values that place them: a type's expert count says nothing of a model too shallow for its first MoE
    layer."""
    if not any(isinstance(getattr(cfg, n, None), int) and getattr(cfg, n) > 0 for n in EXPERT_COUNTS if _has(cfg, n)):
        return ""
    layers = units(model)
    held = experts(model)
    moe = sum(any(e.startswith(f"{u}.") for e in held) for u in layers)
    dense = len(layers) - moe
    said = ([f"{dense} dense layer{'s' * (dense != 1)}"] if dense else []) + [
        f"{moe} MoE layer{'s' * (moe != 1)}" if moe else "no MoE layer"]
    why = " ".join(f"{n}={getattr(cfg, n)}" for n in MOE_LAYER_KEYS if _has(cfg, n))
    return ", ".join(said) + (f" ({why})" if why else "")


def check(spec: Any) -> None:
    from . import check_units, needs_units

    describe(spec)
    if needs_units(spec):  # the units, from the model built on the meta device (no memory, no init)
        import torch

        with torch.device("meta"):
            check_units(spec, _from_config(config(spec), "bf16"))
