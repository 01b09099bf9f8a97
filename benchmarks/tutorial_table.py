"""The tutorial's configuration (768x4, batch 32, seq 256) in every backend/precision, eager and graphed.

Runs each cell as a real trial (``trials.run_trial``) in this process and prints one table.
Usage: python benchmarks/tutorial_table.py [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging

from trials import TrialSpec, run_trial

CELLS = [
    ("torch", "bf16", None),
    ("te", "bf16", None),
    ("te", "fp8", "delayed"),
    ("te", "fp8", "current"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for graphs in (False, True):
        for backend, precision, recipe in CELLS:
            spec = TrialSpec(backend=backend, precision=precision, recipe=recipe or "delayed",
                             cuda_graphs=graphs, repeats=args.repeats, device="cuda")
            rows.append(run_trial(spec))
    header = (f"{'backend':7} {'prec':5} {'recipe':8} {'graphs':6} {'status':7} {'p50 ms':>8} {'mean ms':>8} "
              f"{'std ms':>7} {'host ms':>8} {'launch':>6} {'TFLOP/s':>8} {'loss0':>6} {'lossN':>6} {'stride':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        def f(key, spec=".2f"):
            return format(r[key], spec) if isinstance(r[key], (int, float)) else "-"
        print(f"{r['backend']:7} {r['precision']:5} {str(r['effective_recipe'] or '-'):8} {str(r['cuda_graphs']):6} "
              f"{r['status']:7} {f('step_ms_p50'):>8} {f('step_ms_mean'):>8} {f('step_ms_std'):>7} "
              f"{f('host_ms_per_step'):>8} {str(r['launch_bound']):>6} {f('model_tflops', '.1f'):>8} "
              f"{f('loss_first', '.3f'):>6} {f('loss_final', '.3f'):>6} {f('gen_stride_accuracy', '.2f'):>6}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh)


if __name__ == "__main__":
    main()
