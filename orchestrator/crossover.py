"""The crossover search: which cells to probe next, from the records so far (no Ray here).

    search:
      find: crossover             # the smallest value of `over` where `variant` beats `baseline`
      variant: {backend: te, precision: fp8, recipe: delayed}
      baseline: {backend: te, precision: bf16}
      target: 1.10                # the speedup whose 95% interval must lie above it
      over: {d_model: [512, 8192], step: 256}   # or n_layers, tokens_per_step, ffn
      fixed: {n_layers: 4, cuda_graphs: true}
      max_trials: 40              # every (cell, sample) it uses, records found on disk included; default:
                                  # all the bisection can need (its longest path of probes x 2 cells x max_samples)
      max_samples: 4              # a point whose interval straddles the target gets samples up to this

A point is *above* when the 95% interval over samples of baseline time / variant time
(:func:`~orchestrator.report.analysis.bootstrap_ratio`) lies above ``target``, *below* when it does not
(an interval that still straddles the target at ``max_samples`` is not above: the margin is not shown).
A point whose cell did not run (unsupported, OOM, an error), or ran another precision than it asks (an
FP8 cell that converted nothing ran BF16), is no probe: the search ends there with the reason. The
search decides everything from the records it has, so it is the same search whether the records were
just run, found from an earlier grid, or left by an interrupted run. It bisects in log space: it probes
the point nearest the geometric middle of the bracket, which starts as the whole range with its ends
open (nothing is assumed of them), until the bracket is two neighbouring points. The answer is the
bracket's upper end; a bracket that closes on the bottom of the range puts the crossover at the range's
start, one that closes on the top means the target is never reached in the range. A range's ends are
probed only when the bisection gets there: the top is the dearest cell, and a crossover inside the range
needs neither end. The price is paid by a range whose target is never reached: about log2(points) probes
up to its top, not one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from trials.spec import SpecError, TrialSpec, defaults_for, variant_name

from .answer import Answer, Probe
from .cells import blame, cell_values
from .report.analysis import bootstrap_ratio, launch_bound_note

OVER_AXES = ("d_model", "n_layers", "tokens_per_step", "ffn")
SEARCH_KEYS = ("find", "variant", "baseline", "target", "over", "fixed", "max_trials", "max_samples")
SIDES = ("baseline", "variant")
MIN_SAMPLES = 2  # an interval over samples needs two a side (bootstrap_ratio: none at one against one)
RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class CrossoverPlan:
    variant: dict[str, Any]
    baseline: dict[str, Any]
    target: float
    axis: str
    points: tuple[int, ...]  # the values of ``axis`` the search may probe, ascending
    fixed: dict[str, Any]  # the sweep's fixed values with the search's own over them
    samples: int
    max_samples: int
    max_trials: int

    def spec(self, side: str, x: int) -> TrialSpec:
        """The cell a grid would make of these values (orchestrator/cells.py): same spec, same cell id."""
        return TrialSpec.from_dict(cell_values({**self.fixed, **getattr(self, side), self.axis: x})[0])

    def label(self, side: str) -> str:
        values = {**self.fixed, **getattr(self, side)}
        return variant_name({**defaults_for(values), **values})

    # -- what the search (orchestrator/search.py) asks of a plan -------------------------------------
    def wheres(self) -> list[tuple[str, int]]:
        """Every (side, x) the bisection may probe."""
        return [(side, x) for x in self.points for side in SIDES]

    def state(self) -> "Bisection":
        return Bisection(self)

    def describe(self, trial: tuple[str, int, int]) -> str:
        side, x, sample = trial
        return f"{side} at {self.axis}={x}, sample {sample}"

    def summary(self) -> str:
        """The dry run's line."""
        return (f"search: the smallest {self.axis} in {list(self.points)} where {self.label('variant')} beats "
                f"{self.label('baseline')} by >= {self.target:.2f}x; up to {self.max_trials} trials ({self.samples}-"
                f"{self.max_samples} samples per cell), chosen as results arrive")


def parse_search(block: Any, err: Callable[[tuple, str], Exception], sweep_fixed: dict[str, Any],
                 samples: int) -> CrossoverPlan:
    """Validate a sweep's ``search: {find: crossover, ...}`` block (orchestrator/sweep.py checks ``find``); every
    problem is ``err(key path, message)``."""
    for key in block:
        if key not in SEARCH_KEYS:
            raise err(("search", key), f"unknown key; allowed: {', '.join(SEARCH_KEYS)}")
    for key in ("variant", "baseline", "target", "over"):
        if key not in block:
            raise err(("search", key), "required")
    fields = set(TrialSpec.field_names())
    sides: dict[str, dict[str, Any]] = {}
    for key in ("variant", "baseline", "fixed"):
        value = block.get(key) or {}
        if not isinstance(value, dict):
            raise err(("search", key), "must be a mapping of trial fields to single values")
        for name, v in value.items():
            if name not in fields:
                raise err(("search", key, name), f"unknown trial field; allowed: {', '.join(sorted(fields))}")
            if isinstance(v, (list, dict)):
                raise err(("search", key, name), "must be a single value")
        sides[key] = dict(value)
    target = block["target"]
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 < target < 10:
        raise err(("search", "target"), "must be a speedup between 0 and 10, e.g. 1.10")
    over = block["over"]
    if not isinstance(over, dict) or len([k for k in over if k != "step"]) != 1:
        raise err(("search", "over"), f"must name one axis ({', '.join(OVER_AXES)}) with [low, high] and a step")
    axis = next(k for k in over if k != "step")
    if axis not in OVER_AXES:
        raise err(("search", "over", axis), f"must be one of {', '.join(OVER_AXES)}")
    bounds, step = over[axis], over.get("step", 1)
    if (not isinstance(bounds, list) or len(bounds) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                                     for v in bounds) or not 0 < bounds[0] < bounds[1]):
        raise err(("search", "over", axis), "must be [low, high], positive integers with low < high")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise err(("search", "over", "step"), "must be a positive integer")
    points = list(range(bounds[0], bounds[1] + 1, step))
    if points[-1] != bounds[1]:
        points.append(bounds[1])
    if len(points) < 2:
        raise err(("search", "over", "step"), f"leaves fewer than two points in [{bounds[0]}, {bounds[1]}]")
    for place, values in _written(sides, sweep_fixed):  # the sweep's fixed too: the search would override it
        if axis in values:
            raise err(place + (axis,), "is the searched axis (search.over); do not also fix it"
                      + ("; a grid beside the search takes it under grid" if place == ("fixed",) else ""))
    n = max(samples, MIN_SAMPLES)
    max_samples = block.get("max_samples", n + 2)
    if not isinstance(max_samples, int) or isinstance(max_samples, bool) or max_samples < n:
        raise err(("search", "max_samples"), f"must be an integer >= samples ({n})")
    # Unset, the budget never ends the search before its answer: with the small-sample (t) intervals of
    # bootstrap_ratio most probes take more than two samples, and a fixed 24 stopped most noisy searches early.
    max_trials = block.get("max_trials", most_probes(tuple(points)) * len(SIDES) * max_samples)
    if not isinstance(max_trials, int) or isinstance(max_trials, bool) or max_trials < 2 * MIN_SAMPLES * 2:
        raise err(("search", "max_trials"), f"must be an integer >= {2 * MIN_SAMPLES * 2} (two points, both cells, "
                  f"{MIN_SAMPLES} samples each)")
    plan = CrossoverPlan(sides["variant"], sides["baseline"], float(target), axis, tuple(points),
                         {**sweep_fixed, **sides["fixed"]}, n, max_samples, max_trials)
    for side in SIDES:  # every cell the search could probe is a valid spec, or the file says where it is not
        for x in points:
            try:
                plan.spec(side, x)
            except SpecError as exc:
                raise err(_blame(plan, side, x, exc, sides, sweep_fixed),
                          f"{exc} (the {side} cell at {axis}={x})") from None
    if plan.spec("variant", points[0]) == plan.spec("baseline", points[0]):  # then so at every point
        raise err(("search", "variant"), f"is the same cell as search.baseline ({plan.label('baseline')}); "
                  "give the variant a field that differs")
    return plan


def most_probes(points: tuple[int, ...]) -> int:
    """The most points the bisection over ``points`` can probe: along the verdicts that keep the larger side
    of each split (its middle is geometric, so in index terms the splits are uneven)."""
    @functools.lru_cache(maxsize=None)
    def probes(a: int, b: int) -> int:
        if b - a <= 1:
            return 0
        m = middle(points, a, b)
        return 1 + max(probes(a, m), probes(m, b))
    return probes(-1, len(points))


def middle(points: tuple[int, ...], a: int, b: int) -> int:
    """The index strictly inside (a, b) whose value is nearest the geometric mean of the bracket's ends;
    an end outside the range (-1 or len(points)) counts as the range's end there."""
    lo, hi = max(a, 0), min(b, len(points) - 1)
    mid = math.sqrt(points[lo] * points[hi])
    return min(range(a + 1, b), key=lambda i: (abs(math.log(points[i] / mid)), i))


def _written(sides: dict[str, dict[str, Any]], sweep_fixed: dict[str, Any],
             side: str | None = None) -> list[tuple[tuple, dict[str, Any]]]:
    """Where the file gives a cell's values, each (key path, values), the one that wins a field first: a side's
    own (``side``'s, or both), search.fixed, the sweep's fixed."""
    own = [(("search", s), sides[s]) for s in ((side,) if side else SIDES)]
    return own + [(("search", "fixed"), sides["fixed"]), (("fixed",), sweep_fixed)]


def _blame(plan: CrossoverPlan, side: str, x: int, exc: SpecError, sides: dict[str, dict[str, Any]],
           sweep_fixed: dict[str, Any]) -> tuple:
    """The key path the file wrote that makes the ``side`` cell at ``x`` invalid (orchestrator/cells.blame, over
    the cell's values as :meth:`CrossoverPlan.spec` makes them); the searched axis, or no one field: search.over."""
    written = _written(sides, sweep_fixed, side)
    if exc.field == plan.axis and not any(exc.field in given for _, given in written):
        return ("search", "over")
    values = cell_values({**plan.fixed, **getattr(plan, side), plan.axis: x})[0]
    return blame(exc, written, values) or ("search", "over")


@dataclass(frozen=True)
class Outcome:
    """One trial's part in the search: its status, timed median and GPU time."""

    status: str
    ms: float | None
    wall_s: float = 0.0
    error: str = ""
    gpu_name: str = ""
    launch_bound: bool = False  # the record's: the GPU idled >= 20% of the step on the host (trials.measure.bench)
    precision: str | None = None  # the record's effective_precision: what ran (None: not recorded, as asked)


@dataclass
class Decision:
    need: list[tuple[str, int, int]]  # (side, x, sample) trials to run now; empty when done
    answer: Answer | None = None  # set when the search is over
    probes: dict[int, Probe] = field(default_factory=dict)  # the points judged so far


class Bisection:
    """The search's state: what each (side, x, sample) gave; what to run next follows from it alone."""

    def __init__(self, plan: CrossoverPlan):
        self.plan = plan
        self.seen: dict[tuple[str, int, int], Outcome] = {}
        # the precision each side asks (the searched axis is a shape: it is the same at every point)
        self.asked = {side: plan.spec(side, plan.points[0]).precision for side in SIDES}

    def observe(self, side: str, x: int, sample: int, outcome: Outcome) -> None:
        self.seen[(side, x, sample)] = outcome

    def decide(self, pending: set[tuple[str, int, int]] = frozenset()) -> Decision:
        """The trials needed now, or the answer. ``pending``: trials running (they count against the budget)."""
        plan, probes = self.plan, {}
        points = plan.points

        def status(i: int) -> Probe | list[tuple[str, int, int]]:
            x = points[i]
            n = plan.samples
            while True:
                need = [(side, x, s) for side in SIDES for s in range(n) if (side, x, s) not in self.seen]
                if need:
                    return need
                probe = self.probe(x, n)
                probes[x] = probe
                if probe.verdict == "straddle" and n < plan.max_samples:
                    n += 1
                    continue
                if probe.verdict == "straddle":
                    probe.verdict, probe.why = "below", f"interval straddles {plan.target:g} at {n} samples"
                return probe

        def done(found: bool, statement: str, crossover: int | None = None,
                 bracket: tuple[int, int] | None = None) -> Decision:
            return Decision([], self._answer(found, statement, crossover, bracket, probes))

        def step(i: int) -> Probe | Decision:
            got = status(i)
            if isinstance(got, list):
                used = set(self.seen) | set(pending)
                fresh = [t for t in got if t not in pending]
                if len(used) + len(fresh) > plan.max_trials:
                    return done(False, f"stopped at max_trials={plan.max_trials} before the search ended")
                return Decision(fresh, probes=probes)
            if got.verdict == "failed":
                return done(False, f"cannot probe {plan.axis}={got.x}: {got.why}")
            return got

        # The bracket (a, b): a is below the target, b above. Its ends start one step outside the range
        # (-1 and len(points)), where nothing is probed: a range end is probed only when the bisection
        # reaches it, so a crossover inside the range costs no probe at either (large, dear) end.
        a, b = -1, len(points)
        while b - a > 1:
            m = middle(points, a, b)
            got = step(m)
            if isinstance(got, Decision):
                return got
            a, b = (a, m) if got.verdict == "above" else (m, b)
        if b == len(points):
            best = max((p for p in probes.values() if p.ratio is not None), key=lambda p: p.ratio)
            return done(False, f"{plan.label('variant')} never beats {plan.label('baseline')} by >= {plan.target:.2f}x "
                        f"for {plan.axis} in [{points[0]}, {points[-1]}]: best {best.ratio:.3f}x "
                        f"[{best.ci_low:.3f}, {best.ci_high:.3f}] at {best.x}")
        if a < 0:
            return done(True, self._statement(points[0], None), points[0], (points[0], points[0]))
        return done(True, self._statement(points[b], (points[a], points[b])), points[b], (points[a], points[b]))

    # -- pieces -------------------------------------------------------------------------------
    def probe(self, x: int, n: int) -> Probe:
        outs = {side: [self.seen[(side, x, s)] for s in range(n)] for side in SIDES}
        for side in SIDES:
            bad = next((o for o in outs[side] if o.status != "ok" or o.ms is None), None)
            if bad is not None:
                return Probe(x, samples=n, verdict="failed", why=f"the {side} cell is {bad.status}: {bad.error}"[:300])
            # an FP8 cell that converted nothing (torchao at a width no multiple of 16) runs ok, in BF16: its
            # time is not the variant's, however it compares (trials.measure.metrics.fp8_ran)
            asked = self.asked[side]
            off = next((o for o in outs[side] if o.precision not in (None, asked)), None)
            if off is not None:
                where = "; fp8_skipped_why says what stayed in BF16 and why" if asked == "fp8" else ""
                return Probe(x, samples=n, verdict="failed",
                             why=f"the {side} cell ran {off.precision}, not the {asked} asked "
                                 f"(effective_precision{where})")
        base, var = [o.ms for o in outs["baseline"]], [o.ms for o in outs["variant"]]
        lo, hi = bootstrap_ratio(base, var, RESAMPLES, np.random.default_rng(SEED))
        ratio = float(np.median(base) / np.median(var))
        verdict = "above" if lo > self.plan.target else "below" if hi < self.plan.target else "straddle"
        return Probe(x, ratio, lo, hi, n, verdict, launch_bound=any(o.launch_bound for side in SIDES
                                                                        for o in outs[side]))

    def partial(self) -> Answer:
        """What is known so far, for an interrupted search."""
        answer = self._answer(False, "search not finished (interrupted); rerun the same command to resume", None,
                              None, self.decide().probes)
        answer.done = False
        return answer

    def _statement(self, x: int, bracket: tuple[int, int] | None) -> str:
        plan = self.plan
        where = f"from {plan.axis} {x}" + (f" [{bracket[0]}, {bracket[1]}]" if bracket else
                                          " (the start of the range)")
        return f"{plan.label('variant')} beats {plan.label('baseline')} by >= {plan.target:.2f}x {where}"

    def _answer(self, found: bool, statement: str, crossover: int | None, bracket: tuple[int, int] | None,
                probes: dict[int, Probe]) -> Answer:
        gpu = next((o.gpu_name for o in self.seen.values() if o.gpu_name), "")
        wall = sum(o.wall_s for o in self.seen.values())
        trials = len(self.seen)
        statement += (f" on {gpu}" if gpu else "") + f"; {trials} trials, {wall / 60:.1f} {'GPU' if gpu else 'CPU'}-minutes"
        bound = sorted({x for x in (bracket or ()) if x in probes and probes[x].launch_bound})
        if found and bound:  # the answer is the host's as much as the GPU's there: say so with it
            where = f"{self.plan.axis} {' and '.join(map(str, bound))}"
            statement += "; " + launch_bound_note(where)
        return Answer(found, statement, self.plan.axis, self.plan.target, self.plan.label("variant"),
                      self.plan.label("baseline"), crossover, bracket, sorted(probes.values(), key=lambda p: p.x),
                      trials, wall)
