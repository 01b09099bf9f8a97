"""The best-against-best search: each side's fastest setting at one global batch, and the fastest FP8 side's
against the fastest BF16 side's (no Ray here).

    search:
      find: best
      sides:                        # what is compared: each a mapping of trial fields, or `every` (each stack
        - {backend: te, precision: fp8, recipe: delayed}    # the model's source builds, in BF16 and in FP8)
        - {backend: torch, precision: bf16}
      global_batch: 2048            # tokens per optimizer step, all ranks: the same in every cell
      over:                         # the settings searched; each side searches those it takes (default: SEARCHED)
        batch_size: [2, 4, 8]       # the micro-batch; grad_accum makes up the global batch
        activation_checkpointing: [none, selective, full]
        compile: [false, true]
      fixed: {n_layers: 4}
      finalists: 3                  # cells of a side timed in full after the screen
      max_samples: 5                # a winner within noise of a timed cell gets samples up to this (default: samples)
      max_trials: 200               # every (cell, sample) it uses, screens included; default: all it can need

Each side is searched by successive halving in two rungs, not by a model of the axes' effects: the axes
interact where it matters (checkpointing pays only through the micro-batch it lets fit; CUDA graphs and compile
most where a small micro-batch leaves the step launch-bound), so a model additive in them mispredicts the very
cells that win, and the search must give the grid's answer. Rung one screens every cell of the side with a short
schedule (:data:`SCREEN`); rung two times the side's ``finalists`` fastest screens with the sweep's own schedule,
``samples`` each. More rungs would each pay a trial's fixed cost again (build, compile, graph capture): most of
what a screen costs. Two rules keep a screen from deciding alone: a cell whose screen, scaled by the timed cells'
full/screen ratio less twice that ratio's spread, could beat the winner is timed in full too; and, where
``max_samples`` is over ``samples``, a winner whose interval against another timed cell holds 1 gets more samples,
both, up to it (what still holds 1 is a runner-up within noise). Those defaults (3 finalists, no more samples than
the grid's) found each side's grid best in a recorded CPU grid replayed with noise for about a quarter of its
CPU-seconds (benchmarks/best_vs_grid.py); more samples there matched the grid less (its answer rests on
``samples`` each) and cost more.

A cell the memory plan puts over its error margin (orchestrator/plan.py's ``will_not_fit``) is never run: it is
counted, with the margin, in the answer. A cell that runs and records ``oom`` says "does not fit"; one
unsupported here, or that ran another precision than it asks, is out with its reason; a failure (error,
timeout) is out for this run and runs again in the next, as a grid's does. Every decision follows from the
records alone (a screen is a cell at the screen schedule, a full timing the cell at the sweep's), so records
found from a grid count and a rerun resumes.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from trials.models import ModelError
from trials.models import parse as parse_model
from trials.spec import (ACTIVATION_CHECKPOINTING, PRECISIONS, SpecError, TrialSpec, applies, check_model, defaults_for, field_default,
                         scope_words, spec_field_types, te_layer_refusal, variant_name)
from trials.backends import STACKS
from trials.typecheck import WANTED, matches

from .answer import BestAnswer, Contender, SideBest
from .cells import blame, cell_id, cell_values, same_trial, shown
from .crossover import MIN_SAMPLES, RESAMPLES, SEED, Decision, Outcome
from .report.analysis import bootstrap_median, bootstrap_ratio

KEYS = ("find", "sides", "global_batch", "over", "fixed", "finalists", "max_samples", "max_trials")
# The settings that decide a step's speed at a fixed global batch, in the order a setting is shown. batch_size is
# the micro-batch (grad_accum follows from it); ac_every and recipe are searched only where the file lists them
# (each multiplies a side's cells, and a side names its recipe), the others by default at every value they take.
SEARCHED = ("batch_size", "activation_checkpointing", "ac_every", "compile", "te_layer", "recipe", "cuda_graphs")
SET_BY_GLOBAL_BATCH = ("batch_size", "grad_accum", "tokens_per_step")
ONE_SHAPE = ("seq_len", "world_size")  # what splits the global batch into rows per rank: every side's the same
# The screen: a cell timed briefly (each field at most this, the sweep's value where that is less), no profile and
# no per-layer FP8 reads: about a trial's fixed cost (start, build, compile), which every rung pays again.
SCREEN = {"train_steps": 1, "warmup_steps": 3, "bench_steps": 10, "repeats": 1, "profile": False, "fp8_reads": False}
FINALISTS = 3
PROMOTE_SDS = 2.0  # how far (in sds of the log full/screen ratio) a screen may have misled: see Halving._side
EVERY = "every"
SCREENED, FULL = "screen", "full"


@dataclass(frozen=True)
class Setting:
    """One cell of a side: what it runs at the sweep's schedule (``spec``) and at the screen's (``screen``)."""

    spec: TrialSpec
    screen: TrialSpec
    shown: dict[str, Any]  # the searched settings as the cell runs them (batch_size, grad_accum first)

    @property
    def text(self) -> str:
        return shown(self.shown)


@dataclass(frozen=True)
class Side:
    label: str  # its variant name (a side that searches the recipe is named without one)
    written: dict[str, Any]
    precision: str
    cells: tuple[Setting, ...]
    invalid: int = 0  # combinations that name no cell (cuda_graphs with checkpointing, a recipe of another stack)
    unfit: tuple[tuple[str, str], ...] = ()  # (setting, why) of the cells the memory plan says will not fit


@dataclass(frozen=True)
class BestPlan:
    sides: tuple[Side, ...]
    global_batch: int
    rows: int  # rows per rank per optimizer step: global_batch / (seq_len x world_size)
    over: dict[str, tuple[Any, ...]]  # the axes searched and their values
    fixed: dict[str, Any]  # the sweep's fixed values with the search's own over them
    samples: int
    max_samples: int
    finalists: int
    max_trials: int
    gpu_memory_bytes: int | None = None  # what the memory plan was held against (None: not checked)
    fit_margin: float | None = None

    @property
    def screen_is_full(self) -> bool:
        """The sweep's own schedule is no longer than the screen's: a cell's screen is its first full sample."""
        cell = next((cell for side in self.sides for cell in side.cells), None)
        return cell is not None and cell.spec == cell.screen

    # -- what the search (orchestrator/search.py) asks of a plan -------------------------------------
    def wheres(self) -> list[tuple[int, int, str]]:
        """Every (side, cell, phase) the search may run; a phase is a schedule: the screen's or the sweep's."""
        phases = (FULL,) if self.screen_is_full else (SCREENED, FULL)
        return [(s, i, p) for s, side in enumerate(self.sides) for i in range(len(side.cells)) for p in phases]

    def spec(self, s: int, i: int, phase: str) -> TrialSpec:
        cell = self.sides[s].cells[i]
        return cell.screen if phase == SCREENED else cell.spec

    def state(self) -> "Halving":
        return Halving(self)

    def describe(self, trial: tuple) -> str:
        s, i, phase, sample = trial
        return f"{self.sides[s].label} {phase} {self.sides[s].cells[i].text}, sample {sample}"

    def summary(self) -> str:
        """The dry run's line: what is searched, and what the memory plan left out."""
        cells = sum(len(side.cells) for side in self.sides)
        unfit = sum(len(side.unfit) for side in self.sides)
        parts = [f"{side.label} ({len(side.cells)} cells)" for side in self.sides]
        return (f"search: the fastest setting of {', '.join(parts)} at {self.global_batch} tokens per optimizer step "
                f"over {', '.join(self.over)}; {cells} cells screened, the {self.finalists} fastest of each side timed "
                f"in full ({self.samples}-{self.max_samples} samples), up to {self.max_trials} trials"
                + (f"; {unfit} cells skipped: the memory plan says they will not fit" if unfit else ""))

    # -- the memory plan ------------------------------------------------------------------------
    def specs(self) -> list[TrialSpec]:
        """Every cell's spec at the sweep's schedule: what the memory plan is asked about."""
        return [cell.spec for side in self.sides for cell in side.cells]

    def without(self, unfit: dict[str, str], gpu_memory_bytes: int | None, margin: float) -> "BestPlan":
        """This plan less the cells ``unfit`` names (cell id -> why: those a real sweep refuses as not fitting,
        orchestrator/plan.py's ``will_not_fit``), each counted on its side; ``gpu_memory_bytes`` and ``margin``: what
        a GPU cell was held against."""
        sides = []
        for side in self.sides:
            ids = [cell_id(c.spec) for c in side.cells]
            sides.append(replace(side, cells=tuple(c for c, i in zip(side.cells, ids) if i not in unfit),
                                 unfit=side.unfit + tuple((c.text, unfit[i]) for c, i in zip(side.cells, ids)
                                                          if i in unfit)))
        return replace(self, sides=tuple(sides), gpu_memory_bytes=gpu_memory_bytes, fit_margin=margin)

    @property
    def candidate(self) -> str:
        """The precision whose best is judged against the others' best: the lowest the sides run (fp8, else bf16)."""
        return lowest(side.precision for side in self.sides)

    def refusal(self) -> str | None:
        """One line when the memory plan leaves the candidate precision's sides, or the others, no cell to run."""
        for lower in (True, False):
            group = [side for side in self.sides if (side.precision == self.candidate) == lower]
            if group and not any(side.cells for side in group):
                unfit = [u for side in group for u in side.unfit]
                return (f"search.sides: nothing of {', '.join(side.label for side in group)} fits: all {len(unfit)} of "
                        f"its cells will not fit by the memory plan ({unfit[0][0]}: {unfit[0][1]}), so nothing was "
                        "started; --no-fit-check runs them anyway")
        return None


def parse_best(block: dict[str, Any], err: Callable[[tuple, str], Exception], sweep_fixed: dict[str, Any],
               samples: int) -> BestPlan:
    """Validate a sweep's ``search: {find: best, ...}`` block; every problem is ``err(key path, message)``."""
    for key in block:
        if key not in KEYS:
            raise err(("search", key), f"unknown key; allowed: {', '.join(KEYS)}")
    for key in ("sides", "global_batch"):
        if key not in block:
            raise err(("search", key), "required")
    fields = set(TrialSpec.field_names())
    own_fixed = block.get("fixed") or {}
    if not isinstance(own_fixed, dict):
        raise err(("search", "fixed"), "must be a mapping of trial fields to single values")
    _single_values(own_fixed, ("search", "fixed"), fields, err)
    fixed = {**sweep_fixed, **own_fixed}
    written_sides = _sides(block["sides"], fixed, err, fields)
    over, defaulted = _over(block.get("over"), fixed, err)
    for place, values in ((("search", "fixed"), own_fixed), (("fixed",), sweep_fixed)):
        for name in values:
            if name in SET_BY_GLOBAL_BATCH:
                raise err(place + (name,), "is set by search.global_batch (batch_size is the searched micro-batch, "
                          "grad_accum makes up the rest)")
            if name in over and not defaulted:
                raise err(place + (name,), "is searched (search.over); do not also fix it")
    over = {k: v for k, v in over.items() if k not in fixed}  # a default axis the file fixes is not searched

    global_batch = block["global_batch"]
    shape = {name: fixed.get(name, field_default(name)) for name in ONE_SHAPE}
    for name, value in shape.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise err(("search", "fixed", name) if name in own_fixed else ("fixed", name),
                      f"must be a positive integer, got {value!r}")
    per_row = shape["seq_len"] * shape["world_size"]
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1 \
            or global_batch % per_row:
        raise err(("search", "global_batch"), f"must be a positive multiple of seq_len x world_size = {per_row} "
                  f"(tokens per optimizer step, whole rows on every rank), got {global_batch!r}")
    rows = global_batch // per_row
    divisors = tuple(b for b in range(1, rows + 1) if rows % b == 0)
    if "batch_size" in over:
        bad = [b for b in over["batch_size"] if b < 1 or rows % b]
        if bad:
            raise err(("search", "over", "batch_size"), f"{bad[0]} does not divide the global batch's {rows} rows "
                      f"per rank ({global_batch} tokens / seq_len x world_size {per_row}); micro-batches that do: "
                      f"{', '.join(map(str, divisors))}")
    over = {k: over.get(k, divisors) for k in SEARCHED if k in over or k == "batch_size"}  # every micro-batch unless given

    n = max(samples, MIN_SAMPLES)
    finalists = _count(block, "finalists", FINALISTS, 1, err)
    max_samples = _count(block, "max_samples", n, n, err)  # more: samples for close calls (Halving._side)
    sides, places, named = [], [], {}
    for place, written, optional in written_sides:
        side = _side(place, written, fixed, sweep_fixed, own_fixed, over, rows, optional, named, err)
        if side is not None:
            sides.append(side)
            places.append(place)
    if not defaulted:  # a value written that names a cell of no side (a choice misspelt, a recipe of no side's stack)
        for name, values in over.items():
            for value in values:
                if named.get((name, str(value))):
                    raise err(("search", "over", name), f"{shown({name: value})} names no cell of any side: "
                              f"{named[(name, str(value))]}")
    if not sides:
        raise err(("search", "sides"), f"{EVERY}: no stack the model's source builds has a cell here")
    if len({side.precision for side in sides}) < 2:
        raise err(("search", "sides"), f"every side that runs here is {sides[0].precision}: the answer is the best "
                  "setting of the lowest precision (fp8, else bf16) against the best of the others, so give a side "
                  "of another precision")
    owner: dict[str, Side] = {}
    for place, side in zip(places, sides):
        for cell in side.cells:
            other = owner.setdefault(same_trial(cell.spec), side)
            if other is not side:
                raise err(place, f"runs cells of side {other.label} too ({cell.text}) once the defaults are in: "
                          "sides must not overlap; give it a field that differs")
    over = _varied(over, sides, defaulted, err)
    most = sum(len(side.cells) * (1 + max_samples) for side in sides)  # a screen and every sample, every cell
    max_trials = _count(block, "max_trials", most, 2 * MIN_SAMPLES * 2, err)
    return BestPlan(tuple(sides), global_batch, rows, over, fixed, n, max_samples, finalists, max_trials)


def _count(block: dict[str, Any], key: str, default: int, least: int, err) -> int:
    value = block.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise err(("search", key), f"must be an integer >= {least}, got {value!r}")
    return value


def _single_values(values: dict[str, Any], place: tuple, fields: set[str], err) -> None:
    for name, v in values.items():
        if name not in fields:
            raise err(place + (name,), f"unknown trial field; allowed: {', '.join(sorted(fields))}")
        if isinstance(v, (list, dict)):
            raise err(place + (name,), "must be a single value")


def _sides(given: Any, fixed: dict[str, Any], err, fields: set[str]) -> list[tuple[tuple, dict[str, Any], bool]]:
    """(key path, written values, optional) per side: ``every`` is each stack the model's source builds, in BF16 and
    in FP8 (a side of it that names no cell here, te on a CPU, is dropped; one written out is an error)."""
    if given == EVERY:
        try:
            source = parse_model(str(fixed.get("model") or defaults_for(fixed)["model"])).source
        except ModelError as exc:
            raise err(("fixed", "model"), str(exc)) from None
        out = []
        for name in source.stacks:
            if name != "torchao":  # torchao's BF16 is the torch twin's (orchestrator/cells.py)
                out.append((("search", "sides"), {"backend": name, "precision": "bf16"}, True))
            if STACKS[name].recipes:
                out.append((("search", "sides"), {"backend": name, "precision": "fp8",
                                                  "recipe": next(iter(STACKS[name].recipes))}, True))
        return out
    if not isinstance(given, list) or len(given) < 2:
        raise err(("search", "sides"), f"must be a list of at least two mappings of trial fields (or {EVERY}), "
                  "e.g. [{backend: te, precision: fp8}, {backend: torch, precision: bf16}]")
    out = []
    for i, side in enumerate(given):
        place = ("search", "sides", i)
        if not isinstance(side, dict) or not side:
            raise err(place, "is empty: a side names what it runs, e.g. {backend: te, precision: fp8}")
        _single_values(side, place, fields, err)
        for name in side:
            if name in SET_BY_GLOBAL_BATCH:
                raise err(place + (name,), "is set by search.global_batch (batch_size is the searched micro-batch)")
            if name in ONE_SHAPE:
                raise err(place + (name,), "is the same on every side (one global batch of one shape): set it under "
                          "fixed")
        out.append((place, dict(side), False))
    return out


def _over(given: Any, fixed: dict[str, Any], err) -> tuple[dict[str, tuple[Any, ...]], bool]:
    """The axes searched and their values, and whether they are the default (every value of each axis but ac_every
    and recipe; an axis no side varies is then dropped, where one written is an error)."""
    types = spec_field_types()
    if given is None:
        try:
            source = parse_model(str(fixed.get("model") or defaults_for(fixed)["model"])).source
        except ModelError as exc:
            raise err(("fixed", "model"), str(exc)) from None
        values = {"activation_checkpointing": ACTIVATION_CHECKPOINTING, "compile": (False, True),
                  "te_layer": source.te_layers, "cuda_graphs": (False, True)}
        return {k: tuple(values[k]) for k in SEARCHED if k in values}, True
    if not isinstance(given, dict) or not given:
        raise err(("search", "over"), f"must be a mapping of settings to lists of values; settings: {', '.join(SEARCHED)}")
    out = {}
    for name, values in given.items():
        place = ("search", "over", name)
        if name not in SEARCHED:
            raise err(place, f"is no setting the search varies; allowed: {', '.join(SEARCHED)}"
                      + ("; the global batch is search.global_batch" if name in SET_BY_GLOBAL_BATCH[1:] else ""))
        if not isinstance(values, list) or not values:
            raise err(place, "must be a non-empty list of values")
        for v in values:
            if not matches(v, types[name]):
                raise err(place, f"must be a list of {WANTED[types[name]]}, got {v!r}")
        if len(set(map(str, values))) != len(values):
            raise err(place, "has repeated values")
        out[name] = tuple(values)
    return out, False


def _side(place: tuple, written: dict[str, Any], fixed: dict[str, Any], sweep_fixed: dict[str, Any],
          own_fixed: dict[str, Any], over: dict[str, tuple], rows: int, optional: bool,
          named: dict[tuple[str, str], str], err) -> Side | None:
    """One side's cells: every combination of the axes it does not fix, as the grid makes a cell of it
    (orchestrator/cells.py), once each; combinations that name no cell are counted. None where none does and the
    side is optional; an error with the reason where it is written. ``named``: (axis, value) -> '' once a cell of
    any side takes the value, else why none did (kept across sides)."""
    axes = [k for k in over if k not in written]
    specs: dict[str, TrialSpec] = {}
    invalid: dict[str, tuple[SpecError, dict[str, Any]]] = {}  # distinct values that name no cell -> why
    for combo in itertools.product(*(over[k] for k in axes)):
        asked = dict(zip(axes, combo))
        values, _ = cell_values({**fixed, **written, **asked, "grad_accum": rows // asked["batch_size"]})
        try:
            spec = TrialSpec.from_dict(values)
            if "te_layer" in asked and (why := te_layer_refusal(spec)):
                raise SpecError("te_layer", why)
        except SpecError as exc:
            invalid.setdefault(shown(values), (exc, values))
            for pair in asked.items():
                named.setdefault((pair[0], str(pair[1])), str(exc))
            continue
        specs.setdefault(same_trial(spec), spec)  # one trial written two ways is one cell, as in a grid
        named.update({(k, str(v)): "" for k, v in asked.items()})
    if specs:  # an hf: or py: model that cannot be built: one line, before Ray (as the grid's cells)
        first = next(iter(specs.values()))
        try:
            check_model(first)
        except SpecError as exc:
            where = [(place, written), (("search", "fixed"), own_fixed), (("fixed",), sweep_fixed)]
            raise err(blame(exc, where, first.to_dict()) or place, str(exc)) from None
    # a setting shows the axes this side varies (batch_size and grad_accum always: they split the global batch)
    varied = [k for k in axes if len({getattr(spec, k) for spec in specs.values() if applies(k, spec.to_dict())}) > 1]
    cells = {trial: Setting(spec, _screen(spec), _setting(spec, varied)) for trial, spec in specs.items()}
    if not cells:
        if optional:
            return None
        exc, values = next(iter(invalid.values()))
        where = [(place, written), (("search", "fixed"), own_fixed), (("fixed",), sweep_fixed)]
        blamed = blame(exc, where, values) if not any(exc.field == k for k in axes) else None
        raise err(blamed or place, f"{exc} (every cell of side {_label(written, fixed, axes)} is refused so)")
    label = _label(written, fixed, axes)
    return Side(label, written, next(iter(cells.values())).spec.precision, tuple(cells.values()), len(invalid))


def _label(written: dict[str, Any], fixed: dict[str, Any], axes: list[str]) -> str:
    """The side's variant name (trials/spec.py); a side that searches the recipe is named without one."""
    values = cell_values({**fixed, **written})[0]
    values = {**defaults_for(values), **values}
    name = variant_name(values)
    if "recipe" in axes and values.get("precision") == "fp8":
        name = name.replace(f"-fp8-{values['recipe']}", "-fp8", 1)
    return name


def _screen(spec: TrialSpec) -> TrialSpec:
    """The cell at the screen's schedule (:data:`SCREEN`, each field at most the sweep's)."""
    return TrialSpec.from_dict({**spec.to_dict(), **{k: min(v, getattr(spec, k)) for k, v in SCREEN.items()}})


def _setting(spec: TrialSpec, axes: list[str]) -> dict[str, Any]:
    """The searched settings as ``spec`` runs them: the micro-batch and grad_accum, then each searched axis that
    means something for the cell."""
    values = spec.to_dict()
    out = {"batch_size": spec.batch_size, "grad_accum": spec.grad_accum}
    for name in SEARCHED[1:]:
        if name in axes and applies(name, values):
            out[name] = values[name]
    return out


def _varied(over: dict[str, tuple], sides: list[Side], defaulted: bool, err) -> dict[str, tuple]:
    """The axes that some side's cells take two values of; a written one that none does is an error."""
    out = {}
    for name, values in over.items():
        taken = {side.label: {getattr(c.spec, name) for c in side.cells if applies(name, c.spec.to_dict())}
                 for side in sides}
        if any(len(v) > 1 for v in taken.values()):
            out[name] = values
        elif not defaulted:
            ran = {v for vs in taken.values() for v in vs}
            why = (f"it means something for {scope_words(name)} only" if not ran else
                   f"every side that takes it runs {shown({name: next(iter(ran))})} (the other values name no cell)")
            raise err(("search", "over", name), f"no side can vary it ({', '.join(taken)}): {why}; fix it under "
                      "fixed, or search it with a side that takes it")
    return out


# ---------------------------------------------------------------------------------------------------------------
# The search's state
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Cell:
    """What the records say of one cell of a side."""

    screen: float | None = None  # its screen's time (ms), else the median of its full samples so far
    screened: bool = False  # the screen value is a screen's, not full samples'
    full: list[Outcome] = field(default_factory=list)  # its full samples 0, 1, ... as far as they go
    out: str = ""  # why it is out of the contest ("" while in)
    oom: bool = False


class Halving:
    """The search's state: what each (side, cell, phase, sample) gave; what to run next follows from it alone."""

    def __init__(self, plan: BestPlan):
        self.plan = plan
        self.seen: dict[tuple[int, int, str, int], Outcome] = {}

    def observe(self, s: int, i: int, phase: str, sample: int, outcome: Outcome) -> None:
        self.seen[(s, i, phase, sample)] = outcome

    def decide(self, pending: set[tuple] = frozenset()) -> Decision:
        """The trials needed now (every side's at once: they run side by side), or the answer. ``pending``: trials
        running (they count against the budget)."""
        need, results = [], []
        for s in range(len(self.plan.sides)):
            got = self._side(s)
            if isinstance(got, list):
                need += got
            else:
                results.append(got)
        if not need:
            return Decision([], self._answer(results))
        fresh = [t for t in need if t not in pending]
        room = self.plan.max_trials - len(set(self.seen) | set(pending))
        if fresh and room <= 0 and not pending:
            return Decision([], self._answer(self._so_far(), f"stopped at max_trials={self.plan.max_trials} "
                                                             "before the search ended"))
        return Decision(fresh[:max(room, 0)])

    # -- one side ---------------------------------------------------------------------------------------
    def _cells(self, s: int) -> list[_Cell]:
        plan, side = self.plan, self.plan.sides[s]
        out = []
        for i, setting in enumerate(side.cells):
            cell, k = _Cell(), 0
            while (s, i, FULL, k) in self.seen:
                cell.full.append(self.seen[(s, i, FULL, k)])
                k += 1
            screen = None if plan.screen_is_full else self.seen.get((s, i, SCREENED, 0))
            for o in ([screen] if screen else []) + cell.full:
                if o.status != "ok" or o.ms is None:
                    cell.oom = o.status == "oom"
                    cell.out = "oom" if cell.oom else f"{o.status}: {o.error}"[:300]
                    break
                if o.precision not in (None, setting.spec.precision):  # an FP8 cell that converted nothing ran BF16
                    cell.out = f"ran {o.precision}, not the {setting.spec.precision} asked (effective_precision)"
                    break
            if screen is not None:
                cell.screen, cell.screened = screen.ms, True
            elif cell.full and not cell.out:
                cell.screen = statistics.median(o.ms for o in cell.full)
            out.append(cell)
        return out

    def _side(self, s: int) -> list[tuple] | SideBest:
        """The trials side ``s`` needs next, or its result."""
        plan = self.plan
        cells = self._cells(s)
        first = (FULL, 0) if plan.screen_is_full else (SCREENED, 0)
        need = [(s, i, *first) for i, c in enumerate(cells) if c.screen is None and not c.out]
        if need:
            return need
        live = [i for i, c in enumerate(cells) if not c.out]
        times = {i: [o.ms for o in cells[i].full] for i in live}
        # how a cell's full time relates to its screen, where both are known: ranks a cell known only by full
        # samples (found from a grid) among screened ones, and bounds what a screen may hide
        ratios = [statistics.median(times[i]) / cells[i].screen for i in live if cells[i].screened and times[i]]
        scale = statistics.median(ratios) if ratios else 1.0
        rank = {i: cells[i].screen if cells[i].screened else cells[i].screen / scale for i in live}
        ordered = sorted(live, key=lambda i: (rank[i], i))
        contest = set(ordered[:plan.finalists]) | {i for i in live if len(times[i]) >= plan.samples}
        need = [(s, i, FULL, k) for i in sorted(contest) for k in range(len(times[i]), plan.samples)]
        if need or not contest:
            return need or self._result(s, cells, None, {})
        medians = {i: statistics.median(times[i]) for i in contest}
        best = min(contest, key=lambda i: (medians[i], i))
        # a cell out of the contest that could still beat the winner: its screen times the full/screen ratio, less
        # PROMOTE_SDS of that ratio's spread over the timed cells (none while fewer than two say): timed in full too.
        # Where screens order cells as full timings do, the spread is nil and nothing is promoted.
        spread = statistics.stdev(math.log(r) for r in ratios) if len(ratios) > 1 else 0.0
        promoted = [i for i in ordered if i not in contest
                    and rank[i] * scale * math.exp(-PROMOTE_SDS * spread) < medians[best]]
        if promoted:
            return [(s, i, FULL, k) for i in promoted for k in range(len(times[i]), plan.samples)]
        rng = np.random.default_rng(SEED)
        noise = {i: bootstrap_ratio(times[i], times[best], RESAMPLES, rng) for i in sorted(contest) if i != best}
        close = sorted(i for i, (lo, hi) in noise.items() if lo <= 1.0 <= hi)
        more = [(s, i, FULL, len(times[i])) for i in ([best] if close else []) + close
                if len(times[i]) < plan.max_samples]
        return more or self._result(s, cells, best, noise)

    def _result(self, s: int, cells: list[_Cell], best: int | None, noise: dict[int, tuple[float, float]]) -> SideBest:
        plan, side = self.plan, self.plan.sides[s]
        timed = []
        for i, c in enumerate(cells):
            if c.full and not c.out:
                lo, hi = noise.get(i, (None, None))
                timed.append(Contender(side.cells[i].text, side.cells[i].shown, cell_id(side.cells[i].spec),
                                       [o.ms for o in c.full], lo, hi,
                                       any(o.launch_bound for o in c.full)))
        timed.sort(key=lambda c: c.median_ms)
        winner = next((c for c in timed if best is not None and c.setting == side.cells[best].text), None)
        ms_low = ms_high = None
        if winner is not None:  # on log times, as every time interval here: it stays positive
            lo, hi = bootstrap_median(np.log(winner.ms).tolist(), RESAMPLES, np.random.default_rng(SEED))
            ms_low, ms_high = math.exp(lo), math.exp(hi)
        outs = [c.out for c in cells if c.out and not c.oom]
        why = "" if winner is not None else "no cell to run" if not side.cells else \
            "no cell ran to the end: " + "; ".join(sorted(set(outs)) or ["every cell ran out of memory"])
        return SideBest(side.label, side.precision, winner, timed, why[:500], ms_low, ms_high,
                        screened=sum(1 for c in cells if c.screen is not None or c.out),
                        does_not_fit=sum(1 for c in cells if c.oom), out=sorted(set(outs)), invalid=side.invalid,
                        unfit=len(side.unfit))

    def _so_far(self) -> list[SideBest]:
        """Each side's result, or what it knows so far where it needs more trials."""
        out = []
        for s in range(len(self.plan.sides)):
            got = self._side(s)
            out.append(got if isinstance(got, SideBest) else self._result(s, self._cells(s), None, {}))
        return out

    # -- the answer -------------------------------------------------------------------------------------
    def partial(self) -> BestAnswer:
        """What is known so far, for an interrupted search."""
        answer = self._answer(self._so_far(), "search not finished (interrupted); rerun the same command to resume")
        answer.done = False
        return answer

    def _answer(self, sides: list[SideBest], stopped: str = "") -> BestAnswer:
        plan = self.plan
        grid_trials, grid_s = self._grid()
        answer = BestAnswer(False, "", plan.global_batch, sides, trials=len(self.seen),
                            gpu_seconds=sum(o.wall_s for o in self.seen.values()), grid_trials=grid_trials,
                            grid_gpu_seconds=grid_s, device=next((o.gpu_name for o in self.seen.values()
                                                                  if o.gpu_name), ""),
                            unfit=sum(s.unfit for s in sides), fit_margin=plan.fit_margin,
                            gpu_memory_gib=plan.gpu_memory_bytes / 2**30 if plan.gpu_memory_bytes else None)
        low = _fastest([s for s in sides if s.precision == plan.candidate])
        high = _fastest([s for s in sides if s.precision != plan.candidate])
        answer.precision = plan.candidate
        if low is not None and high is not None and not stopped:
            answer.found, answer.candidate, answer.reference = True, low.label, high.label
            answer.speedup = high.winner.median_ms / low.winner.median_ms
            answer.ci_low, answer.ci_high = bootstrap_ratio(high.winner.ms, low.winner.ms, RESAMPLES,
                                                            np.random.default_rng(SEED))
        answer.statement = _statement(answer, low, high, stopped)
        return answer

    def _grid(self) -> tuple[int, float | None]:
        """The exhaustive grid of this plan (every cell that may fit, ``samples`` each, at the sweep's schedule): its
        trials, and its GPU-seconds estimated from the walls seen: a cell's own full trials, else its screen's times
        the median full/screen wall ratio of the cells that have both, else the median full trial's; None before any
        full trial."""
        plan, walls = self.plan, {}
        for (s, i, phase, _), o in self.seen.items():
            walls.setdefault((s, i, phase), []).append(o.wall_s)
        wall = {k: statistics.median(v) for k, v in walls.items()}
        factor = statistics.median([wall[(s, i, FULL)] / wall[(s, i, SCREENED)] for s, i, p in wall
                                    if p == FULL and wall.get((s, i, SCREENED))] or [float("nan")])
        trials = sum(len(side.cells) for side in plan.sides) * plan.samples
        fulls = [v for (_, _, p), v in wall.items() if p == FULL]
        if not fulls:
            return trials, None
        total = 0.0
        for s, side in enumerate(plan.sides):
            for i in range(len(side.cells)):
                one = wall.get((s, i, FULL))
                if one is None and (s, i, SCREENED) in wall and factor == factor:
                    one = wall[(s, i, SCREENED)] * factor
                total += (statistics.median(fulls) if one is None else one) * plan.samples
        return trials, total


def _fastest(sides: list[SideBest]) -> SideBest | None:
    found = [s for s in sides if s.winner is not None]
    return min(found, key=lambda s: s.winner.median_ms) if found else None


def lowest(precisions: Any) -> str:
    """The lowest of these precisions (trials/spec.py's PRECISIONS run from highest to lowest)."""
    return max(precisions, key=PRECISIONS.index)


def _statement(answer: BestAnswer, low: SideBest | None, high: SideBest | None, stopped: str) -> str:
    """At N tokens per optimizer step, the candidate's fastest side: rate [interval] (setting), against the others'
    fastest: its rate; the speedup [interval]; trials and GPU-minutes against the grid's."""
    def rate(side: SideBest) -> str:
        r, lo, hi = answer.tokens_per_s(side)
        return f"{side.label} {r:,.0f} tokens/s [{lo:,.0f}, {hi:,.0f}] ({side.winner.setting})"

    head = f"at {answer.global_batch} tokens per optimizer step, "
    if answer.found:
        head += (f"{rate(low)} against {rate(high)}: {answer.precision.upper()} {answer.speedup:.2f}x "
                 f"[{answer.ci_low:.2f}, {answer.ci_high:.2f}]")
    else:
        missing = [s for s in answer.sides if s.winner is None]
        head += stopped or "; ".join(f"{s.label}: {s.why}" for s in missing) or "no answer"
        found = [rate(s) for s in answer.sides if s.winner is not None]
        head += ("; so far " + ", ".join(found)) if found and stopped else ""
    unit = "GPU" if answer.device else "CPU"
    head += (f" on {answer.device}" if answer.device else "") + f"; {answer.trials} trials, " \
        f"{answer.gpu_seconds / 60:.1f} {unit}-minutes"
    if answer.grid_gpu_seconds:
        head += f" (the exhaustive grid: {answer.grid_trials} trials, ~{answer.grid_gpu_seconds / 60:.1f} {unit}-minutes)"
    if answer.unfit:
        head += f"; {answer.unfit} cells never run: the memory plan says they will not fit"
    return head
