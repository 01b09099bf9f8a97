"""A search of a sweep, kept in step with its store: it proposes cells from the records so far.

:class:`Search` keeps the plan's state (the crossover's :class:`~orchestrator.crossover.Bisection`, the best
setting's :class:`~orchestrator.best.Halving`) in step with the store: every record whose cell id is one the plan
could run is an observation, whoever ran it (this search, an interrupted earlier run of it, a grid of the same
sweep), except a failure an earlier run left: a record without a final status (a timeout, an error) that was on
disk when the search was built is a trial to run again, as a grid runs again every trial without a final record.
A plan's cells are its ``wheres()`` (a trial is a where and a sample); its state decides from observations alone.
:class:`orchestrator.searcher.RecordSearcher` gives Tune its view of it (built by the runner inside its Ray
session). This module does not import Ray, so the CLI can load it before the sweep decides how Ray starts
(:mod:`orchestrator.embedded_ray`).
"""

from __future__ import annotations

from typing import Any

from trials.record.fields import FINAL_STATUSES

from .crossover import Decision, Outcome
from .report.analysis import timing_for
from .store import Store
from .sweep import distinct_labels
from .work import WorkItem


class Search:
    def __init__(self, plan: Any, store: Store):
        self.plan, self.store = plan, store
        self.timing = timing_for(plan.fixed.get("workload"))
        # cell id -> where: the cells the plan could run (a cell written twice is the later where: a best search
        # whose screen is its full schedule runs each cell once)
        wheres = plan.wheres()
        self.cells = {WorkItem.of(plan.spec(*where), 0).cell_id: where for where in wheres}
        # labels that tell the plan's cells apart, as the grid's do (a micro-batch, a schedule)
        self.labels = dict(zip(wheres, distinct_labels([plan.spec(*where) for where in wheres])))
        self.state = plan.state()
        rows = self._rows()
        # records an earlier run left without a final status: its failures, which this run retries
        self.earlier_failures = frozenset(_identity(r) for r in rows if r["status"] not in FINAL_STATUSES)
        self.observe_records(rows)

    @property
    def columns(self) -> list[str]:
        return ["cell_id", "sample", "status", self.timing.median, "effective_precision", "trial_wall_s", "error",
                "gpu_name", "launch_bound", "run_id", "recorded_at"]

    def _rows(self) -> list[dict[str, Any]]:
        return self.store.read_records(self.columns).to_pylist() if self.store.record_files() else []

    def refresh(self) -> None:
        """Observe every record on disk that belongs to one of the plan's cells (but an earlier run's failures,
        noted when the search was made)."""
        self.observe_records(self._rows())

    def observe_records(self, rows: list[dict[str, Any]]) -> None:
        """Observe those of ``rows`` (records with at least :attr:`columns`) that are cells of the plan, but
        for an earlier run's failures. A failure written since (this run's grid's) is observed: it ends the
        search with its reason, as one of this search's own does (:meth:`observe_trial`)."""
        for r in rows:
            where = self.cells.get(r["cell_id"])
            if where is not None and _identity(r) not in self.earlier_failures:
                self.observe(where, int(r["sample"]), r)

    def observe_trial(self, *trial: Any) -> None:
        """Observe the record one finished trial (a where and a sample) wrote; none means its worker died every
        time Tune tried."""
        item = self.item(*trial)
        r = self.store.read_record(item.key, self.columns)
        self.observe(trial[:-1], trial[-1], r or {"status": "error", "error": "no record: the trial's worker died"})

    def observe(self, where: tuple, sample: int, r: dict[str, Any]) -> None:
        self.state.observe(*where, sample, Outcome(str(r.get("status")), r.get(self.timing.median),
                                                       float(r.get("trial_wall_s") or 0.0), str(r.get("error") or ""),
                                                       str(r.get("gpu_name") or ""), bool(r.get("launch_bound")),
                                                       r.get("effective_precision") or None))

    def decide(self, pending: set[tuple] = frozenset()) -> Decision:
        return self.state.decide(pending)

    @property
    def finished(self) -> bool:
        return self.decide().answer is not None

    def item(self, *trial: Any) -> WorkItem:
        """The work item of a trial: a where and a sample."""
        where, sample = trial[:-1], trial[-1]
        return WorkItem.of(self.plan.spec(*where), sample, self.labels[where])

    def items(self) -> list[WorkItem]:
        """Every (cell, sample) the search used, for the sweep's summary, in the order the plan lists its cells."""
        order = {where: i for i, where in enumerate(self.plan.wheres())}
        return [self.item(*t) for t in sorted(self.state.seen, key=lambda t: (order.get(t[:-1], 0), t[-1]))]

    def answer(self) -> Any:
        """The search's answer (orchestrator/answer.py), or what it knows so far (``done`` false)."""
        decision = self.decide()
        return decision.answer if decision.answer is not None else self.state.partial()


def _identity(r: dict[str, Any]) -> tuple:
    """One record of one trial: a trial run again writes a record of another run (run_id) and time."""
    return r.get("cell_id"), r.get("sample"), r.get("run_id"), r.get("recorded_at")
