"""What the kernel breakdown costs a trial, and whether tracing host operators changes what it finds.

Builds one cell's training step, times nothing, and profiles the same steps twice with
trials/measure/kernels.py: kernels only (what trials do) and kernels plus host operators. Prints each
profile's wall time and per-class ms per step.
Usage: python benchmarks/profile_cost.py [--backend te] [--precision bf16] [--d-model 4096] [--steps 3]
"""

from __future__ import annotations

import argparse

import torch

from trials import TrialSpec
from trials.workloads.data import ArithmeticSequences
from trials.measure.kernels import profile
from trials.workloads.train_step import build_train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="te")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    spec = TrialSpec(backend=args.backend, precision=args.precision, recipe=args.recipe, d_model=args.d_model,
                     device="cuda")
    step = build_train_step(spec, spec.backend, spec.precision, "cuda")
    x, y = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", 0).batch(spec.batch_size)
    for _ in range(5):
        step(x, y)
    torch.cuda.synchronize()
    for host_ops in (False, True, False):
        b = profile(lambda: step(x, y), args.steps, "cuda", host_ops=host_ops)
        classes = ", ".join(f"{c} {v:.2f}" for c, v in b.ms().items() if v)
        print(f"host_ops={host_ops}: profile {b.profile_s:.3f} s, kernels {b.total_ms:.2f} ms/step ({classes})",
              flush=True)


if __name__ == "__main__":
    main()
