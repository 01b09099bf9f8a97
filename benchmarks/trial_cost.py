"""Where a warm trial process's seconds go: cells run one after another in this process under cProfile.

A sweep's trial server runs its cells in turn in one process; this runs the same cells the same way
(``trials.run_trial``, ``process_trial_index`` counting up, one ``teacher_forced.Partners`` for all) and
prints, per cell, the record's phase fields (``startup_s``, ``first_step_s``, ``train_s``, ``bench_s``,
``energy_window_s``, ``profile_s``, ``gen_s``, ``tf_s``, ``duration_s``), then the functions with the most
cumulative time over all cells and torch.compile's own account (TE compiles its fusers with ``torch.compile``).
Inductor and Triton caches go where ``--cache`` says (a fresh directory: a cold first sweep; reuse one for a
warm one). cProfile slows Python-bound steps: read the phases against each other, not as the trial's timings.

    python benchmarks/trial_cost.py --cells te-bf16,te-fp8-delayed,te-fp8-current,torch-bf16 \\
        --d-model 768 --n-layers 4 --cache /tmp/cc [--top 50] [--no-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

PHASES = ("startup_s", "first_step_s", "train_s", "bench_s", "energy_window_s", "profile_s", "gen_s", "tf_s",
          "duration_s", "step_ms_p50")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="te-bf16,te-fp8-delayed,te-fp8-current,torch-bf16",
                    help="backend-precision[-recipe], comma-separated, run in this order")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", help="Inductor/Triton cache directory (default: torch's own)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=50)
    ap.add_argument("--no-profile", action="store_true", help="time the phases only")
    args = ap.parse_args()
    if args.cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(args.cache, "triton")
    t0 = time.perf_counter()
    from trials import TrialSpec
    from trials.workloads.teacher_forced import Partners
    from trials.trial import run_trial

    print(f"import trials {time.perf_counter() - t0:.1f} s", flush=True)
    prof = None if args.no_profile else cProfile.Profile()
    partners = Partners()  # as a trial server keeps one: FP8 cells sharing a BF16 partner train it once
    for i, cell in enumerate(args.cells.split(",")):
        backend, precision, *recipe = cell.split("-")
        spec = TrialSpec(backend=backend, precision=precision, d_model=args.d_model, n_layers=args.n_layers,
                         repeats=args.repeats, device=args.device, **({"recipe": recipe[0]} if recipe else {}))
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        record = run_trial(spec, process_trial_index=i, partners=partners)
        if prof is not None:
            prof.disable()
        phases = " ".join(f"{p} {record[p]:.2f}" for p in PHASES if isinstance(record.get(p), float))
        print(f"{cell}: {record['status']} wall {time.perf_counter() - t:.2f} s; {phases}", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    import torch._dynamo.utils

    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
