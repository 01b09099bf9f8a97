"""Does the crossover search find what a dense grid finds, and for how much less GPU time?

Reads a search's records (the sweep directory of a ``search:`` sweep) and a dense grid's records over
the same cells (run in another directory, so the search could not reuse them), and prints, as
Markdown: the grid's speedup and 95% interval at every point, the grid's crossover (the smallest
point from which every point is above the target; also the first point above), the search's
bracket, whether the two agree within one step, and GPU-seconds (sum of ``trial_wall_s``) of each.
The grid's points are judged with the search's own rule (``Bisection.probe``) at the samples the
grid has. Usage:
    python benchmarks/crossover_vs_grid.py SEARCH.yaml SEARCH_DIR GRID_DIR [--replay]
(SEARCH_DIR, GRID_DIR: ``--out``/<sweep name> of each run, or their results.parquet.)

``--replay`` judges a change to the search itself without a GPU: this checkout's bisection is run
afresh with SEARCH_DIR's records as the only source of measurements (each trial it asks for is taken
from there, and the replay stops at one that is missing), so it says which of the recorded trials the
search would run now and their GPU-seconds. Those include each worker process's cold start only where
the recorded run happened to place it on a trial the replay keeps: the replay prints what the dropped
trials' cold starts were, to bound that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from orchestrator.answer import Answer
from orchestrator.crossover import SIDES, Bisection
from orchestrator.search import Search
from orchestrator.store import Store, read_results
from orchestrator.sweep import load_sweep


def observed(plan, path: str, scratch: str) -> Search:
    """The plan's search with every record at ``path`` (a sweep directory or its results.parquet) observed."""
    search = Search(plan, Store(scratch, "none"))
    search.observe_records(read_results(path).select(search.columns).to_pylist())
    return search


def cold_starts(search: Search, path: str) -> dict[tuple[str, int, int], float]:
    """(side, x, sample) of each worker process's first trial -> its start-up: its wall time beyond the
    same cell's other samples, less its first step (the shape's compile, which a replay that drops the
    cell does not need elsewhere)."""
    rows = read_results(path).select(["cell_id", "sample", "process_trial_index", "trial_wall_s",
                                      "first_step_s"]).to_pylist()
    rest = {}  # cell id -> wall time less first step of its samples that were not a process's first
    for r in rows:
        if r["process_trial_index"]:
            rest.setdefault(r["cell_id"], []).append(r["trial_wall_s"] - r["first_step_s"])
    return {(*search.cells[r["cell_id"]], int(r["sample"])):
            max(0.0, r["trial_wall_s"] - r["first_step_s"] - statistics.median(rest.get(r["cell_id"]) or [0.0]))
            for r in rows if r["cell_id"] in search.cells and r["process_trial_index"] == 0}


def replay(searched: Search, cold: dict[tuple[str, int, int], float]) -> tuple[Answer, float]:
    """This checkout's bisection fed only from ``searched``'s records; (its answer, the start-up seconds
    of the worker processes whose first trial it does not ask for)."""
    recorded = searched.state.seen
    again = Bisection(searched.plan)
    while (decision := again.decide()).answer is None:
        missing = [t for t in decision.need if t not in recorded]
        if missing:
            raise SystemExit(f"replay: the search now asks for {missing[0]}, which the records do not have")
        for t in decision.need:
            again.observe(*t, recorded[t])
    return decision.answer, sum(v for t, v in cold.items() if t not in again.seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep")
    parser.add_argument("search_dir")
    parser.add_argument("grid_dir")
    parser.add_argument("--json", help="also write the comparison here")
    parser.add_argument("--replay", action="store_true", help="replay this checkout's search on SEARCH_DIR's records")
    args = parser.parse_args()
    plan = load_sweep(args.sweep).search
    with tempfile.TemporaryDirectory() as scratch:
        searched, dense = observed(plan, args.search_dir, scratch), observed(plan, args.grid_dir, scratch)
    answer, dropped = (replay(searched, cold_starts(searched, args.search_dir)) if args.replay
                       else (searched.answer(), 0.0))

    rows, above = [], []
    for x in plan.points:
        n = min(sum((side, x, s) in dense.state.seen for s in range(plan.max_samples)) for side in SIDES)
        probe = dense.state.probe(x, n) if n >= 1 else None
        rows.append((x, probe))
        above.append(probe is not None and probe.verdict == "above")
    first = next((x for (x, _), a in zip(rows, above) if a), None)
    from_here = next((plan.points[i] for i in range(len(above)) if all(above[i:])), None)
    grid_s = sum(o.wall_s for o in dense.state.seen.values())
    grid_trials = len(dense.state.seen)
    step = {x: i for i, x in enumerate(plan.points)}
    agree = (answer.crossover is not None and from_here is not None
             and abs(step[answer.crossover] - step[from_here]) <= 1)

    print(f"### {plan.label('variant')} vs {plan.label('baseline')}, target {plan.target:.2f}x\n")
    print(f"| {plan.axis} | grid speedup | 95% CI | grid verdict | probed by the search |")
    print("|---|---|---|---|---|")
    probed = {p.x: p for p in answer.probes}
    for x, p in rows:
        got = probed.get(x)
        mark = f"{got.ratio:.3f}x [{got.ci_low:.3f}, {got.ci_high:.3f}], {got.samples} samples" if got and got.ratio else ""
        if p is None or p.ratio is None:
            print(f"| {x} | - | - | {p.verdict + ': ' + p.why if p else 'no records'} | {mark} |")
        else:
            print(f"| {x} | {p.ratio:.3f}x | [{p.ci_low:.3f}, {p.ci_high:.3f}] | {p.verdict} | {mark} |")
    print()
    print(f"- grid: above from {plan.axis} {from_here} on (first point above: {first}); "
          f"{grid_trials} trials, {grid_s:.0f} GPU-s")
    print(f"- search{' (replayed on the recorded trials)' if args.replay else ''}: {answer.statement}")
    print(f"- search bracket {answer.bracket} vs grid {from_here}: "
          f"{'agree within one step' if agree else 'DISAGREE'}; GPU-seconds {answer.gpu_seconds:.0f} / {grid_s:.0f} "
          f"= {answer.gpu_seconds / grid_s:.0%} of the grid's" if grid_s else "- no grid records")
    if args.replay:
        print(f"- the recorded run's worker start-ups on trials the replay drops: {dropped:.0f} s (with them: "
              f"{(answer.gpu_seconds + dropped) / grid_s:.0%} of the grid's)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "variant": plan.label("variant"), "baseline": plan.label("baseline"), "target": plan.target,
            "grid_crossover": from_here, "grid_first_above": first, "grid_trials": grid_trials, "grid_gpu_s": grid_s,
            "search_crossover": answer.crossover, "search_bracket": answer.bracket, "search_trials": answer.trials,
            "search_gpu_s": answer.gpu_seconds, "agree_within_one_step": agree, "replayed": args.replay,
            "replay_dropped_start_up_s": dropped,
            "grid": [{"x": x, **({"ratio": p.ratio, "ci": [p.ci_low, p.ci_high], "verdict": p.verdict} if p else {})}
                     for x, p in rows]}, indent=1))


if __name__ == "__main__":
    main()
