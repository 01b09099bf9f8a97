"""Sweep throughput: the same sweep file through each launcher, one after the other, on this machine.

For every launcher it runs ``juicytalk sweep FILE --launcher L --restart`` into OUT/L and prints, from
the records: wall, busy fraction, median per-trial overhead, median first step, trials per process.
Then it checks what must not change with the launcher:
  * p50 step time of every GPU-bound cell (not launch_bound), each launcher against the first one and
    against a reference result set (--reference, e.g. the committed docs/results/h200 study);
  * peak allocated memory per cell against the first launcher (a warm process must report each
    trial's own peak), and the memory a trial found still allocated at its start.
Usage: python benchmarks/sweep_throughput.py examples/scaling.yaml --out /tmp/jt
         [--launchers warm process] [--reference docs/results/h200/results.parquet] [--skip-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.efficiency import run_efficiency  # noqa: E402
from orchestrator.store import read_results  # noqa: E402
from orchestrator.sweep import load_sweep  # noqa: E402

TOLERANCE = 0.02  # p50 agreement goal between launchers and with the reference


def run(sweep_file: str, out: Path, launcher: str) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "orchestrator.cli", "sweep", sweep_file, "--out", str(out / launcher),
           "--launcher", launcher, "--restart", "--no-report", "--no-progress"]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    print("\n".join(done.stdout.strip().splitlines()[-6:]), flush=True)
    if done.returncode:
        print(done.stderr[-3000:], flush=True)
    return time.perf_counter() - t0


def cells(path: Path) -> pd.DataFrame:
    df = read_results(str(path)).to_pandas()
    return df[df["status"] == "ok"].set_index("cell_id")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--out", required=True)
    ap.add_argument("--launchers", nargs="+", default=["warm", "process"])
    ap.add_argument("--reference", help="results.parquet to compare GPU-bound p50s with")
    ap.add_argument("--skip-run", action="store_true", help="only analyse earlier runs in --out")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    name = load_sweep(args.sweep).name
    walls = {}
    for launcher in args.launchers:
        if not args.skip_run:
            walls[launcher] = run(args.sweep, out, launcher)

    print("\nlauncher  trials  wall_s  busy  busy/GPU  overhead_s  first_step_s  trials/process  driver_s")
    results = {}
    for launcher in args.launchers:
        df = read_results(str(out / launcher / name)).to_pandas()
        results[launcher] = df[df["status"] == "ok"].set_index("cell_id")
        for _, e in run_efficiency(df).iterrows():
            print(f"{launcher:9} {e['trials']:6d} {e['wall_s']:7.1f} {e['busy_fraction']:5.2f} {e['busy_per_gpu']:9.2f} "
                  f"{e['overhead_s_median']:11.2f} {e['first_step_s_median']:13.2f} {e['trials_per_process']:15.1f} "
                  f"{walls.get(launcher, float('nan')):9.1f}")

    base_name = args.launchers[0]
    base = results[base_name]
    reference = cells(Path(args.reference)) if args.reference else None
    print(f"\nGPU-bound cells (launch_bound False): p50 ms, ratio to {base_name}"
          + (" and to the reference" if reference is not None else "") + f"; goal within {TOLERANCE:.0%}")
    worst = {}
    for cid, row in base.sort_values(["d_model", "cell_label"]).iterrows():
        if row["launch_bound"] is not False and row["launch_bound"] != 0:
            continue
        parts = [f"{row['cell_label']:32} {base_name} {row['step_ms_p50']:8.3f}"]
        for launcher in args.launchers[1:]:
            if cid in results[launcher].index:
                other = results[launcher].loc[cid, "step_ms_p50"]
                ratio = other / row["step_ms_p50"]
                worst[launcher] = max(worst.get(launcher, 0), abs(ratio - 1))
                parts.append(f"{launcher} {other:8.3f} ({ratio:.3f})")
        if reference is not None and cid in reference.index:
            ref = reference.loc[cid, "step_ms_p50"]
            for launcher in args.launchers:
                if cid in results[launcher].index:
                    ratio = results[launcher].loc[cid, "step_ms_p50"] / ref
                    worst[f"{launcher} vs reference"] = max(worst.get(f"{launcher} vs reference", 0), abs(ratio - 1))
            parts.append(f"reference {ref:8.3f}")
        print("  ".join(parts))
    for key, value in worst.items():
        print(f"largest p50 difference, {key}: {value:.2%} ({'within' if value <= TOLERANCE else 'OUTSIDE'} the goal)")

    print("\npeak allocated memory (GiB) per cell; mem_at_start = still allocated when the trial began")
    for cid, row in base.sort_values(["d_model", "cell_label"]).iterrows():
        if pd.isna(row["peak_mem_allocated_bytes"]):
            continue
        parts = [f"{row['cell_label']:32} {base_name} {row['peak_mem_allocated_bytes'] / 2**30:7.3f}"]
        for launcher in args.launchers[1:]:
            if cid in results[launcher].index:
                r = results[launcher].loc[cid]
                parts.append(f"{launcher} {r['peak_mem_allocated_bytes'] / 2**30:7.3f} "
                             f"(ratio {r['peak_mem_allocated_bytes'] / row['peak_mem_allocated_bytes']:.3f}, "
                             f"at start {r['mem_at_start_bytes'] / 2**20:.0f} MiB, index {r['process_trial_index']})")
        parts.append(f"[{base_name} at start {row['mem_at_start_bytes'] / 2**20:.0f} MiB, "
                     f"index {row['process_trial_index']}]")
        print("  ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
