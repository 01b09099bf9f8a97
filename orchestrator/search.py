"""A Ray Tune searcher over the crossover plan: it proposes cells from the records so far.

:class:`Search` keeps the plan's :class:`~orchestrator.crossover.Bisection` in step with the store:
every record whose cell id is one the plan could probe is an observation, whoever ran it (this search,
an interrupted earlier run of it, a grid of the same sweep). :class:`CrossoverSearcher` is the
``ray.tune.search.Searcher`` Tune asks for the next trial: it returns the config of a (cell, sample)
the bisection needs, ``None`` while the trials it waits on are still running, and ``FINISHED`` once
the answer is known or ``max_trials`` is spent. Each config is an ordinary work item
(:class:`~orchestrator.work.WorkItem`), so each probe writes the record a grid cell would.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.tune.search import Searcher

from .crossover import SIDES, Answer, Bisection, CrossoverPlan, Decision, Outcome
from .report.analysis import DECODE_STEP, TRAIN_STEP
from .store import Store
from .work import WorkItem

log = logging.getLogger(__name__)


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

    def searcher(self) -> "CrossoverSearcher":
        return CrossoverSearcher(self)


class CrossoverSearcher(Searcher):
    """Tune's view of the search: ``suggest`` a trial the bisection needs, learn from each completed one."""

    def __init__(self, search: Search):
        # No metric for Tune: the search reads each trial's record, and Tune's strict check of a searcher's
        # metric would end the sweep at the first record without a time (an unsupported or failed cell).
        super().__init__()
        self.search = search
        self.pending: dict[str, tuple[str, int, int]] = {}  # Tune trial id -> (side, x, sample)

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        decision = self.search.decide(set(self.pending.values()))
        if decision.answer is not None:
            return Searcher.FINISHED
        if not decision.need:
            return None  # waiting for a running trial of the same point
        want = decision.need[0]
        self.pending[trial_id] = want
        log.info("search: %s at %s=%d, sample %d", want[0], self.search.plan.axis, want[1], want[2])
        return self.search.item(*want).config()

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        want = self.pending.pop(trial_id, None)
        if want is None:
            return
        self.search.observe_trial(*want)
