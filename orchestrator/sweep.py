"""Sweep files: load, validate (every error names its key and line), expand into cells.

A sweep file is UTF-8 YAML read with ``yaml.safe_load`` semantics, but numbers as YAML 1.2 reads them (``1e-3`` is
a number and ``0640`` is 640, where YAML 1.1 reads a string and octal 416); nothing in it is ever executed.

    name: seed                # letters, digits, '-', '_' (it becomes a directory under --out)
    grid:                     # lists over any trial spec field; the cartesian product is the cells
      d_model: [768, 1024]
      precision: [bf16, fp8]
      recipe: [delayed, current]
    # grid may also be a list of such mappings: the cells are the union of their products
    # (for sweeps that are not one rectangle, e.g. CUDA graphs only at small sizes)
    search: {...}             # instead of or beside grid: an adaptive search, for the crossover
                              # (orchestrator/crossover.py) or each side's best setting (orchestrator/best.py)
    fixed: {n_layers: 4}      # scalars applied to every cell
    samples: 1                # independent trials per cell (seed + sample)
    resources: {gpu: 1, cpu: 2}
    max_concurrent: null      # at most this many trials at once (default: as resources allow)
    trial_timeout_s: 1800     # a trial running longer (from its start) is killed and recorded as status timeout
    storage: ./juicytalk-results   # local path or a URI pyarrow understands; --out overrides
    launcher: warm            # warm: one process per GPU runs many trials; process: a fresh process per trial
    warm_max_trials: 32       # warm: a trial process is replaced after this many trials
    compile_cache: null       # Inductor/Triton cache directory on each node (default: ~/.cache/juicytalk/compile)
    trackers:                 # optional: where trials show up besides the store (see orchestrator/trackers)
      - mlflow: {tracking_uri: "sqlite:///mlflow.db", experiment: seed}
      - wandb: {project: juicytalk, mode: offline}
      - tensorboard: {}

Cells that make no sense are never run twice under two names: an FP8-only field (recipe,
fp8_format, amax_*) on a non-fp8 cell is collapsed to its default, and fp8 on the torch backend or
a cpu device is skipped, as is a te_layer the cell's model does not take (modules on an hf: model,
transformer_layer on one that is not Llama-family), each listed with its reason. A field given that
means nothing for any cell (compile: true with no compiling backend) is an error; one trial written two
ways (lr 1 and 1.0, batch_size and the tokens_per_step that sizes it) is one cell.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trials.backends import RECIPES, STACKS, fp8_stacks, recipe_owner
from trials.models import ModelError
from trials.models import parse as parse_model
from trials.spec import (SpecError, TrialSpec, applies, check_model, close_matches, default_for, defaults_for,
                         field_default, normalised, scope_words, te_layer_refusal, variant_name)

from .cells import ID_FIELDS_V1, blame, cell_id, cell_values, same_trial, shown, spec_id  # noqa: F401 - ids and
# their words are cells.py's; read from here by the modules that make and name a sweep's cells
from .crossover import parse_search
from .launchers import DEFAULT_LAUNCHER, DEFAULT_WARM_MAX_TRIALS, LAUNCHERS
from .store import storage_problem
from .trackers import TrackerError, check_trackers

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # whole names only (fullmatch: '$' lets a trailing newline in)
NAME_RULE = "a string of letters, digits, '-' and '_' (1-64 characters)"
TOP_KEYS = ("name", "grid", "search", "fixed", "samples", "resources", "max_concurrent", "trial_timeout_s", "storage",
            "launcher", "warm_max_trials", "compile_cache", "trackers")
RESOURCE_KEYS = ("gpu", "cpu")
_DEFAULTS = TrialSpec().to_dict()  # MiniGPT's; defaults_for(values) for a cell of another model source
SINGLE_VALUES = "single values (numbers, strings, true/false, null)"


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``, but numbers as YAML 1.2 (and every user) reads them: ``1e-3`` is a number (YAML 1.1's
    float needs a dot, ``1.0e-3``, so safe_load gives the string '1e-3'), and an integer with leading zeros is
    decimal (YAML 1.1 reads ``0640`` as octal 416, and ``0999`` as a string), and ``1:30`` is the string it reads
    as (YAML 1.1's base 60 makes it 90; a field that wants a number then says so)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int | str:
        digits = str(self.construct_scalar(node)).replace("_", "")
        if ":" in digits:
            return str(self.construct_scalar(node))
        if re.fullmatch(r"[-+]?0[0-9]+", digits):
            return int(digits, 10)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float | str:
        text = str(self.construct_scalar(node))
        return text if ":" in text else super().construct_yaml_float(node)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?0[0-9_]+$"), list("-+0"))
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


class SweepError(ValueError):
    """One problem with a sweep file, naming the key (and the line when YAML gives it)."""

    def __init__(self, key: str, message: str, line: int | None = None, source: str | None = None):
        where = f"{source}" if source else "sweep"
        if line:
            where += f", line {line}"
        super().__init__(" ".join(f"{where}: {key}: {message}".split()))  # one line, whatever a message quotes
        self.key = key
        self.line = line


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a validated spec and its stable id."""

    spec: TrialSpec
    cell_id: str
    label: str


@dataclass
class Sweep:
    name: str
    grids: list[dict[str, list[Any]]]
    fixed: dict[str, Any]
    samples: int = 1
    resources: dict[str, float] = field(default_factory=lambda: {"gpu": 1, "cpu": 1})
    max_concurrent: int | None = None
    trial_timeout_s: float | None = None
    storage: str | None = None
    launcher: str = DEFAULT_LAUNCHER
    warm_max_trials: int = DEFAULT_WARM_MAX_TRIALS
    compile_cache: str | None = None
    trackers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    source_text: str = ""
    search: Any = None  # a search block's plan: CrossoverPlan or orchestrator/best.py's BestPlan
    cells: list[Cell] = field(default_factory=list)
    skipped: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    collapsed: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    # fixed fields that some cells take and others drop (recipe on the bf16 cells beside fp8 ones): key=value, why
    not_applied: list[tuple[str, str]] = field(default_factory=list)


def cell_label(spec: TrialSpec) -> str:
    """[llama-]d768-L4-te-fp8-delayed[-e4m3...][-graphs|-compiled][-fsdp2]: arch, size, variant (as reports
    name it), execution."""
    parts = [] if spec.arch == "gpt" else [spec.arch]
    if spec.model != field_default("model"):  # hf:llama, py:pkg.mod:build; its shape fields where given
        parts.append(spec.model)
    parts += [f"{tag}{value}" for tag, value in (("d", spec.d_model), ("L", spec.n_layers)) if value is not None]
    parts += [variant_name(spec.to_dict())]
    if spec.cuda_graphs:
        parts.append("graphs")
    if spec.compile:
        parts.append("compiled")
    if spec.parallel != "none":
        parts.append(f"{spec.parallel}{spec.world_size}")
    if spec.activation_checkpointing != "none":  # ac-full, ac-selective2 (every 2nd unit)
        every = spec.ac_every if spec.activation_checkpointing == "selective" else ""
        parts.append(f"ac-{spec.activation_checkpointing}{every}")
    return "-".join(parts)


# How a field other than cell_label's own reads in a label when it has to tell cells apart ("b1", "seq512"):
# the field's name unless named here; a bool reads as its name or no-<name>; device and workload as their value.
LABEL_PREFIX = {"batch_size": "b", "grad_accum": "ga", "seq_len": "seq", "n_heads": "h", "n_kv_heads": "kv",
                "vocab": "v", "tokens_per_step": "tok", "train_steps": "steps", "warmup_steps": "warmup",
                "bench_steps": "bench",
                "repeats": "rep", "gen_len": "gen", "prompt_len": "prompt", "device": "", "workload": "",
                "activation_checkpointing": "ac-", "ac_every": "ac-every"}


def _label_part(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return name if value else f"no-{name}"
    return f"{LABEL_PREFIX.get(name, name)}{value}"


def distinct_labels(specs: list[TrialSpec]) -> list[str]:
    """Labels that tell every cell apart: :func:`cell_label`, plus each field that varies among cells whose
    cell_label is the same (a batch size, a sequence length), on every cell of the sweep, in declaration
    order: ``d2048-L4-te-bf16-graphs-b1`` and ``...-b32``. Fields cell_label shows are never repeated."""
    base = [cell_label(s) for s in specs]
    groups: dict[str, list[dict[str, Any]]] = {}
    for label, spec in zip(base, specs):
        groups.setdefault(label, []).append(spec.to_dict())
    varying = {name for group in groups.values() if len(group) > 1 for name in group[0]
               if len({json.dumps(g[name]) for g in group}) > 1}
    extra = [name for name in TrialSpec.field_names() if name in varying]
    return ["-".join([label, *(_label_part(name, getattr(spec, name)) for name in extra)])
            for label, spec in zip(base, specs)]


def _lines(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map each key path to its 1-based line; raise on duplicate keys (safe_load keeps the last silently)."""
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                raise SweepError(".".join(map(str, path + (key,))), "duplicate key", key_node.start_mark.line + 1)
            seen.add(key)
            out[path + (key,)] = key_node.start_mark.line + 1
            _lines(value_node, path + (key,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, path + (i,), out)
    return out


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SweepError("file", f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise SweepError("file", f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save it as UTF-8", line,
                         str(path)) from None
    return parse_sweep(text, source=str(path))


def _not_single(value: Any) -> str | None:
    """What a value that is no single YAML scalar is, in words (a list, a date), or None for one that is."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    if isinstance(value, (list, dict)):
        return f"{value} is a {'list' if isinstance(value, list) else 'mapping'}"
    return f"{value} is a {type(value).__name__} to YAML (quote it for a string)"


def _number(value: Any) -> bool:
    """A finite number (never a bool): NaN and infinity are YAML numbers (.nan, .inf) but no count or time."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mapping(data: dict[str, Any], key: str, err, what: str) -> dict[str, Any]:
    """A top-level mapping: absent or null is empty (a key whose entries are all commented out), anything else
    that is no mapping is refused (``fixed: []``, ``resources: 0`` once read as empty)."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise err((key,), f"must be a mapping of {what}, got {value!r}")
    return value


def parse_sweep(text: str, source: str = "sweep") -> Sweep:
    try:
        root = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SweepError("yaml", str(getattr(exc, "problem", exc)), mark.line + 1 if mark else None, source) from None
    if not isinstance(data, dict) or root is None:
        raise SweepError("file", "must be a YAML mapping with at least 'name' and 'grid' (or 'search')", None, source)
    try:
        lines = _lines(root)
    except SweepError as exc:
        raise SweepError(exc.key, "duplicate key", exc.line, source) from None

    def err(key_path: tuple, message: str) -> SweepError:
        line = lines.get(key_path) or lines.get(key_path[:1])
        return SweepError(".".join(map(str, key_path)), message, line, source)

    for key in data:
        if key not in TOP_KEYS:
            raise err((key,), f"unknown key; allowed: {', '.join(TOP_KEYS)}")
    name = data.get("name")
    if name is None:
        raise err(("name",), "required; letters, digits, '-' and '_' only (1-64 characters)")
    if not isinstance(name, str):  # name: 123, name: on (YAML 1.1's true), name: 1e3
        what = "true/false" if isinstance(name, bool) else "a number" if isinstance(name, (int, float)) else \
            f"a {type(name).__name__}"
        raise err(("name",), f"must be {NAME_RULE}, got {str(name).lower() if isinstance(name, bool) else name} "
                  f"({what} to YAML: quote it)")
    if not NAME_RE.fullmatch(name):
        bad = sorted(set(re.sub(r"[A-Za-z0-9_-]", "", name)))
        what = f"has {' and '.join(repr(c) for c in bad)} in it" if bad else "is not 1-64 characters"
        raise err(("name",), f"{name!r} {what}; it becomes a directory: use letters, digits, '-' and '_' "
                  "only (1-64 characters)")
    grid = data.get("grid")
    grids = [] if grid is None and "search" in data else grid if isinstance(grid, list) else [grid]
    fixed = _mapping(data, "fixed", err, "spec fields to single values")
    fields = set(TrialSpec.field_names())
    if (not grids and "search" not in data) or not all(isinstance(g, dict) and g for g in grids):
        raise err(("grid",), "required (or a search block); a mapping of spec fields to non-empty lists (or a list "
                  "of such mappings)")
    # YAML key paths of the grids, for error lines: grid.<key>, or grid.<i>.<key> when grid is a list
    prefixes = [("grid", gi) if isinstance(grid, list) else ("grid",) for gi in range(len(grids))]
    for prefix, one in zip(prefixes, grids):
        for key, values in one.items():
            if key not in fields:
                raise err(prefix + (key,), f"unknown trial field; allowed: {', '.join(sorted(fields))}")
            if not isinstance(values, list) or not values:
                raise err(prefix + (key,), "must be a non-empty list")
            for value in values:
                if what := _not_single(value):
                    raise err(prefix + (key,), f"must be a non-empty list of {SINGLE_VALUES}; {what}")
            if len({json.dumps(normalised(key, v)) for v in values}) != len(values):  # 1 and 1.0 for lr too
                raise err(prefix + (key,), "has repeated values")
            if key == "recipe":
                for value in values:
                    _check_recipe(value, lambda message: err(prefix + (key,), message))
    for key, value in fixed.items():
        if key not in fields:
            raise err(("fixed", key), f"unknown trial field; allowed: {', '.join(sorted(fields))}")
        if isinstance(value, (list, dict)):
            raise err(("fixed", key), "must be a single value (put lists under grid)")
        if what := _not_single(value):
            raise err(("fixed", key), f"must be one of {SINGLE_VALUES}; {what}")
        if any(key in one for one in grids):
            raise err(("fixed", key), "is also in grid; give it in one place")
        if key == "recipe":
            _check_recipe(value, lambda message: err(("fixed", key), message))

    samples = data.get("samples", 1)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise err(("samples",), "must be a positive integer")
    resources = {"gpu": 1, "cpu": 1}
    given = _mapping(data, "resources", err, "gpu and/or cpu to numbers")
    for key, value in given.items():
        if key not in RESOURCE_KEYS:
            raise err(("resources", key), f"unknown resource; allowed: {', '.join(RESOURCE_KEYS)}")
        if not _number(value) or value < 0:
            raise err(("resources", key), f"must be a finite number >= 0, got {value}")
        if key == "gpu" and value != int(value):
            raise err(("resources", "gpu"), "must be a whole number: fractional GPUs share a device and "
                      "make every timing wrong")
        if key == "gpu" and value > 1:  # a trial spans one GPU: more would sit idle beside a one-GPU number
            raise err(("resources", "gpu"), f"must be 0 or 1: a trial runs on one GPU, so gpu: {value:g} would "
                      "hold the others idle while its record looks like a multi-GPU result")
        resources[key] = int(value) if key == "gpu" else value
    if resources["cpu"] <= 0:
        raise err(("resources", "cpu"), "must be > 0")
    max_concurrent = data.get("max_concurrent")
    if max_concurrent is not None and (not isinstance(max_concurrent, int) or isinstance(max_concurrent, bool)
                                       or max_concurrent < 1):
        raise err(("max_concurrent",), "must be a positive integer or null")
    timeout = data.get("trial_timeout_s")
    if timeout is not None and (not _number(timeout) or timeout <= 0):
        raise err(("trial_timeout_s",), f"must be a positive finite number of seconds or null (no limit), got "
                  f"{timeout}")
    storage = data.get("storage")
    if storage is not None and (not isinstance(storage, str) or not storage.strip()):
        raise err(("storage",), "must be a path or URI string")
    if storage is not None and (why := storage_problem(storage)):
        raise err(("storage",), why)

    launcher = data.get("launcher", DEFAULT_LAUNCHER)
    if not isinstance(launcher, str) or launcher not in LAUNCHERS:
        raise err(("launcher",), f"must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    warm_max = data.get("warm_max_trials", DEFAULT_WARM_MAX_TRIALS)
    if not isinstance(warm_max, int) or isinstance(warm_max, bool) or warm_max < 1:
        raise err(("warm_max_trials",), "must be a positive integer")
    compile_cache = data.get("compile_cache")
    if compile_cache is not None and (not isinstance(compile_cache, str) or not compile_cache.strip()):
        raise err(("compile_cache",), "must be a directory path or null")

    try:
        trackers = check_trackers(data.get("trackers"))
    except TrackerError as exc:
        path = tuple(int(p) if p.isdigit() else p for p in exc.key.split("."))
        raise err(path, str(exc)) from None

    search = _search(data["search"], err, fixed, samples) if "search" in data else None
    sweep = Sweep(name=name, grids=grids, fixed=fixed, samples=samples, resources=resources, search=search,
                  max_concurrent=max_concurrent, trial_timeout_s=timeout, storage=storage, launcher=launcher,
                  warm_max_trials=warm_max, compile_cache=compile_cache, trackers=trackers, source_text=text)
    _expand(sweep, prefixes, err)
    return sweep


FINDS = ("crossover", "best")  # what a search block finds: orchestrator/crossover.py, orchestrator/best.py


def _search(block: Any, err, fixed: dict[str, Any], samples: int) -> Any:
    """The plan of a ``search:`` block, by what it finds."""
    if not isinstance(block, dict):
        raise err(("search",), f"must be a mapping with find ({' or '.join(FINDS)}) and that search's keys "
                  "(docs/guide/sweep-files.md)")
    if "find" not in block:
        raise err(("search", "find"), f"required: {' or '.join(FINDS)}")
    if block["find"] not in FINDS:
        raise err(("search", "find"), f"must be one of {', '.join(FINDS)}; got {block['find']!r}")
    if block["find"] == "best":
        from .best import parse_best  # it makes its cells with this module's rules

        return parse_best(block, err, fixed, samples)
    return parse_search(block, err, fixed, samples)


def _check_recipe(value: Any, err) -> None:
    """A recipe no stack has is a typo, not a cell to skip: one line with the close matches."""
    if value not in RECIPES:
        by_stack = "; ".join(f"{s.name}: {', '.join(s.recipes)}" for s in STACKS.values() if s.recipes)
        raise err(f"{value!r} is no stack's FP8 recipe{close_matches(value, RECIPES)}; recipes are {by_stack}")


def _skip_reason(cell: dict[str, Any], asked: dict[str, Any]) -> str | None:
    """Why a grid combination names no cell (a stack without that FP8 recipe, ...), or None.

    Only combinations the grid made are skipped; the same mismatch written in ``fixed`` alone is the
    spec's one-line error.
    """
    stack = STACKS.get(cell["backend"])
    try:
        source = parse_model(str(cell["model"])).source
    except ModelError:
        source = None  # the spec's own one-line error says why
    if (source is not None and stack is not None and stack.name not in source.stacks
            and {"model", "backend"} & set(asked)):
        return f"backend {stack.name} does not build model {cell['model']} (trials/models)"
    if (source is not None and {"model", "te_layer"} & set(asked) and applies("te_layer", cell)
            and cell["te_layer"] not in source.te_layers):
        return f"te_layer {cell['te_layer']} does not apply to model {cell['model']} (it takes " \
               f"{' or '.join(source.te_layers)})"
    if cell["precision"] == "fp8":
        fp8 = stack or STACKS["te"]
        if not fp8.recipes:
            return f"fp8 needs backend {' or '.join(fp8_stacks())}; {cell['backend']} has no FP8 path"
        if cell["recipe"] not in fp8.recipes and ({"recipe", "backend"} & set(asked)):
            return f"recipe {cell['recipe']} is a {recipe_owner(cell['recipe'])} recipe, not {fp8.name}'s"
        if cell["device"] == "cpu" and fp8.needs_cuda:
            return f"fp8 on {fp8.name} needs a CUDA device"
    return None


def _meaningful(dropped: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The dropped fields whose value was not the cell's default anyway (compile: false on te drops nothing)."""
    return {k: v for k, v in dropped.items() if v != default_for(k, values)}


def _why_not_applied(name: str, value: Any, values: dict[str, Any]) -> str:
    """Why a field means nothing for a cell: the spec's own refusal of it there (compile: true on te), else its
    scope (fp8_format is for te's fp8 cells, which no spec rule refuses: a default cell just runs without it)."""
    try:
        TrialSpec.from_dict({**values, name: value})
    except SpecError as exc:
        if exc.field == name:
            return str(exc)
    return f"it means something for {scope_words(name)} only"


@dataclass
class _Uses:
    """Where one field the user wrote means something: cells that take it, and those that drop it (id -> label)."""

    taken: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    example: dict[str, Any] = field(default_factory=dict)  # the values of a cell that drops it, for the reason

    def note(self, taken: bool, cid: str, label: str, values: dict[str, Any]) -> None:
        if taken:
            self.taken += 1
        else:
            self.dropped.setdefault(cid, label)
            self.example = self.example or values


def _expand(sweep: Sweep, prefixes: list[tuple], err) -> None:
    first: dict[str, dict[str, Any]] = {}  # same_trial -> the grid values of the cell that runs it
    fixed_uses = {k: _Uses() for k in sweep.fixed}
    for prefix, grid in zip(prefixes, sweep.grids):
        keys = list(grid)
        skipped = []
        grid_uses = {k: _Uses() for k in keys}
        for combo in itertools.product(*(grid[k] for k in keys)):
            asked = dict(zip(keys, combo))
            written = {**sweep.fixed, **asked}
            why = _skip_reason({**defaults_for(written), **written}, asked)
            if why:
                skipped.append((asked, why))
                continue
            values, dropped = cell_values(written)
            try:
                spec = TrialSpec.from_dict(values)
                if {"model", "te_layer"} & set(asked) and (why := te_layer_refusal(spec)):
                    skipped.append((asked, f"te_layer {why}"))  # transformer_layer on a model it cannot convert
                    continue
                check_model(spec)  # an hf: or py: model that cannot be built: one line, before Ray
            except SpecError as exc:
                blamed = blame(exc, [(("grid",), asked), (("fixed",), sweep.fixed)], values)
                place = (prefix + blamed[1:] if blamed[0] == "grid" else blamed) if blamed else prefix
                raise err(place, f"{exc} (in cell {shown(asked)})") from None
            cid, label, dropped = cell_id(spec), cell_label(spec), _meaningful(dropped, values)
            for name in written:
                if name in values or name in dropped:  # a default dropped is neither
                    uses = grid_uses[name] if name in asked else fixed_uses[name]
                    uses.note(name in values, cid, label, values)
            trial = same_trial(spec)
            if trial in first:
                twin = first[trial]
                moot = {k: v for k, v in asked.items() if values.get(k, _DEFAULTS.get(k)) != v}
                sweep.collapsed.append((asked, f"{label} appears more than once"
                                        + (f" ({shown(moot)} means nothing for this cell)" if moot else
                                           f" (the same trial as {shown(twin)})" if twin != asked else "")
                                        + "; it runs once"))
                continue
            first[trial] = asked
            sweep.cells.append(Cell(spec=spec, cell_id=cid, label=label))
        if skipped and len(skipped) == len(list(itertools.product(*grid.values()))):
            # every combination of this grid names no cell: the grid asks for nothing runnable (a te recipe on
            # torchao, fp8 on torch, transformer_layer on a model it cannot convert); skipping all of it quietly
            # would run 0 trials and exit 0
            raise err(prefix, f"leaves no cell to run: {shown(skipped[0][0])}: {skipped[0][1]}"
                      + (f" (and {len(skipped) - 1} more combinations like it)" if len(skipped) > 1 else ""))
        sweep.skipped.extend(skipped)
        for name, uses in grid_uses.items():
            _refuse_unused(uses, prefix + (name,), name, grid[name], skipped, err)
    if sweep.search is None:  # a search's cells take fixed fields too (orchestrator/crossover.py judges those)
        for name, uses in fixed_uses.items():
            _refuse_unused(uses, ("fixed", name), name, [sweep.fixed[name]], sweep.skipped, err)
            if uses.taken and uses.dropped:
                labels = list(uses.dropped.values())
                sweep.not_applied.append((f"fixed.{shown({name: sweep.fixed[name]})}", (
                    f"means nothing for {len(labels)} of {len(sweep.cells)} cells ({', '.join(labels[:3])}"
                    f"{', ...' if len(labels) > 3 else ''}): they run without it; {scope_words(name)} take it")))
    _check_sample_seeds(sweep, prefixes, err)
    labels = distinct_labels([c.spec for c in sweep.cells])
    sweep.cells[:] = [Cell(spec=c.spec, cell_id=c.cell_id, label=label) for c, label in zip(sweep.cells, labels)]


def _refuse_unused(uses: _Uses, place: tuple, name: str, given: list[Any], skipped: list, err) -> None:
    """A field given that means nothing for any cell is a mistake, never a silent default (compile: true where no
    cell compiles, fp8_format: e4m3 on bf16 cells): one line, with the spec's own reason where it has one, and the
    first skipped combination where the cells that would take it were skipped (recipe current on torchao)."""
    if uses.dropped and not uses.taken:
        value = next((v for v in given if v != default_for(name, uses.example)), given[0])
        also = f" (and {len(skipped)} combinations are skipped, e.g. {shown(skipped[0][0])}: {skipped[0][1]})" \
            if skipped else ""
        raise err(place, f"{shown({name: value})} means nothing for any cell of this sweep: "
                  f"{_why_not_applied(name, value, uses.example)}{also}")


def _check_sample_seeds(sweep: Sweep, prefixes: list[tuple], err) -> None:
    """Sample k of a cell runs seed + k: two cells alike but for seeds closer than ``samples`` would run one trial
    under two keys (seeds 1234 and 1235, samples 2: 1234's sample 1 is 1235's sample 0). Refused, not re-seeded:
    every stored sample keeps its seed."""
    if sweep.samples < 2:
        return
    alike: dict[str, list[int]] = {}
    for cell in sweep.cells:
        alike.setdefault(same_trial(cell.spec, ignoring=("seed",)), []).append(cell.spec.seed)
    for seeds in alike.values():
        seeds.sort()
        for a, b in zip(seeds, seeds[1:]):
            if b - a < sweep.samples:
                place = next((p + ("seed",) for p, g in zip(prefixes, sweep.grids) if "seed" in g), ("seed",))
                raise err(place, f"seeds {a} and {b} are closer than samples: {sweep.samples} (sample k runs seed + "
                          f"k, so seed {a}'s sample {b - a} is seed {b}'s sample 0: one trial under two keys); space "
                          f"them at least {sweep.samples} apart")
