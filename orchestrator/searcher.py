"""Tune's view of a sweep's search (:class:`orchestrator.search.Search`): a ``ray.tune.search.Searcher``.

Tune asks it for the next trial: it returns the config of a (cell, sample) the search needs (the crossover's
bisection, the best setting's halving), ``None`` while the trials it waits on are still running, and
``FINISHED`` once the answer is known or ``max_trials`` is spent. Each config is an ordinary work item (:class:`~orchestrator.work.WorkItem`), so
each probe writes the record a grid cell would. Imported only inside the sweep's Ray session.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.tune.search import Searcher

from .search import Search

log = logging.getLogger(__name__)


class RecordSearcher(Searcher):
    """Tune's view of the search: ``suggest`` a trial the search needs, learn from each completed one's record."""

    def __init__(self, search: Search):
        # No metric for Tune: the search reads each trial's record, and Tune's strict check of a searcher's
        # metric would end the sweep at the first record without a time (an unsupported or failed cell).
        super().__init__()
        self.search = search
        self.pending: dict[str, tuple] = {}  # Tune trial id -> trial (a where of the plan and a sample)

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        decision = self.search.decide(set(self.pending.values()))
        if decision.answer is not None:
            return Searcher.FINISHED
        if not decision.need:
            return None  # waiting for a running trial the next step depends on
        want = decision.need[0]
        self.pending[trial_id] = want
        log.info("search: %s", self.search.plan.describe(want))
        return self.search.item(*want).config()

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        want = self.pending.pop(trial_id, None)
        if want is None:
            return
        self.search.observe_trial(*want)
