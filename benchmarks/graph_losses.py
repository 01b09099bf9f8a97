"""Does a graphed cell train as its eager twin does? Issue 56's loss goal, measured.

For each ``cuda_graphs: true`` cell of a sweep file (``--only``: label substrings), runs the cell and its eager twin
(the same spec, ``cuda_graphs: false``) ``--repeats`` times each at the same seed for ``--steps`` training steps, and
prints the largest relative difference of two loss curves, step by step: eager against eager (the stack's own
run-to-run noise at one seed: atomics in some backward kernels, TE's and Inductor's choices), graphed against
graphed, and graphed against eager. The goal: graphed against eager within that noise; where the noise is 0 (a
bit-reproducible stack) any difference is reported as it is. The losses are the trial's own (``loss_curve``), so
this runs ``run_trial`` itself, one process, nothing timed.

Usage: PYTHONPATH=. python benchmarks/graph_losses.py examples/full-depth-graphs.yaml [--only te-fp8] [--steps 50]
       [--repeats 2] [--layers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

from orchestrator.sweep import load_sweep
from trials import TrialSpec, run_trial


def curve(spec: TrialSpec) -> list[float] | None:
    """The trial's loss curve (None where it did not end ok: its status and error are printed)."""
    record = run_trial(spec)
    if record["status"] != "ok":
        print(f"  {record['status']}: {record.get('error')}", flush=True)
        return None
    return list(record["loss_curve"])


def largest(a: list[list[float]], b: list[list[float]]) -> float | None:
    """The largest relative difference between a curve of ``a`` and one of ``b`` (pairs of distinct runs)."""
    pairs = [(x, y) for x, y in itertools.product(a, b) if x is not y]
    if not pairs:
        return None
    return max(abs(p - q) / max(abs(q), 1e-12) for x, y in pairs for p, q in zip(x, y))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--only", nargs="+", default=[""], help="graphed cells whose label contains any of these")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, help="n_layers for every cell (fewer than the sweep's, to fit a call)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cells = [c for c in load_sweep(args.sweep).cells if c.spec.cuda_graphs and any(o in c.label for o in args.only)]
    if not cells:
        print(f"{args.sweep}: no cuda_graphs cell matches --only {args.only}", file=sys.stderr)
        return 2
    rows = []
    for cell in cells:
        short = dict(train_steps=args.steps, warmup_steps=1, bench_steps=1, profile=False, fp8_reads=False, gen_len=0)
        if args.layers:
            short["n_layers"] = args.layers
        graphed = dataclasses.replace(cell.spec, **short)
        eager = dataclasses.replace(graphed, cuda_graphs=False)
        print(f"== {cell.label}: {args.steps} steps, {args.repeats} runs each", flush=True)
        runs = {name: [c for c in (curve(s) for _ in range(args.repeats)) if c is not None]
                for name, s in (("eager", eager), ("graphed", graphed))}
        row = {"cell": cell.label, "steps": args.steps,
               "eager_vs_eager": largest(runs["eager"], runs["eager"]),
               "graphed_vs_graphed": largest(runs["graphed"], runs["graphed"]),
               "graphed_vs_eager": largest(runs["graphed"], runs["eager"]),
               "loss_final": {k: [c[-1] for c in v] for k, v in runs.items()}}
        noise = max((v for v in (row["eager_vs_eager"], row["graphed_vs_graphed"]) if v is not None), default=None)
        row["within_noise"] = None if noise is None or row["graphed_vs_eager"] is None \
            else row["graphed_vs_eager"] <= noise
        print("  largest relative loss difference over the curve: " + ", ".join(
            f"{k.replace('_', ' ')} {row[k]:.2e}" if row[k] is not None else f"{k.replace('_', ' ')} n/a"
            for k in ("eager_vs_eager", "graphed_vs_graphed", "graphed_vs_eager"))
            + f"; final losses {row['loss_final']}; within noise: {row['within_noise']}", flush=True)
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
