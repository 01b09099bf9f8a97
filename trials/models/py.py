"""Your own module: ``py:<module>:<callable>``, a factory called with the trial's spec.

The module is a dotted name importable from where the trial runs (``py:examples.my_model:build``) or a
``.py`` file path (``py:examples/my_model.py:build``). The factory gets the :class:`TrialSpec` (its shape
fields as given, None where not) and returns an ``nn.Module`` mapping token ids (batch, seq) to logits
(batch, seq, vocab), or to an object with ``.logits``. It is called with the global seed set to the
trial's and under ``torch.device(<the trial's device>)``; its weights are then cast to the cell's
precision (fp32, else bf16) and moved to the device.

The probe (:func:`check`, before Ray or any trial starts) builds the model on the meta device, at the
spec's own shape (no memory, no init), and runs one forward pass on (2, min(seq_len, 16)) token ids;
where the factory or its forward cannot run on the meta device, it builds it on the CPU with the shape
fields tiny (d_model 64, n_layers 1, n_heads 2, ffn 128) and runs the same pass there. It refuses a
factory that cannot be imported, is not callable, raises, returns no ``nn.Module`` or whose logits are
not (batch, seq, vocab) (vocab: the spec's, where given).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable

from . import Facts, ModelError, parse
from .common import Built, Logits, dtype_of, logits_of, param_count, to_json

log = logging.getLogger(__name__)

PROBE_ROWS, PROBE_SEQ = 2, 16
TINY_SHAPE = {"d_model": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": None, "ffn": 128}


def factory(target: str) -> Callable[[Any], Any]:
    module_name, _, attr = target.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name).expanduser().resolve()
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
        raise ModelError(f"py:{target}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ModelError(f"py:{target}: {module_name} has no {attr}")
    if not callable(fn):
        raise ModelError(f"py:{target}: {attr} is a {type(fn).__name__}, not callable")
    return fn


def _make(spec: Any, device: str) -> Any:
    import torch
    import torch.nn as nn

    target = parse(spec.model).target
    make = factory(target)
    try:
        with torch.device(device):
            module = make(spec)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"py:{target}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(module, nn.Module):
        raise ModelError(f"py:{target}: the factory returned a {type(module).__name__}, not an nn.Module")
    return module


def _vocab(spec: Any, module: Any) -> int | None:
    """The spec's vocab, else the module's (``vocab_size``, ``vocab``, ``config.vocab_size``), else the width of
    its last Linear."""
    import torch.nn as nn

    for value in (spec.vocab, getattr(module, "vocab_size", None), getattr(module, "vocab", None),
                  getattr(getattr(module, "config", None), "vocab_size", None)):
        if isinstance(value, int):
            return value
    last = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return last[-1].out_features if last else None


def _logits_layer(module: Any, vocab: int | None) -> str | None:
    """The last Linear that is vocab wide: the one that makes the logits."""
    import torch.nn as nn

    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return f"model.{names[-1]}" if names else None


def build(spec: Any, precision: str, device: str) -> Built:
    module = _make(spec, device).to(device=device, dtype=dtype_of(precision))
    module.train()
    vocab = _vocab(spec, module)
    if vocab is None:
        raise ModelError(f"{spec.model}: cannot tell the vocabulary; give vocab", "vocab")
    return Built(Logits(module), vocab, _logits_layer(module, vocab))


@functools.lru_cache(maxsize=64)
def describe(spec: Any) -> Facts:
    """Class and parameter count from a meta-device build (None where the factory cannot build on meta)."""
    from ..model import ModelConfig

    try:
        module = _make(spec, "meta")
        n_params, name, vocab = param_count(module), type(module).__name__, _vocab(spec, module)
    except ModelError:
        n_params, name, vocab = None, parse(spec.model).target.rpartition(":")[2], spec.vocab
    shape = {f: getattr(spec, f) for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn")}
    shape["vocab"] = vocab
    shape["head_dim"] = spec.d_model // spec.n_heads if spec.d_model and spec.n_heads else None
    estimate = None
    if all(isinstance(shape[f], int) for f in ("vocab", "d_model", "n_layers", "n_heads", "ffn")):
        estimate = ModelConfig(shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"], shape["ffn"],
                               spec.seq_len, arch="llama", n_kv_heads=shape["n_kv_heads"])
    return Facts(name, to_json({"factory": spec.model, **shape}), n_params, shape, estimate=estimate,
                 attn_width=spec.d_model)


def check(spec: Any) -> None:
    """Probe the factory (see the module's docstring): ModelError for anything that cannot be a trial's model."""
    target = parse(spec.model).target
    factory(target)  # import errors first, in their own words
    try:
        _probe(spec, "meta")
        return
    except Exception as exc:  # noqa: BLE001 - meta tensors are not for every module: try it small on the CPU
        log.info("py:%s does not run on the meta device (%s); probing it tiny on the CPU", target, exc)
    try:
        _probe(spec.replace(**TINY_SHAPE), "cpu")
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"py:{target}: its forward pass raised {type(exc).__name__}: {exc}") from None


def _probe(spec: Any, device: str) -> None:
    import torch

    module = _make(spec, device)
    t = min(spec.seq_len, PROBE_SEQ)
    vocab = _vocab(spec, module)
    ids = torch.zeros(PROBE_ROWS, t, dtype=torch.long, device=device)
    with torch.no_grad():
        out = module(ids)
    logits = logits_of(out) if isinstance(out, torch.Tensor) or hasattr(out, "logits") else None
    if not isinstance(logits, torch.Tensor):
        raise ModelError(f"py:{target_of(spec)}: the module returned a {type(out).__name__}, not logits (a tensor "
                         "or an object with .logits)")
    want = (PROBE_ROWS, t, vocab)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != want[:2] or (vocab is not None and logits.shape[2] != vocab):
        raise ModelError(f"py:{target_of(spec)}: ids of shape {tuple(ids.shape)} gave logits of shape "
                         f"{tuple(logits.shape)}; want (batch, seq, vocab) = ({PROBE_ROWS}, {t}, "
                         f"{vocab if vocab is not None else 'vocab'})")


def target_of(spec: Any) -> str:
    return parse(spec.model).target
