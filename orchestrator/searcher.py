"""Tune's view of the crossover search (:class:`orchestrator.search.Search`): a ``ray.tune.search.Searcher``.

Tune asks it for the next trial: it returns the config of a (cell, sample) the bisection needs, ``None``
while the trials it waits on are still running, and ``FINISHED`` once the answer is known or
``max_trials`` is spent. Each config is an ordinary work item (:class:`~orchestrator.work.WorkItem`), so
each probe writes the record a grid cell would. Imported only inside the sweep's Ray session.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.tune.search import Searcher

from .search import Search

log = logging.getLogger(__name__)


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
