"""Your own module: ``py:<module>:<callable>``, a factory called with the trial's spec.

The module is a dotted name (``py:examples.my_model:build``), imported with the folder juicytalk ran in first on
``sys.path`` as ``python -m`` run there has it (in a sweep's trials too: :func:`trials.models.run_folder`), so a
module of the user's project is found in every process, else an installed one; or a ``.py`` file path
(``py:examples/my_model.py:build``; a relative one from the folder juicytalk ran in:
:func:`trials.models.user_path`), run with its own folder first on ``sys.path`` as ``python file.py`` has it, so
that its sibling imports work. Either folder is on ``sys.path`` while the module is imported and while its
factory is called (an import inside the factory works too), not after. The factory gets the :class:`TrialSpec`
(its shape fields as given, None where not) and returns an ``nn.Module`` mapping token ids (batch, seq) to logits
(batch, seq, vocab), to a tuple whose first item they are (nanoGPT's ``(logits, loss)``), or to an object with
``.logits``. It is called with the global seed set to the trial's and under ``torch.device(<the trial's
device>)``; its weights are then cast to the cell's precision (fp32, else bf16) and moved to the device. A
process builds the model more than once (on the meta device for its facts and the probe, then for real): what
the factory prints is shown once per process.

The probe (:func:`check`, before Ray or any trial starts) builds the model on the meta device (once per process
and spec: :func:`on_meta`), at the spec's own shape (no memory, no init), and runs one forward pass on
(2, min(seq_len, 16)) token ids; where the factory or its forward cannot run on the meta device, it builds it on
the CPU with the shape fields tiny (d_model 64, n_layers 1, n_heads 2, ffn 128) and runs the same pass there. It
refuses a factory that cannot be imported, is not callable, raises, returns no ``nn.Module`` or whose logits are
not (batch, seq, vocab) (vocab: the spec's, where given), saying what to return; one that reads ahead (built
tiny on the CPU, its logits before the middle of a sequence move when the tokens after it change: not a causal
LM); and, for a trial that needs the model's units (``parallel: fsdp``, ``activation_checkpointing``), one whose units cannot be found.

Units (FSDP2 shards each, activation checkpointing recomputes them): the module's ``fsdp_units``
attribute, a list of qualified submodule names (``["layers.0", "layers.1"]``: one per decoder layer,
in order), where it has one; else each child of its largest ``nn.ModuleList``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from . import Facts, ModelError, cluster_note, needs_units, not_found, parse, run_folder, user_path
from .common import Built, Logits, dtype_of, inner, largest_module_list, logits_of, param_count, to_json

log = logging.getLogger(__name__)

PROBE_ROWS, PROBE_SEQ = 2, 16
UNITS_ATTR = "fsdp_units"  # a factory's module names its units here (qualified submodule names)
TINY_SHAPE = {"d_model": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": None, "ffn": 128}
# the causality check builds the factory's module for real, tiny, on the CPU: only where it builds this small there
# (a factory that keeps its own size whatever the shape fields say is not built for real by the dry run)
CAUSAL_PROBE_PARAMS = 50_000_000


def factory(target: str) -> Callable[[Any], Any]:
    """The factory ``target`` names (``module:callable``), to call with the spec; it is called as it was imported,
    with the same folder first on ``sys.path`` (and a file's siblings in ``sys.modules``), so that what it imports
    when called is found as what its module imported when run (:func:`_import`, :class:`_File`)."""
    module_name, _, attr = target.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = user_path(module_name)  # relative: to the folder juicytalk ran in, the sweep's trials too
            if not path.is_file():
                raise FileNotFoundError(not_found(module_name, path))
            loaded = _load_file(path.resolve())
            module, held = loaded.module, loaded.held
        else:
            folder = run_folder()
            held = functools.partial(_first_on_path, folder)
            module = _import(target, module_name, folder)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
        raise ModelError(f"py:{target}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ModelError(f"py:{target}: {module_name} has no {attr}")
    if not callable(fn):
        raise ModelError(f"py:{target}: {attr} is a {type(fn).__name__}, not callable")

    def call(*args: Any, **kwargs: Any) -> Any:
        with held():
            return fn(*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def _first_on_path(folder: str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while the block runs, as ``python -m`` run in it has it."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)  # the first one: ours


def _import(target: str, module_name: str, folder: str) -> ModuleType:
    """A dotted module, imported with the folder juicytalk ran in first on ``sys.path`` (:func:`run_folder`: the
    driver's in a sweep's trial, whose own working directory is its launcher's), so that a module of the user's
    project is found in every process, as ``python -m`` run there finds it; else an installed one. ModelError in
    one line when neither has it (not for a module it imports that is missing: that one is named as Python
    names it)."""
    try:
        with _first_on_path(folder):
            return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not exc.name or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise
    where = module_name.replace(".", "/")
    note = cluster_note("the module")
    raise ModelError(f"py:{target}: no module {module_name} in {folder} (the folder juicytalk ran in) nor installed; "
                     f"give a module importable from that folder ({where}.py or {where}/__init__.py under it) or "
                     f"installed, or a .py file by its path (py:path/to/file.py:{target.rpartition(':')[2]})"
                     + (f"; {note}" if note else ""))


def _load_file(path: Path) -> _File:
    """A factory's ``.py`` file, run once per process and version of the file (an edited file is run again)."""
    return _load_file_version(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _load_file_version(path: Path, mtime_ns: int) -> _File:
    """The file run (as a module, not as ``__main__``) under :meth:`_File.held`."""
    loaded = _File(path)
    with loaded.held():
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None:
            raise ImportError(f"{path} is not a Python module")
        loaded.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded.module)  # type: ignore[union-attr]
    return loaded


@dataclass(eq=False)
class _File:
    """A factory file's module and the sibling modules it imported (by name), which live here, not in
    ``sys.modules``, between its uses."""

    path: Path
    module: ModuleType | None = None
    siblings: dict[str, ModuleType] = field(default_factory=dict)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While the file runs and while its factory is called: its folder first on ``sys.path``, as ``python
        file.py`` has it, and the siblings it imported before in ``sys.modules``, so that its sibling imports
        (nanoGPT's ``from model import GPT``), at the top or inside the factory, work in every process that builds
        it (the trial's, a Ray worker's, the driver's probe) and find the modules it had. Only then: the folder
        then leaves ``sys.path`` and the siblings leave ``sys.modules`` (kept here, with those imported meanwhile),
        whatever stood under their names is put back, so that a second factory in another folder with its own
        ``model.py`` gets its own, not the first's (a trial server runs many trials in one process)."""
        folder = self.path.parent
        shadowed = {n: sys.modules[n] for n in self.siblings if n in sys.modules}
        before = set(sys.modules) - set(self.siblings)
        sys.modules.update(self.siblings)
        try:
            with _first_on_path(str(folder)):
                yield
        finally:
            for name in set(sys.modules) - before:
                if name in self.siblings or _from_folder(sys.modules[name], name, folder):
                    self.siblings[name] = sys.modules.pop(name)
            sys.modules.update(shadowed)


def _from_folder(module: ModuleType, name: str, folder: Path) -> bool:
    """Whether ``module`` was imported from ``folder`` as a sibling (``folder/layers.py``, ``folder/pkg/...``),
    not a package installed below it (a ``.venv`` in the folder)."""
    file = getattr(module, "__file__", None)
    if not file or not Path(file).resolve().is_relative_to(folder):
        return False
    top = name.partition(".")[0]
    return Path(file).resolve().relative_to(folder).parts[0] in (top, f"{top}.py")


def _make(spec: Any, device: str, show: bool = True) -> Any:
    """The factory's module for ``spec``, built under ``torch.device(device)``; what the factory prints is shown
    once per process (``show``: False for the probe's tiny stand-in, whose output is not about the user's model)."""
    import torch
    import torch.nn as nn

    target = parse(spec.model).target
    make = factory(target)
    printed = io.StringIO()
    try:
        with torch.device(device), contextlib.redirect_stdout(printed):
            module = make(spec)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"py:{target}: the factory raised {type(exc).__name__}: {exc}") from None
    finally:
        if show:
            _show_once(printed.getvalue())
        elif printed.getvalue():
            log.debug("py:%s printed, built tiny for the probe: %s", target, printed.getvalue().rstrip())
    if not isinstance(module, nn.Module):
        raise ModelError(f"py:{target}: the factory returned a {type(module).__name__}, not an nn.Module")
    return module


@functools.lru_cache(maxsize=None)
def _show_once(printed: str) -> None:
    """Write what a factory printed to stdout, once per process and text (the memo is what remembers it): a trial
    builds its model more than once (on the meta device for its facts and the probe, then for real; the dry run
    once per cell), and nanoGPT's parameter-count print should read once, not once per build."""
    if printed:
        sys.stdout.write(printed)


@functools.lru_cache(maxsize=16)
def on_meta(spec: Any) -> Any:
    """The spec's module built on the meta device (no memory, no init), once per process and spec: the facts
    (:func:`describe`), the probe (:func:`check`) and estimates from the module share it, so that the factory runs
    once for all of them. Read it; do not change it."""
    return _make(spec, "meta")


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
    wrapped = Logits(module)
    try:
        found = units(wrapped)
    except ModelError:
        if needs_units(spec):
            raise
        found = ()  # a mistaken fsdp_units stops only the trials that need the units
    return Built(wrapped, vocab, _logits_layer(module, vocab), units=found)


def units(model: Any) -> tuple[str, ...]:
    """The submodules the factory's module names in ``fsdp_units``, else each child of its largest
    nn.ModuleList; ModelError for a named unit the module does not have."""
    module, prefix = inner(model)
    named = getattr(module, UNITS_ATTR, None)
    if named is None:
        return largest_module_list(module, prefix)
    if isinstance(named, str) or not all(isinstance(n, str) for n in named):
        raise ModelError(f"{UNITS_ATTR} must be a list of submodule names (e.g. ['layers.0', 'layers.1']), got "
                         f"{named!r}")
    have = dict(module.named_modules())
    missing = [n for n in named if n not in have or not n]
    if missing:
        raise ModelError(f"{UNITS_ATTR} names {', '.join(map(repr, missing))}, which {type(module).__name__} does "
                         f"not have (its children: {', '.join(n for n, _ in module.named_children())})")
    return tuple(".".join(p for p in (prefix, n) if p) for n in named)


@functools.lru_cache(maxsize=64)
def describe(spec: Any) -> Facts:
    """Class and parameter count from a meta-device build (None where the factory cannot build on meta)."""
    try:
        module = on_meta(spec)
        n_params, name, vocab = param_count(module), type(module).__name__, _vocab(spec, module)
    except ModelError:
        n_params, name, vocab = None, parse(spec.model).target.rpartition(":")[2], spec.vocab
    shape = {f: getattr(spec, f) for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn")}
    shape["vocab"] = vocab
    shape["head_dim"] = spec.d_model // spec.n_heads if spec.d_model and spec.n_heads else None
    return Facts(name, to_json({"factory": spec.model, **shape}), n_params, shape, attn_width=spec.d_model)


def check(spec: Any) -> None:
    """Probe the factory (see the module's docstring): ModelError for anything that cannot be a trial's model."""
    from . import check_units

    target = parse(spec.model).target
    factory(target)  # import errors first, in their own words
    try:
        module = _probe(spec, "meta")
    except Exception as exc:  # noqa: BLE001 - meta tensors are not for every module: try it small on the CPU
        log.info("py:%s does not run on the meta device (%s); probing it tiny on the CPU", target, exc)
        try:
            module = _probe(spec.replace(**TINY_SHAPE), "cpu")
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ModelError(f"py:{target}: its forward pass raised {type(exc).__name__}: {exc}") from None
    why = _reads_ahead(spec)
    if why:
        raise ModelError(f"py:{target}: {why}")
    if not needs_units(spec):
        return
    try:
        check_units(spec, module)
    except ModelError as exc:
        raise ModelError(f"py:{target}: {exc}" if not str(exc).startswith(spec.model) else str(exc),
                         exc.field) from None


def _probe(spec: Any, device: str) -> Any:
    import torch

    module = on_meta(spec) if device == "meta" else _make(spec, device, show=False)
    t = min(spec.seq_len, PROBE_SEQ)
    vocab = _vocab(spec, module)
    ids = torch.zeros(PROBE_ROWS, t, dtype=torch.long, device=device)
    with torch.no_grad():
        out = module(ids)
    want = f"({PROBE_ROWS}, {t}, {vocab if vocab is not None else 'vocab'})"
    logits = out[0] if isinstance(out, (tuple, list)) and out else out
    logits = logits_of(logits) if isinstance(logits, torch.Tensor) or hasattr(logits, "logits") else None
    if not isinstance(logits, torch.Tensor):
        got = (f"a {type(out).__name__} whose first item is a {type(out[0]).__name__}"
               if isinstance(out, (tuple, list)) and out else f"a {type(out).__name__}")
        raise ModelError(f"py:{target_of(spec)}: the module returned {got}, not logits; forward(ids) must return "
                         f"the logits tensor (batch, seq, vocab) = {want}, alone, as the first item of a tuple "
                         "(logits, ...) or as .logits")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (PROBE_ROWS, t) or (vocab is not None
                                                                          and logits.shape[2] != vocab):
        last_only = logits.dim() == 3 and tuple(logits.shape[:2]) == (PROBE_ROWS, 1) and t > 1
        hint = ("; it gave logits for the last position only (as nanoGPT's GPT.forward does without targets): "
                "return the logits of every position" if last_only else "")
        raise ModelError(f"py:{target_of(spec)}: ids of shape {tuple(ids.shape)} gave logits of shape "
                         f"{tuple(logits.shape)}; want (batch, seq, vocab) = {want}{hint}")
    return module


def _reads_ahead(spec: Any) -> str:
    """Why the factory's module is no causal LM ('' where it is, or where this cannot tell): built tiny on the CPU
    (TINY_SHAPE, FP32, eval, no grad), the logits before the middle of a sequence must not move when the tokens
    from there on change. One that reads ahead trains a next-token loss on a model that sees the next token: its
    loss falls for nothing (a missing causal mask: ``is_causal=False`` in scaled_dot_product_attention)."""
    import torch

    tiny = spec.replace(**TINY_SHAPE)
    try:
        size = param_count(_make(tiny, "meta", show=False))
    except Exception:  # noqa: BLE001 - not on the meta device: check() built it tiny on the CPU already
        size = 0
    t = min(spec.seq_len, PROBE_SEQ)
    if size > CAUSAL_PROBE_PARAMS or t < 2:
        log.info("py:%s: not checked for reading ahead (%s)", target_of(spec), f"{size:,} parameters at the tiny "
                 "shape" if t >= 2 else f"seq_len {spec.seq_len}")
        return ""
    try:  # only a model that ran and read ahead is refused: one that cannot run here (a GPU-only kernel) is not
        module = _make(tiny, "cpu", show=False).float().eval()
        vocab = _vocab(tiny, module) or 2
        ids = torch.randint(0, vocab, (PROBE_ROWS, t), generator=torch.Generator().manual_seed(0))
        later, half = ids.clone(), t // 2
        later[:, half:] = (later[:, half:] + 1) % vocab  # every token from the middle on changed
        with torch.no_grad():
            before, after = (logits_of(module(x))[:, :half].float() for x in (ids, later))
    except Exception as exc:  # noqa: BLE001
        log.info("py:%s: not checked for reading ahead (tiny on the CPU: %s: %s)", target_of(spec),
                 type(exc).__name__, exc)
        return ""
    moved = (after - before).abs().max().item()
    if moved <= 1e-5 * (1 + before.abs().max().item()):
        return ""
    return (f"the model reads ahead: built tiny on the CPU, its logits at positions 0-{half - 1} moved by up to "
            f"{moved:.3g} when the tokens from position {half} on changed; a causal LM's position t may see only "
            "tokens 0..t (a causal mask, e.g. is_causal=True in scaled_dot_product_attention)")


def target_of(spec: Any) -> str:
    return parse(spec.model).target
