"""A Ray Tune searcher over the crossover plan: it proposes cells from the records so far.

:class:`Search` keeps the plan's :class:`~orchestrator.crossover.Bisection` in step with the store:
every record whose cell id is one the plan could probe is an observation, whoever ran it (this search,
an interrupted earlier run of it, a grid of the same sweep). :class:`orchestrator.searcher.CrossoverSearcher`
gives Tune its view of it (built by the runner inside its Ray session). This module does not import Ray, so the CLI can load it
before the sweep decides how Ray starts (:mod:`orchestrator.embedded_ray`).
"""

from __future__ import annotations

from typing import Any

from .answer import Answer
from .crossover import SIDES, Bisection, CrossoverPlan, Decision, Outcome
from .report.analysis import DECODE_STEP, TRAIN_STEP
from .store import Store
from .work import WorkItem


class Search:
    def __init__(self, plan: CrossoverPlan, store: Store):
        self.plan, self.store = plan, store
        self.timing = DECODE_STEP if plan.fixed.get("workload") == "infer" else TRAIN_STEP
        # cell id -> (side, x): the cells the plan could probe
        self.cells = {WorkItem.of(plan.spec(side, x), 0).cell_id: (side, x) for side in SIDES for x in plan.points}
        self.bisection = Bisection(plan)
        self.refresh()

    @property
    def columns(self) -> list[str]:
        return ["cell_id", "sample", "status", self.timing.median, "trial_wall_s", "error", "gpu_name", "launch_bound"]

    def refresh(self) -> None:
        """Observe every record on disk that belongs to one of the plan's cells (once, at the start)."""
        if self.store.record_files():
            self.observe_records(self.store.read_records(self.columns).to_pylist())

    def observe_records(self, rows: list[dict[str, Any]]) -> None:
        """Observe those of ``rows`` (records with at least :attr:`columns`) that are cells of the plan."""
        for r in rows:
            where = self.cells.get(r["cell_id"])
            if where is not None:
                self.observe(where, int(r["sample"]), r)

    def observe_trial(self, side: str, x: int, sample: int) -> None:
        """Observe the record one finished trial wrote; none means its worker died every time Tune tried."""
        item = self.item(side, x, sample)
        r = self.store.read_record(item.key, self.columns)
        self.observe((side, x), sample, r or {"status": "error", "error": "no record: the trial's worker died"})

    def observe(self, where: tuple[str, int], sample: int, r: dict[str, Any]) -> None:
        self.bisection.observe(*where, sample, Outcome(str(r.get("status")), r.get(self.timing.median),
                                                       float(r.get("trial_wall_s") or 0.0), str(r.get("error") or ""),
                                                       str(r.get("gpu_name") or ""), bool(r.get("launch_bound"))))

    def decide(self, pending: set[tuple[str, int, int]] = frozenset()) -> Decision:
        return self.bisection.decide(pending)

    @property
    def finished(self) -> bool:
        return self.decide().answer is not None

    def item(self, side: str, x: int, sample: int) -> WorkItem:
        return WorkItem.of(self.plan.spec(side, x), sample)

    def items(self) -> list[WorkItem]:
        """Every (cell, sample) the search used, for the sweep's summary."""
        return [self.item(*t) for t in sorted(self.bisection.seen, key=lambda t: (t[1], t[0], t[2]))]

    def answer(self) -> Answer:
        decision = self.decide()
        if decision.answer is not None:
            return decision.answer
        ans = self.bisection._answer(False, "search not finished (interrupted); rerun the same command to resume",
                                     None, None, decision.probes)  # what is known so far
        ans.done = False
        return ans
