"""What a search found, as ``search.json`` holds it beside a sweep's records: the crossover search's probes and
crossover (:class:`Answer`), the best-against-best search's winners (:class:`BestAnswer`); :func:`load` reads either.

Its own module, apart from the searches (crossover.py, best.py) that write it, so that the report reads it without
importing a search, which reads the report's intervals: data flows one way, search -> answer -> report.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Probe:
    x: int
    ratio: float | None = None  # baseline time / variant time
    ci_low: float | None = None
    ci_high: float | None = None
    samples: int = 0
    verdict: str = ""  # above, below (straddle counts as below once samples are capped), failed
    why: str = ""
    launch_bound: bool = False  # a sample of either side was launch-bound: the host's pace set its time


@dataclass
class Answer:
    found: bool
    statement: str
    axis: str
    target: float
    variant: str
    baseline: str
    crossover: int | None = None
    bracket: tuple[int, int] | None = None
    probes: list[Probe] = field(default_factory=list)
    trials: int = 0
    gpu_seconds: float = 0.0
    done: bool = True
    find: str = "crossover"
    title = "Crossover search"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Answer":
        data = json.loads(text)
        data["probes"] = [Probe(**p) for p in data.get("probes", [])]
        data["bracket"] = tuple(data["bracket"]) if data.get("bracket") else None
        return cls(**data)


@dataclass
class Contender:
    """A cell of a side timed in full: its setting, its samples' step times (ms, one per optimizer step), and (but
    the winner) the 95% interval of its time over the winner's."""

    setting: str  # the searched settings as the cell runs them, in words (batch_size=4 grad_accum=2 ...)
    values: dict[str, Any]
    cell_id: str
    ms: list[float]
    ci_low: float | None = None
    ci_high: float | None = None
    launch_bound: bool = False

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)

    @property
    def within_noise(self) -> bool:
        """Its interval against the winner holds 1: the samples do not tell it from the winner."""
        return self.ci_low is not None and self.ci_low <= 1.0 <= (self.ci_high or 0.0)


@dataclass
class SideBest:
    """One side's search: the winner (None: no cell ran, ``why`` says so), every cell timed in full (fastest first),
    and what was counted out: screened cells, those that ran out of memory, other reasons, combinations that name no
    cell, and cells the memory plan said will not fit."""

    label: str
    precision: str
    winner: Contender | None
    timed: list[Contender] = field(default_factory=list)
    why: str = ""
    ms_low: float | None = None  # the winner's 95% interval of its median step time
    ms_high: float | None = None
    screened: int = 0
    does_not_fit: int = 0
    out: list[str] = field(default_factory=list)
    invalid: int = 0
    unfit: int = 0

    @property
    def runners_up(self) -> list[Contender]:
        """The timed cells within noise of the winner."""
        return [c for c in self.timed if c is not self.winner and c.within_noise]


@dataclass
class BestAnswer:
    """Best against best at one global batch (orchestrator/best.py): each side's winner; the speedup of the fastest
    side of the lowest precision (``precision``: fp8, else bf16) over the fastest of the others, with its 95%
    interval; and the GPU-seconds spent against the exhaustive grid's (estimated from the trials' walls: None before
    any full trial)."""

    found: bool
    statement: str
    global_batch: int
    sides: list[SideBest] = field(default_factory=list)
    precision: str = "fp8"  # the candidate precision: the lowest the sides run
    candidate: str | None = None  # the label of its fastest side, and of the fastest side of the others
    reference: str | None = None
    speedup: float | None = None  # the reference winner's median step time over the candidate winner's
    ci_low: float | None = None
    ci_high: float | None = None
    trials: int = 0
    gpu_seconds: float = 0.0
    grid_trials: int = 0
    grid_gpu_seconds: float | None = None
    device: str = ""
    unfit: int = 0  # cells the memory plan said will not fit, never run
    fit_margin: float | None = None
    gpu_memory_gib: float | None = None
    done: bool = True
    find: str = "best"
    title = "Best against best"

    def side(self, label: str | None) -> SideBest | None:
        return next((s for s in self.sides if s.label == label), None)

    def timed_cell_ids(self) -> set[str]:
        """The cells timed in full at the sweep's schedule: what the report's other sections read (a screen is the
        cell at a shorter schedule, unprofiled, there only to rank it)."""
        return {c.cell_id for side in self.sides for c in side.timed}

    def tokens_per_s(self, side: SideBest) -> tuple[float, float | None, float | None]:
        """The side winner's tokens per second (the global batch over its median step time), with its interval."""
        rate = lambda ms: None if ms is None else self.global_batch * 1000.0 / ms  # noqa: E731
        return rate(side.winner.median_ms), rate(side.ms_high), rate(side.ms_low)

    def to_json(self) -> str:
        data = asdict(self)
        for side, raw in zip(self.sides, data["sides"]):  # the winner by its place among the timed, not a copy
            raw["winner"] = None if side.winner is None else side.timed.index(side.winner)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "BestAnswer":
        data = json.loads(text)
        sides = []
        for raw in data.pop("sides", []):
            timed = [Contender(**c) for c in raw.pop("timed", [])]
            at = raw.pop("winner")
            sides.append(SideBest(**raw, winner=None if at is None else timed[at], timed=timed))
        return cls(**data, sides=sides)


def load(text: str) -> Answer | BestAnswer:
    """The answer ``search.json`` holds, of whichever search wrote it (one written before ``find`` was kept is a
    crossover search's)."""
    find = json.loads(text).get("find", "crossover")
    return BestAnswer.from_json(text) if find == "best" else Answer.from_json(text)
