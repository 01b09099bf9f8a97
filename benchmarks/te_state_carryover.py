"""Does Transformer Engine's FP8 state, left in the process by an earlier model, slow the next one?

Under delayed scaling TE registers every FP8 module, on its first forward, in process-wide amax buffers
(``FP8GlobalStateManager``), and at each autocast exit reduces and rescales over all of them: this model's and
every earlier one's, until ``FP8GlobalStateManager.reset()``. ``run_trial`` resets at its end (and, since this
script, at its start too), but a plain loop in the same process did not: benchmarks/te_hf_loop.py ran trial,
plain, trial, plain in one process, so the second trial reduced the first plain loop's amaxes on every step.

This runs te_hf_loop's plain loop ``--runs`` times keeping TE's state (each run a new model, the earlier ones'
amaxes still registered), then ``--runs`` times resetting it after each, and prints per run the amax tensors
registered before it, the GPU ms per step (CUDA events, median) and the host's ms in a step's Python.

    PYTHONPATH=. python benchmarks/te_state_carryover.py --model llama --d-model 4096 --n-layers 32 --n-heads 32 \\
        --n-kv-heads 8 --ffn 14336 --vocab 128256 --seq-len 256 --batch-size 8 --te-layer swap --runs 3
"""

from __future__ import annotations

import sys

import torch

from te_hf_loop import plain_loop, runs_parser, runs_setup  # benchmarks/ is this script's directory
from trials.backends import te_compat


def main() -> int:
    args = runs_parser(__doc__.split("\n")[0], steps=10).parse_args()
    te, recipe, shape = runs_setup(args)
    for reset in (False, True):
        te_compat.reset_te_state()
        for run in range(args.runs):
            before = te_compat.registered_amax_tensors()
            r = plain_loop(shape, te, args.te_layer, recipe, args.steps, args.warmup, reset=reset)
            print(f"{'reset after each' if reset else 'state kept'} run {run}: {before} amax tensors registered "
                  f"before, {r['ms_p50']:.2f} ms/step (min {r['ms_min']:.2f}), host {r['host_ms_p50']:.2f} ms, "
                  f"memory allocated after {torch.cuda.memory_allocated() / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
