"""Do the token ids a step trains on move its time? One model, four kinds of batches, SM clock and power of each.

A GPU at its power cap (an H100 or H200 at 700 W) clocks down as its kernels draw more power, and what a kernel
draws depends on its operands' bits, not only its FLOPs. The harness trains on arithmetic sequences over the first
128 token ids (trials/workloads/data.py); the plain loops of benchmarks/hf_loop.py feed uniform ids over the whole
vocabulary, and read 1.6-3.2% slower than the trial on the full-depth torch and TE BF16 cells (an H100), every
round. This trains one model of a sweep's cell (benchmarks/hf_loop.py's plain model) on each kind in turn, round
after round, and prints per kind the median ms per step (CUDA events), the mean SM clock and board power over an
energy window of the same steps (trials/measure/energy.py), and the step's final loss (the step:
hf_loop.plain_training):
  task          the harness's batches (ArithmeticSequences: ids < 128)
  random-128    uniform ids < 128
  random-vocab  uniform ids over the whole vocabulary (hf_loop.py's plain loop)
  zipf          ids over the whole vocabulary at Zipf's law (p ~ 1/rank), as text's tokens fall

    PYTHONPATH=. python benchmarks/data_power.py --sweep examples/full-depth.yaml --cell hf:llama-d4096-L32-torch-bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from hf_loop import plain_training  # benchmarks/ is this script's directory
from orchestrator.sweep import load_sweep
from trials.measure import energy
from trials.workloads.data import ArithmeticSequences

BATCHES = 4  # distinct batches of each kind, cycled, as the harness's timed steps cycle theirs


def batches(kind: str, vocab: int, batch: int, seq_len: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``BATCHES`` (inputs, next-token targets) of shape (batch, seq_len), on the GPU."""
    if kind == "task":
        data = ArithmeticSequences(vocab, seq_len, "cuda", seed)
        return [data.batch(batch) for _ in range(BATCHES)]
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(BATCHES):
        if kind == "zipf":
            p = 1.0 / torch.arange(1, vocab + 1, device="cuda", dtype=torch.float64)
            seq = torch.multinomial(p / p.sum(), batch * (seq_len + 1), replacement=True, generator=g)
            seq = seq.view(batch, seq_len + 1)
        else:
            seq = torch.randint(0, 128 if kind == "random-128" else vocab, (batch, seq_len + 1), device="cuda",
                                generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--cell", required=True, help="a label of the sweep's cells (a torch or torchao hf: cell)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kinds", nargs="+", default=["task", "random-128", "random-vocab", "zipf"])
    args = ap.parse_args()
    cell = next(c for c in load_sweep(args.sweep).cells if c.label == args.cell)
    spec = cell.spec.replace(device="cuda")
    vocab, step = plain_training(spec)
    data = {k: batches(k, vocab, spec.batch_size, spec.seq_len, spec.seed) for k in args.kinds}

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {cell.label}: {args.rounds} rounds of "
          f"{args.steps} timed steps per kind, then an energy window", flush=True)
    seen: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in args.kinds}
    for r in range(args.rounds):
        for kind in args.kinds:
            b = data[kind]
            for i in range(3):  # warm-up on this kind
                step(*b[i % BATCHES])
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(args.steps)]
            torch.cuda.synchronize()
            for i, (s, e) in enumerate(events):
                s.record()
                loss = step(*b[i % BATCHES])
                e.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in events)
            calls = iter(range(10**9))
            window = energy.measure(lambda: step(*b[next(calls) % BATCHES]), energy.calls_for(ms), "cuda")
            clock = statistics.fmean(window.clocks) if window.clocks else float("nan")
            watts = window.joules / window.window_s if window.joules else float("nan")
            seen[kind].append((ms, clock, watts, loss.item()))
            print(f"round {r} {kind:>12}: {ms:.2f} ms/step, SM {clock:.0f} MHz, {watts:.0f} W, loss {loss.item():.3f}",
                  flush=True)
    for kind, rows in seen.items():
        print(f"{kind:>12}: median {statistics.median(v[0] for v in rows):.2f} ms/step, SM "
              f"{statistics.median(v[1] for v in rows):.0f} MHz, {statistics.median(v[2] for v in rows):.0f} W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
