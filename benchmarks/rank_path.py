"""Two checks of the multi-rank path on one GPU (issue 20's "GPU now"):

1. ``ray``: the same cell at world_size 1 through the Ray Train path (``orchestrator.launchers.ranks.run_ranks``,
   a TorchTrainer with one worker) and through the warm launcher (today's world_size 1 path), alternating,
   ``--rounds`` times each: the ratio of the median step_ms_p50s (goal: within 2%).
2. ``fsdp``: FSDP2 on a group of one rank (torchrun, ``--parallel fsdp``) against the same cell without
   ``parallel``, for each given stack: the largest difference of their loss curves and both p50s.

Usage: python benchmarks/rank_path.py ray [--rounds 3]   |   python benchmarks/rank_path.py fsdp [--cpu]
       [--only NAME-PART ...]

``fsdp --cpu`` runs the torchao cells on CPU in fp32 (gloo, a small shape, each with and without
``compile``): whether a difference of the loss curves comes from FSDP2 itself or from compiling the
sharded model, on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CELL = {"d_model": 2048, "n_layers": 4, "device": "cuda", "train_steps": 12, "warmup_steps": 5,
        "bench_steps": 20, "repeats": 2, "profile": False}
FSDP_CELLS = [  # (name, spec fields)
    ("te fp8 delayed", {"backend": "te", "precision": "fp8", "recipe": "delayed"}),
    ("te fp8 current", {"backend": "te", "precision": "fp8", "recipe": "current"}),
    ("torchao tensorwise, compiled", {"backend": "torchao", "precision": "fp8", "recipe": "tensorwise",
                                      "compile": True}),
    ("torchao tensorwise, compiled, fp8 all-gather", {"backend": "torchao", "precision": "fp8",
                                                       "recipe": "tensorwise", "compile": True,
                                                       "fp8_all_gather": True}),
    # TE's FP8 primary weights (quantized_model_init) all-gathered in FP8, FusedAdam's fp32 masters; the
    # one-process run they are held against is the same recipe with BF16 weights and AdamW
    *((f"te fp8 {r}, fp8 weights + all-gather", {"backend": "te", "precision": "fp8", "recipe": r,
                                                 "fp8_all_gather": True}) for r in ("delayed", "current", "block")),
]
RAY_CELLS = [("te bf16", {"backend": "te", "precision": "bf16"}),
             ("te fp8 delayed", {"backend": "te", "precision": "fp8", "recipe": "delayed"})]


def ray_check(rounds: int, cells: list[tuple[str, dict]]) -> None:
    import ray

    from orchestrator.launchers import LaunchSettings, make_launcher
    from orchestrator.launchers.ranks import run_ranks
    from trials import TrialSpec

    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, log_to_driver=False)
    for _, fields in cells:
        spec = TrialSpec.from_dict({**CELL, **fields}).to_dict()
        launcher = make_launcher(LaunchSettings("warm", 32))
        got: dict[str, list[float]] = {"launcher": [], "ray train": []}
        with tempfile.TemporaryDirectory() as storage:
            for r in range(rounds):
                out = launcher.run(spec, 600)
                got["launcher"].append(out.record["step_ms_p50"])
                ranks = run_ranks({**spec, "world_size": 1}, {}, True, 1, storage, f"ws1-{r}")
                rec = ranks.record
                assert rec is not None and rec["status"] == "ok", ranks.log_text[-2000:]
                got["ray train"].append(rec["step_ms_p50"])
        launcher.close()
        a, b = statistics.median(got["launcher"]), statistics.median(got["ray train"])
        print(f"{fields}: launcher p50s {[round(v, 3) for v in got['launcher']]} ms, ray train p50s "
              f"{[round(v, 3) for v in got['ray train']]} ms; median ray train / launcher = {b / a:.4f}", flush=True)
    ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(fields: dict, ranks: bool, out: Path) -> dict:
    launch = [sys.executable, "-m", "trials"] if not ranks else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={_free_port()}",
        "-m", "trials"]
    spec = {**CELL, **fields, **({"parallel": "fsdp"} if ranks else {})}
    run = subprocess.run([*launch, "--spec-json", json.dumps(spec), "--json", str(out), "-q"], cwd=REPO,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    if not out.exists():
        raise SystemExit(f"{fields} ranks={ranks}: no record (rc {run.returncode}): {run.stderr[-3000:]}")
    return json.loads(out.read_text())


CPU_CELL = {"device": "cpu", "d_model": 64, "n_layers": 2, "seq_len": 32, "batch_size": 8, "warmup_steps": 1,
            "bench_steps": 2, "repeats": 1}
CPU_FSDP_CELLS = [(f"torchao tensorwise, {'compiled' if compiled else 'eager'}", {**fields, "compile": compiled})
                  for name, fields in FSDP_CELLS if fields["backend"] == "torchao" and not fields.get("fp8_all_gather")
                  for compiled in (False, True)]


def fsdp_check(cells: list[tuple[str, dict]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in cells:
            one = trial({k: v for k, v in fields.items() if k != "fp8_all_gather"}, False, Path(tmp, "one.json"))
            sharded = trial(fields, True, Path(tmp, "fsdp.json"))
            if sharded["status"] != "ok" or one["status"] != "ok":
                print(f"{name}: one process {one['status']} {one.get('error') or ''}; FSDP2 {sharded['status']} "
                      f"{(sharded.get('error') or '')[:600]}", flush=True)
                continue
            diff = max(abs(a - b) for a, b in zip(one["loss_curve"], sharded["loss_curve"]))
            print(f"{name}: FSDP2 ws1 loss {sharded['loss_curve'][-1]:.5f} vs one process {one['loss_curve'][-1]:.5f}, "
                  f"max |diff| over {len(one['loss_curve'])} steps {diff:.2e}; p50 {sharded['step_ms_p50']:.3f} vs "
                  f"{one['step_ms_p50']:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("ray", "fsdp"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=CELL["d_model"],
                        help="2048 (default) is launch-bound in eager mode: its p50 moves by ~10%% between runs")
    parser.add_argument("--cpu", action="store_true", help="fsdp: the torchao cells on CPU, fp32, a small shape")
    parser.add_argument("--only", action="append", default=[],
                        help="run only the cells whose name contains this (repeatable), e.g. 'fp8 weights'")
    args = parser.parse_args()
    CELL["d_model"] = args.d_model
    if args.cpu:
        CELL.update(CPU_CELL)
    cells = RAY_CELLS if args.check == "ray" else CPU_FSDP_CELLS if args.cpu else FSDP_CELLS
    cells = [c for c in cells if not args.only or any(o in c[0] for o in args.only)]
    ray_check(args.rounds, cells) if args.check == "ray" else fsdp_check(cells)


if __name__ == "__main__":
    main()
