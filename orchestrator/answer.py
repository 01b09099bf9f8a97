"""The crossover search's answer, as ``search.json`` holds it beside a sweep's records: its probes, what it found.

Its own module, apart from the search (crossover.py) that writes it, so that the report reads it without
importing the search, which reads the report's intervals: data flows one way, search -> answer -> report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Answer":
        data = json.loads(text)
        data["probes"] = [Probe(**p) for p in data.get("probes", [])]
        data["bracket"] = tuple(data["bracket"]) if data.get("bracket") else None
        return cls(**data)
