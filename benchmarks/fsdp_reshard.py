"""Why does TE delayed scaling train differently under FSDP2 at world_size 1 when current scaling does not?

The hypothesis: FSDP2 frees each block's unsharded weights after forward (``reshard_after_forward``) and
gathers them again for backward, where TE casts the BF16 weight to FP8 a second time; under delayed
scaling that cast uses the scale already updated when the forward's ``te.autocast`` ended, not the one
forward used (current scaling takes the scale from the tensor itself, so both casts agree). If so, the
FSDP2 loss curve equals the one-process curve when the weights stay gathered (``reshard_after_forward=False``).

Runs the same cell three ways and prints where each loss curve first leaves the one-process one:
one process; FSDP2 (torchrun, one rank); FSDP2 with ``reshard_after_forward=False``.

Usage: python benchmarks/fsdp_reshard.py [--recipe delayed] [--d-model 2048]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _rank_main(argv: list[str]) -> int:
    """Inside torchrun: FSDP2's fully_shard with reshard_after_forward=False, then the ordinary trial CLI."""
    import torch.distributed.fsdp as fsdp

    fsdp.fully_shard = functools.partial(fsdp.fully_shard, reshard_after_forward=False)
    from trials.cli import main

    return main(argv)


def main() -> None:
    from rank_path import CELL, _free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--d-model", type=int, default=CELL["d_model"])
    args = parser.parse_args()
    spec = {**CELL, "d_model": args.d_model, "backend": "te", "precision": "fp8", "recipe": args.recipe}
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1"]
    ways = {
        "one process": [sys.executable, "-m", "trials"],
        "FSDP2": [*torchrun, f"--master-port={_free_port()}", "-m", "trials"],
        "FSDP2, reshard_after_forward=False": [*torchrun, f"--master-port={_free_port()}", __file__, "--rank"],
    }
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, launch in ways.items():
            out = Path(tmp, "r.json")
            fields = {**spec, **({} if name == "one process" else {"parallel": "fsdp"})}
            run = subprocess.run([*launch, "--spec-json", json.dumps(fields), "--json", str(out), "-q"], cwd=REPO,
                                 env=env, capture_output=True, text=True, timeout=600)
            rec = json.loads(out.read_text()) if out.exists() else {"status": f"no record (rc {run.returncode})"}
            if rec.get("status") != "ok":
                print(f"{name}: {rec.get('status')} {rec.get('error') or run.stderr[-1500:]}", flush=True)
                continue
            curves[name] = rec["loss_curve"]
            out.unlink()
    base = curves.get("one process")
    for name, curve in curves.items():
        first = next((i for i, (a, b) in enumerate(zip(base, curve)) if a != b), None) if base else None
        diff = max(abs(a - b) for a, b in zip(base, curve)) if base else float("nan")
        print(f"recipe {args.recipe}, {name}: final loss {curve[-1]:.5f}; first step that differs from one process: "
              f"{first}; max |diff| {diff:.2e}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.exit(_rank_main(sys.argv[2:]))
    main()
