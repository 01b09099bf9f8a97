"""The harness against a plain loop of the same model: rounds of one and the other, interleaved, medians compared.

Shared by benchmarks/hf_loop.py (torch and torchao training cells), te_hf_loop.py (TE training cells) and
hf_decode_loop.py (graphed serving cells): each says what its plain loop is; this runs the rounds and prints
one line per cell. The goal every one of them checks: |trial / plain - 1| <= GOAL. The plain graphed decode of
hf_decode_loop.py and decode_loop.py (MiniGPT) is :func:`graphed_ms_per_step`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
from typing import Any, Callable, Iterator

import torch

from trials import TrialSpec, run_trial

GOAL = 0.02


def compare(label: str, spec: TrialSpec, field: str, plain: Callable[[], float], rounds: int,
            unit: str = "ms") -> dict[str, Any] | None:
    """``rounds`` times: ``run_trial(spec)[field]``, then ``plain()``; the medians, their ratio and every round,
    or None when the trial did not end ok (said on stdout)."""
    trial, loop = [], []
    for _ in range(rounds):
        rec = run_trial(spec)
        if rec["status"] != "ok":
            print(f"{label}: trial {rec['status']}: {rec['error']}", flush=True)
            return None
        trial.append(rec[field])
        loop.append(plain())
    t, p = statistics.median(trial), statistics.median(loop)
    print(f"{label}: trial {t:.3f} {unit}  plain {p:.3f} {unit}  trial/plain {t / p:.3f}"
          f"{'' if abs(t / p - 1) <= GOAL else f'  (outside {GOAL:.0%})'}", flush=True)
    return {"cell": label, "trial_ms": t, "plain_ms": p, "ratio": t / p, "trial_rounds": trial, "plain_rounds": loop}


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """Python's automatic garbage collection off inside (a collection first), as ``timeit`` times."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def keep(rows: list[dict[str, Any]], row: dict[str, Any] | None, path: str | None) -> None:
    """Add ``row`` (None: the trial did not end ok) and, with ``path``, write every row so far as JSON: a run cut
    by its device call's limit keeps the cells it finished (they were written only at the end before)."""
    if row is not None:
        rows.append(row)
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


def graphed_ms_per_step(step: Callable[[], None], reset: Callable[[], None], steps: int, repeats: int) -> list[float]:
    """A hand-written server's decode: ``step`` (the whole decode step, the next token fed back and the position
    advanced inside it) run twice on a side stream (kernels chosen, buffers allocated outside the graph), captured
    as one CUDA graph, then per repeat ``reset()`` and ``steps`` replays back to back between two events; the ms
    per step of each repeat."""
    reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out = []
    for _ in range(repeats):
        reset()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(begin.elapsed_time(end) / steps)
    return out
