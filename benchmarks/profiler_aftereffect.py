"""Does profiling one trial slow the trials after it in the same process? (trials/measure/kernels.py profiles
every trial after its timed steps, and the warm launcher runs many trials in one process.)

Runs each cell three times in this one process: profile off, profile on, profile off again, and
prints the timed number of each. If the third run is slower than the first, the profiler leaves
something behind (CUPTI callbacks, kineto state) and later trials pay for it.
Usage: python benchmarks/profiler_aftereffect.py [CELL ...]  (on a GPU; TE for the te cells)
"""

from __future__ import annotations

import argparse
import logging

from trials import TrialSpec, run_trial

CELLS = {
    "torch bf16 eager train 1024x4 (launch-bound)": dict(backend="torch", d_model=1024, train_steps=5, bench_steps=30,
                                                         repeats=2),
    "te bf16 graphed decode 4096x4 b32": dict(workload="infer", backend="te", d_model=4096, batch_size=32,
                                              cuda_graphs=True, prompt_len=128, gen_len=64, bench_steps=3,
                                              train_steps=5),
    "te bf16 eager train 1024x4 (launch-bound)": dict(backend="te", d_model=1024, train_steps=5, bench_steps=30,
                                                      repeats=2),
}


def timed(record: dict) -> float:
    return record["decode_ms_per_token_p50"] if record["workload"] == "infer" else record["step_ms_p50"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cells", nargs="*", type=int, help="indices into CELLS (default: all), one process each is "
                        "cleanest: TE's fusers recompile across shapes in one process")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for i, (name, values) in enumerate(CELLS.items()):
        if args.cells and i not in args.cells:
            continue
        out = []
        for profile in (False, True, False):
            record = run_trial(TrialSpec(device="cuda", profile=profile, **values))
            assert record["status"] == "ok", record["error"]
            out.append(f"profile={profile}: {timed(record):.4f} ms (host issue {record['host_ms_per_step'] or 0:.3f})")
        print(f"{name}: " + "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
