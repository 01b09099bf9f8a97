"""Where does an eager training step spend its host time? torch.profiler over a few steps.

Prints the top operators by self CPU time and the host vs device time per step, for one config
(default: the tutorial's 768x4 TE BF16). Also times ``import transformer_engine.pytorch``.
Usage: python benchmarks/profile_step.py [--backend te] [--precision bf16] [--recipe delayed]
       [--d-model 768] [--steps 5] [--sort cpu|device]
"""

from __future__ import annotations

import argparse
import time

t_import = time.perf_counter()
import torch  # noqa: E402

torch_import_s = time.perf_counter() - t_import

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from trials import TrialSpec  # noqa: E402
from trials.backends import te_compat
from trials.workloads.data import ArithmeticSequences  # noqa: E402
from trials.workloads.train_step import build_train_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="te")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--sort", choices=("cpu", "device"), default="cpu",
                        help="rank operators by self host time (launch overhead) or by GPU kernel time")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.backend == "te":
        te_compat.import_te()
    te_import_s = time.perf_counter() - t0
    print(f"import torch {torch_import_s:.2f}s; import transformer_engine.pytorch {te_import_s:.2f}s")
    spec = TrialSpec(backend=args.backend, precision=args.precision, recipe=args.recipe, d_model=args.d_model,
                     n_layers=args.n_layers, device="cuda")
    step = build_train_step(spec, spec.backend, spec.precision, "cuda")
    x, y = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", 0).batch(spec.batch_size)
    for _ in range(10):
        step(x, y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        host = (time.perf_counter() - t) / args.steps
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
    events = prof.key_averages()
    # Kernel-level events only, as the table's footer counts them: an operator's device time repeats
    # the time of the kernels it launched, so summing every row counts most kernels twice.
    device_types = {torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.PrivateUse1}
    cuda_total = sum(e.self_device_time_total for e in events if e.device_type in device_types
                     and not e.is_user_annotation) / 1e3 / args.steps
    print(f"{args.backend}-{args.precision} {args.d_model}x{args.n_layers}: host issue {host * 1e3:.2f} ms/step, "
          f"wall {wall * 1e3:.2f} ms/step, GPU kernel time {cuda_total:.2f} ms/step (under the profiler)")
    print(events.table(sort_by="self_cpu_time_total" if args.sort == "cpu" else "self_device_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
