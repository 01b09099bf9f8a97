"""How much does the harness cost? Our step timing vs a bare loop, and a trial vs the tutorial's loop.

All in one process, on one config (default: the tutorial's 768x4, batch 32, seq 256, TE BF16):
  harness   - the trial's timing code (``trials.measure.bench.benchmark``: per-step CUDA event pairs, no host
              sync inside a block) against a bare loop of the *same* step object (one event pair
              around all steps), interleaved round by round: the cost of measuring per step.
  trial     - ``run_trial``'s reported step_ms_mean (fresh model, fused AdamW, no per-step sync)
  tutorial  - the tutorial's loop on the same model: default AdamW, ``loss.item()`` every step,
              host clock around the loop
  plain     - (torch and torchao backends) the same computation written here without trials.workloads.train_step or
              trials.backends: the twin, torchao's convert_to_float8_training called directly (block
              Linears, the head kept in BF16), torch.compile, fused AdamW, one event pair around the
              steps: what a user's own loop would time
Each figure is the median over interleaved rounds: eager timings of small models move 10-20%
between identical runs. Goals: harness/bare <= 1.01; trial/tutorial <= 0.95; trial/plain within 2%.
Usage: python benchmarks/harness_overhead.py [--backend te|torch|torchao] [--precision bf16] [--recipe R]
       [--compile] [--cuda-graphs] [--d-model 768] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trials import TrialSpec, run_trial
from trials.backends import te_compat
from trials.workloads.data import ArithmeticSequences
from trials.measure.bench import benchmark
from trials.workloads.train_step import build_train_step


def _fresh_step(spec: TrialSpec, tutorial: bool = False):
    """A fresh model + optimizer and the step closure (the tutorial's variant: default AdamW, .item())."""
    step = build_train_step(spec, spec.backend, spec.precision, "cuda")
    if tutorial:
        model, te, recipe = step.model, step.te, step.recipe
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        x, y = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed).batch(spec.batch_size)

        forward = step.forward  # the compiled model for compile: true cells

        def tutorial_step():
            with te_compat.autocast(te, recipe):
                logits = forward(x)
            loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()

        return tutorial_step
    data = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed)
    if spec.cuda_graphs:
        step.capture(data.batch(spec.batch_size)[0])
    return step, [data.batch(spec.batch_size) for _ in range(4)]


def bare_loop_ms(step, batches, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(steps):
        step(*batches[i % len(batches)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def tutorial_ms(spec: TrialSpec, steps: int) -> float:
    step = _fresh_step(spec, tutorial=True)
    for _ in range(spec.warmup_steps):
        step()
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.time() - t) / steps * 1000


def _median(values):
    return statistics.median(values)


def plain_ms(spec: TrialSpec, steps: int) -> float:
    """The twin's step as a user writes it, converted and compiled here, timed with one event pair."""
    from trials.models.minigpt_net import MiniGPT, ModelConfig

    torch.manual_seed(spec.seed)
    model = MiniGPT(ModelConfig.from_spec(spec), torch.bfloat16, "cuda")
    if spec.backend == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(spec.recipe),
                                   module_filter_fn=lambda m, fqn: fqn != "head")
    forward = torch.compile(model) if spec.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, fused=True)
    data = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed)
    batches = [data.batch(spec.batch_size) for _ in range(4)]

    def step(x, y):
        loss = F.cross_entropy(forward(x).float().view(-1, spec.vocab), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(spec.warmup_steps):
        step(*batches[i % 4])
    return bare_loop_ms(step, batches, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="te")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--recipe", default="delayed")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    spec = TrialSpec(backend=args.backend, precision=args.precision, recipe=args.recipe, d_model=args.d_model,
                     n_layers=args.n_layers, cuda_graphs=args.cuda_graphs, compile=args.compile, bench_steps=args.steps,
                     warmup_steps=10, device="cuda", gen_len=1)
    print(f"config: {args.backend}-{args.precision} d_model={args.d_model} n_layers={args.n_layers} "
          f"recipe={args.recipe if args.precision == 'fp8' else '-'} compile={args.compile} "
          f"cuda_graphs={args.cuda_graphs} batch={spec.batch_size} seq={spec.seq_len} steps={args.steps} "
          f"rounds={args.rounds} gpu={torch.cuda.get_device_name()}")

    # 1. timing-harness overhead on one step object, interleaved
    step, batches = _fresh_step(spec)
    for i in range(spec.warmup_steps):
        step(*batches[i % len(batches)])
    harness, bare = [], []
    for r in range(args.rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                res = benchmark(step, batches, "cuda", 0, args.steps, 1)
                harness.append(statistics.fmean(res.step_ms))
            else:
                bare.append(bare_loop_ms(step, batches, args.steps))
    del step, batches
    torch.cuda.empty_cache()

    # 2. a whole trial vs the tutorial's loop, interleaved
    trial, tut, plain = [], [], []
    for _ in range(args.rounds):
        rec = run_trial(spec)
        assert rec["status"] == "ok", rec["error"]
        trial.append(rec["step_ms_mean"])
        tut.append(tutorial_ms(spec, args.steps))
        if spec.backend in ("torch", "torchao"):
            plain.append(plain_ms(spec, args.steps))
        torch.cuda.empty_cache()
    h, b, t, u = (_median(v) for v in (harness, bare, trial, tut))
    fmt = lambda v: [round(x, 3) for x in v]  # noqa: E731
    print(f"harness  (per-step event pairs)   median {h:8.3f} ms/step  rounds {fmt(harness)}")
    print(f"bare     (one event pair)         median {b:8.3f} ms/step  rounds {fmt(bare)}")
    print(f"trial    (run_trial step_ms_mean) median {t:8.3f} ms/step  rounds {fmt(trial)}")
    print(f"tutorial (host clock + .item())   median {u:8.3f} ms/step  rounds {fmt(tut)}")
    print(f"ratio harness/bare   = {h / b:.4f}   (goal <= 1.01)")
    print(f"ratio trial/tutorial = {t / u:.4f}   (goal <= 0.95)")
    if plain:
        pl = _median(plain)
        print(f"plain    (own loop, one pair)     median {pl:8.3f} ms/step  rounds {fmt(plain)}")
        print(f"ratio trial/plain    = {t / pl:.4f}   (goal within 0.98-1.02)")


if __name__ == "__main__":
    main()
