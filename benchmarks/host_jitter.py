"""Why a launch-bound step's time moves between runs of one model: Python's garbage collector, or not?

TE's FP8 swap cell of the full-depth study is launch-bound (the GPU waits on the host's Python a third of the
step), and its plain loop read 212-269 ms from one run to the next in one process (te_hf_loop.py, an H100), with
TE's process-wide state reset between runs. This runs te_hf_loop's plain loop ``--runs`` times with Python's
collector on (as a user's loop runs) and ``--runs`` times off during the timed steps (as ``timeit`` times),
alternating, and prints per run the GPU ms per step, the host's ms in a step's Python and the collections that
ran during the timed steps with the time they took.

    PYTHONPATH=. python benchmarks/host_jitter.py --model llama --d-model 4096 --n-layers 32 --n-heads 32 \\
        --n-kv-heads 8 --ffn 14336 --vocab 128256 --seq-len 256 --batch-size 8 --te-layer swap --runs 3
"""

from __future__ import annotations

import sys

from te_hf_loop import plain_loop, runs_parser, runs_setup  # benchmarks/ is this script's directory


def main() -> int:
    args = runs_parser(__doc__.split("\n")[0], steps=20).parse_args()
    te, recipe, shape = runs_setup(args)
    for run in range(args.runs):
        for gc_off in (False, True):
            r = plain_loop(shape, te, args.te_layer, recipe, args.steps, args.warmup, gc_off=gc_off)
            print(f"run {run}: {r['ms_p50']:.2f} ms/step (min {r['ms_min']:.2f}, max {r['ms_max']:.2f}), host "
                  f"{r['host_ms_p50']:.2f} ms; {r['gc']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
