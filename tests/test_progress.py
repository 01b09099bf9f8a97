"""The live view's ETA: the trials left times the wall time per trial finished so far."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from orchestrator.progress import SweepProgress
from orchestrator.store import Store
from orchestrator.work import WorkItem
from trials.record.fields import empty_record
from trials.spec import TrialSpec


def test_the_eta_of_concurrent_trials_counts_their_concurrency_once(tmp_path):
    """4 trials at a time, 16 of 32 done: the wall time per finished trial (elapsed / 16) already has the
    concurrency in it, so the 16 left take as long again as the 16 done; dividing by the 4 running again
    said a quarter of that."""
    store = Store(str(tmp_path), "eta")
    store.ensure()
    items = [WorkItem.of(TrialSpec(device="cpu"), s) for s in range(32)]
    for it in items[:16]:
        store.write_record({**empty_record(), "cell_id": it.cell_id, "sample": it.sample, "status": "ok"})
    for it in items[16:20]:
        store.mark_running(it.key, {"label": it.label, "started_at": time.time()})
    view = SweepProgress(Console(file=io.StringIO(), width=200), interval_s=3600)
    view.start(store, items, already_done=set())
    view.t0 -= 400.0  # as if the sweep had run 400 s: 4 waves of 4 trials of 100 s each
    line = view._render().renderables[0].plain
    view.stop()
    elapsed, eta = (float(re.search(rf"{name} (\d+)s", line).group(1)) for name in ("elapsed", "eta"))
    done, left = 16, 32 - 16
    assert abs(eta - elapsed / done * left) <= 1, line
