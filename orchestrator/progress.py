"""Live view of a running sweep (cells done / running / failed, elapsed, ETA) and the final summary.

The view reads the store, not Ray: what it shows is what is on disk, the same thing a resumed run
will see.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from trials.measure.steadiness import unsteady_spread
from trials.record.fields import FINAL_STATUSES

from .store import Store
from .work import WorkItem

WHY_CHARS = 100  # of a record's error, in the summary's "why" column
_STYLE = {"ok": "green", "oom": "yellow", "unsupported": "cyan", "diverged": "magenta", "error": "red",
          "timeout": "red", "missing": "red"}


class SweepProgress:
    """Polls the store once a second from a background thread and renders a rich Live panel."""

    def __init__(self, console: Console | None = None, interval_s: float = 1.0):
        self.console = console or Console(stderr=True, emoji=False)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None

    def start(self, store: Store, items: list[WorkItem], already_done: set[str]) -> None:
        self.store, self.items, self.already_done = store, items, set(already_done)
        self.t0 = time.time()
        self._live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False)
        self._live.start()
        self._thread = threading.Thread(target=self._loop, name="juicytalk-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._live:
            self._live.update(self._render())
            self._live.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._live.update(self._render())
            except Exception:  # noqa: BLE001 - a half-written marker must not kill the view
                continue

    def _render(self) -> Group:
        statuses = self.store.statuses()
        running = self.store.running()
        keys = [it.key for it in self.items]
        done_now = [k for k in keys if statuses.get(k) in FINAL_STATUSES]
        failed = [k for k in keys if k in statuses and statuses[k] not in FINAL_STATUSES]
        new_done = [k for k in done_now if k not in self.already_done]
        elapsed = time.time() - self.t0
        remaining = len(keys) - len(done_now) - len(failed)
        eta = "-"
        if new_done and remaining:
            # elapsed / finished is already the wall time per trial at the concurrency the sweep ran at: it is
            # not divided by the trials running again (4 at a time, 16 of 32 done in 400 s: 400 s left, not 100)
            eta = f"{elapsed / len(new_done) * remaining:.0f}s"
        line = Text.assemble(
            (f"{len(done_now)}/{len(keys)} done", "bold green"), "  ",
            (f"{len(running)} running", "bold yellow"), "  ",
            (f"{len(failed)} failed", "bold red" if failed else "dim"), "  ",
            f"elapsed {elapsed:.0f}s  eta {eta}",
        )
        table = Table(box=None, show_header=False, padding=(0, 1))
        for key, info in sorted(running.items())[:8]:
            table.add_row(Text("running", style="yellow"), info.get("label", key), key,
                          f"{time.time() - info.get('started_at', time.time()):.0f}s")
        return Group(line, table)


# The record columns the summary reads (:func:`_reasons`): the sweep reads just these (and its efficiency's) back
SUMMARY_COLUMNS = ("cell_id", "sample", "step_ms_p50", "decode_ms_per_token_p50", "error", "timing_disturbed_why",
                   "precision", "effective_precision", "fp8_flop_share", "compiled_eager_why", "step_ms_std", "timer")


def _reasons(records: Any) -> tuple[dict[str, str | None], dict[str, str]]:
    """(key -> p50 text, key -> the first line of its record's error, or for a trial that ran ok but whose timed
    steps something else slowed, what did (trials/measure/disturbance.py), or that asked FP8 and ran none, or asked
    compile and ran eager code (compiled_eager_why), or whose GPU steps spread (trials/measure/steadiness.py), so) from
    the records."""
    p50, why = {}, {}
    if records is not None and records.num_rows:
        columns = (records.column(n).to_pylist() if n in records.column_names else [None] * records.num_rows
                   for n in SUMMARY_COLUMNS)
        for cid, s, step, decode, error, disturbed, asked, ran, share, eager, std, timer in zip(*columns):
            p50[f"{cid}-s{s}"] = f"{step:.2f}" if step is not None else f"{decode:.2f}/tok" if decode is not None else None
            # an ok FP8 trial that ran no FP8 worth the name (trials.measure.metrics.fp8_ran) is not an FP8 result
            not_fp8 = (f"ran {ran}, not an FP8 result: " + (f"{share:.0%} of its FLOPs in FP8" if share is not None
                                                            else "no FP8") + " (fp8_skipped_why)"
                       if asked == "fp8" and ran not in ("fp8", None) else "")
            spread = unsteady_spread(std, step, timer)
            unsteady = f"unsteady steps: sd {spread:.0%} of the median" if spread is not None else ""
            why[f"{cid}-s{s}"] = (str(error).splitlines()[0] if error else
                                  "; ".join(w for w in (not_fp8, eager, f"timing disturbed: {disturbed}" if disturbed
                                                        else "", unsteady) if w))
    return p50, why


def summary_table(items: list[WorkItem], statuses: dict[str, str], records: Any = None) -> Table:
    """One row per trial: label, sample, status, p50 step time (an inference trial's: its decode step, per
    token, marked /tok) and why: for a trial that is not ok, from the records (an unsupported cell's reason,
    an OOM, an exception); for an ok trial whose timing something else disturbed, what did. A reason longer
    than WHY_CHARS reads "see below" (:func:`reasons_below` prints it whole: cut, it stopped mid-sentence)."""
    p50, why = _reasons(records)
    table = Table(title="sweep summary")
    table.add_column("cell", no_wrap=True)  # labels stay whole in 80 columns; "why" folds instead
    for col in ("sample", "status", "p50 ms", "key"):
        table.add_column(col)
    table.add_column("why", overflow="fold")
    for it in items:
        status = statuses.get(it.key, "missing")
        value = p50.get(it.key)
        reason = why.get(it.key, "")  # an ok trial's: its timing was disturbed, or nothing
        table.add_row(it.label, str(it.sample), Text(status, style=_STYLE.get(status, "")),
                      value or "-", it.key,
                      Text(reason if len(reason) <= WHY_CHARS else "see below"))  # an error's text, never markup
    return table


def reasons_below(items: list[WorkItem], statuses: dict[str, str], records: Any = None) -> list[str]:
    """The reasons too long for the summary's "why" column, whole, each once, after the trials it belongs to."""
    _, why = _reasons(records)
    trials: dict[str, list[str]] = {}
    for it in items:
        reason = why.get(it.key, "")
        if len(reason) > WHY_CHARS:
            trials.setdefault(reason, []).append(f"{it.label} s{it.sample}")
    return [f"why {', '.join(labels)}: {reason}" for reason, labels in trials.items()]
