"""Does the best-against-best search find each side's best that the exhaustive grid finds, and for how much less?

Two steps, on any machine:

    python benchmarks/best_vs_grid.py record SEARCH.yaml GRID_DIR [--screen-samples 2]
    python benchmarks/best_vs_grid.py replay SEARCH.yaml GRID_DIR [--runs 500] [--noise 0.03] [--finalists 1 2 3]
                                                                  [--max-samples N]

``record`` runs every cell the search in SEARCH.yaml may run (a ``find: best`` block), at the screen's schedule
(``--screen-samples`` each) and at the sweep's (its ``samples`` each), one after another in this process (no Ray: a
warm launcher's trial process does the same), into GRID_DIR/<name>; each record is the one a sweep would write, its
``trial_wall_s`` this process's wall time of the trial. It resumes: a trial with a final record is not run again.

``replay`` runs this checkout's search (orchestrator/best.py's ``Halving``) ``--runs`` times on those records alone:
each trial it asks for is one of the cell's recorded samples (its samples in a random order, so that a cell timed
``samples`` times is the grid's own samples; one asked beyond them, any of them again), its step time times
lognormal noise of sd ``--noise`` (the run-to-run noise of another machine or day), its wall time the record's. The exhaustive grid's
best per side is the cell with the lowest median over its recorded full samples; its cost, the sum of those
samples' walls. Printed, as Markdown, per ``finalists``: how often the search's best per side is within 3% of the
grid's (its grid median over the grid best's), the worst such gap, and the search's CPU/GPU-seconds over the grid's
(median and 90th percentile over runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from orchestrator.best import FULL, SCREENED, BestPlan, Halving
from orchestrator.crossover import Outcome
from orchestrator.store import Store, read_results
from orchestrator.sweep import load_sweep
from orchestrator.work import WorkItem

WITHIN = 0.03  # the goal: the search's best per side within 3% of the grid's


def record(plan: BestPlan, name: str, out: str, screen_samples: int) -> None:
    from trials.spec import TrialSpec
    from trials.trial import run_trial

    store = Store(out, name)
    store.ensure()
    done = store.final_keys()
    todo = [(where, k) for where in plan.wheres()
            for k in range(plan.samples if where[2] == FULL else screen_samples)]
    t_all = time.perf_counter()
    for n, (where, k) in enumerate(todo):
        item = WorkItem.of(plan.spec(*where), k)
        if item.key in done:
            continue
        t0 = time.perf_counter()
        rec = run_trial(TrialSpec.from_dict(item.spec), process_trial_index=n)
        wall = time.perf_counter() - t0
        rec.update(cell_id=item.cell_id, cell_label=item.label, sample=k, trial_wall_s=wall, run_id="record")
        store.write_record(rec)
        print(f"{n + 1}/{len(todo)} {item.label} s{k}: {rec['status']} {rec.get('step_ms_p50') or 0:.1f} ms, "
              f"{wall:.1f} s (all {time.perf_counter() - t_all:.0f} s)", flush=True)
    store.collect()


def recorded(plan: BestPlan, path: str) -> dict[tuple, list[dict]]:
    """(side, cell, phase) -> its records (status, ms, wall)."""
    by_id = {WorkItem.of(plan.spec(*w), 0).cell_id: w for w in plan.wheres()}
    rows = read_results(path).select(["cell_id", "sample", "status", "step_ms_p50", "trial_wall_s",
                                      "effective_precision", "launch_bound", "gpu_name"]).to_pylist()
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["cell_id"] in by_id:
            out.setdefault(by_id[r["cell_id"]], []).append(r)
    return out


def grid_best(plan: BestPlan, recs: dict[tuple, list[dict]]) -> tuple[dict[int, tuple[int, float]], float]:
    """Per side, the grid's best (cell, median ms over its ok full samples); the grid's seconds (every full sample)."""
    best, seconds = {}, 0.0
    for (s, i, phase), rows in recs.items():
        if phase != FULL:
            continue
        seconds += sum(r["trial_wall_s"] for r in rows[:plan.samples])
        ok = [r["step_ms_p50"] for r in rows if r["status"] == "ok"]
        if ok and (s not in best or statistics.median(ok) < best[s][1]):
            best[s] = (i, statistics.median(ok))
    return best, seconds


def replay_once(plan: BestPlan, recs: dict[tuple, list[dict]], rng: np.random.Generator, noise: float) -> Halving:
    """One search fed from the records: a cell's samples are its recorded ones in a random order (so its first
    ``samples`` are the grid's own, whose median the grid judges by), any further sample one of them again."""
    state, order = Halving(plan), {}
    while (decision := state.decide()).answer is None:
        for trial in decision.need:
            rows = recs.get(trial[:3])
            if not rows:
                raise SystemExit(f"replay: the search asks for {trial}, which the records do not have (record it)")
            k = trial[3]
            at = order.setdefault(trial[:3], rng.permutation(len(rows)))
            r = rows[int(at[k]) if k < len(rows) else int(rng.integers(len(rows)))]
            ms = None if r["step_ms_p50"] is None else r["step_ms_p50"] * math.exp(rng.normal(0.0, noise))
            state.observe(*trial, Outcome(r["status"], ms, r["trial_wall_s"] or 0.0, "", r["gpu_name"] or "",
                                          bool(r["launch_bound"]), r["effective_precision"]))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("record", "replay"))
    parser.add_argument("sweep")
    parser.add_argument("grid_dir", help="where the records go (record: GRID_DIR/<sweep name>) or are (replay: that, "
                        "or a sweep directory or results.parquet itself)")
    parser.add_argument("--screen-samples", type=int, default=2)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--finalists", type=int, nargs="*", help="default: the file's")
    parser.add_argument("--max-samples", type=int, help="default: the file's (samples + 2 unless it says)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    sweep = load_sweep(args.sweep)
    plan = sweep.search
    if not isinstance(plan, BestPlan):
        sys.exit(f"{args.sweep}: needs a search block with find: best")
    if args.mode == "record":
        record(plan, sweep.name, args.grid_dir, args.screen_samples)
        return
    where = Path(args.grid_dir) / sweep.name
    recs = recorded(plan, str(where if where.exists() else args.grid_dir))  # a store's parent, or the store itself
    best, grid_s = grid_best(plan, recs)
    screens = [r["trial_wall_s"] for (_, _, p), rows in recs.items() if p == SCREENED for r in rows]
    fulls = [r["trial_wall_s"] for (_, _, p), rows in recs.items() if p == FULL for r in rows]
    print(f"### {sweep.name}: {sum(len(s.cells) for s in plan.sides)} cells, {plan.samples} samples; the grid "
          f"{grid_s:.0f} s; a screen's wall {statistics.median(screens):.1f} s, a full trial's "
          f"{statistics.median(fulls):.1f} s (medians); replayed {args.runs} times, noise sd {args.noise}\n")
    for s, side in enumerate(plan.sides):
        i, ms = best[s]
        print(f"- grid best {side.label}: {side.cells[i].text}, {ms:.1f} ms")
    print("\n| finalists | within 3% of the grid's best, per side | worst gap | search seconds / grid's: median | "
          "p90 | trials: median |\n|---|---|---|---|---|---|")
    figures = []
    for finalists in args.finalists or [plan.finalists]:
        p = dataclasses.replace(plan, finalists=finalists, max_samples=args.max_samples or plan.max_samples)
        rng = np.random.default_rng(args.seed)
        hits, gaps, shares, trials = [0] * len(plan.sides), [], [], []
        for _ in range(args.runs):
            state = replay_once(p, recs, rng, args.noise)
            answer = state.decide().answer
            for s, found in enumerate(answer.sides):
                i = next(k for k, c in enumerate(plan.sides[s].cells) if c.text == found.winner.setting)
                grid_ms = statistics.median(r["step_ms_p50"] for r in recs[(s, i, FULL)] if r["status"] == "ok")
                gap = grid_ms / best[s][1] - 1.0
                gaps.append(gap)
                hits[s] += gap <= WITHIN
            shares.append(answer.gpu_seconds / grid_s)
            trials.append(answer.trials)
        within = ", ".join(f"{h / args.runs:.1%}" for h in hits)
        row = {"finalists": finalists, "within": [h / args.runs for h in hits], "worst_gap": max(gaps),
               "share_median": float(np.median(shares)), "share_p90": float(np.percentile(shares, 90)),
               "trials_median": float(np.median(trials))}
        figures.append(row)
        print(f"| {finalists} | {within} | {row['worst_gap']:.1%} | {row['share_median']:.0%} | "
              f"{row['share_p90']:.0%} | {row['trials_median']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sweep": sweep.name, "grid_seconds": grid_s, "runs": args.runs,
                                               "noise": args.noise, "rows": figures}, indent=1))


if __name__ == "__main__":
    main()
