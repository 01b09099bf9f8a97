"""Does the harness time a transformers model as the user's own loop would? Trial vs a plain loop, within 2%.

For every ``hf:`` cell of a sweep file (default ``examples/your-model.yaml``) or one cell given by flags, in
one process on one GPU, interleaved round by round:
  trial  - ``run_trial``'s step_ms_p50 (the harness: trials/models/hf.py builds it, the stack converts it,
           per-step CUDA events)
  plain  - the same model written here without trials: ``AutoConfig.for_model`` with the same shape,
           ``AutoModelForCausalLM.from_config`` (BF16, SDPA, no KV cache, no dropout), torchao's
           ``convert_to_float8_training`` called directly for fp8 cells (``lm_head`` and dims not multiples of
           16 kept), ``torch.compile`` of each decoder layer for compile cells, transformers' own
           ``gradient_checkpointing_enable`` for ``activation_checkpointing: full`` cells, each decoder layer
           CUDA-graphed by hand for ``cuda_graphs`` cells (plain_check.graph_layers: ``make_graphed_callables``
           over the layers, compiled ones included; ``--graphs reduce-overhead``: compiled layers graphed by
           Inductor's own cudagraph trees instead, ``torch.compile(mode="reduce-overhead")``, the other way the
           trial could have taken), fused AdamW, fp32 cross-entropy on the logits, random token batches; after as
           many untimed steps as the trial runs before its timed ones (plain_check.untimed_steps), each step timed
           with its own CUDA event pair, the median taken
Prints one line per cell with both medians and trial/plain; the goal is |trial/plain - 1| <= 0.02.
Usage (repository root): PYTHONPATH=. python benchmarks/hf_loop.py [--sweep examples/your-model.yaml]
       [--rounds 3] [--steps 20] [--only SUBSTR ...] [--graphs make_graphed_callables|reduce-overhead]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from orchestrator.sweep import load_sweep
from plain_check import (HF_NAMES, Measured, compare, graph_layers, hf_model, kernel_classes,  # benchmarks/: here
                         keep, untimed_steps)
from trials import TrialSpec


def fp8_layer(mod: nn.Module, fqn: str) -> bool:
    """The Linears a plain FP8 loop converts (torchao's ``module_filter_fn`` / ``filter_fn``): not the head that makes
    the logits, and only dims that are multiples of 16 (FP8 GEMMs need them), as the stacks keep them."""
    return isinstance(mod, nn.Linear) and fqn != "lm_head" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def plain_model(spec: TrialSpec) -> nn.Module:
    """The cell's model (plain_check.hf_model), checkpointed and converted to float8 as the cell asks."""
    model = hf_model(spec.model.removeprefix("hf:"), {k: getattr(spec, k) for k in HF_NAMES}, spec.seq_len,
                     spec.seed)
    if spec.activation_checkpointing == "full":  # every decoder layer recomputed, as a user asks transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(spec.recipe),
                                   module_filter_fn=fp8_layer)
    return model


def plain_training(spec: TrialSpec, reduce_overhead: bool = False
                   ) -> tuple[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(vocab, ``step(x, y) -> loss``): :func:`plain_model`, each decoder layer compiled for compile cells (as
    torchtitan compiles, and the trial: train_step.py) and graphed for cuda_graphs cells (``reduce_overhead``: a
    compiled layer by Inductor's cudagraph trees), and one training step over it: fp32 cross-entropy on the
    logits, backward, fused AdamW. The step holds the model and its optimizer."""
    model = plain_model(spec)
    vocab = model.config.vocab_size
    trees = spec.cuda_graphs and spec.compile and reduce_overhead
    if spec.compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, mode="reduce-overhead" if trees else None)
    if spec.cuda_graphs and not trees:
        graph_layers(model, spec.batch_size, spec.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if trees:  # a new step: the trees may reuse the last one's output buffers
            torch.compiler.cudagraph_mark_step_begin()
        logits = model(input_ids=x, use_cache=False).logits  # (b, t, vocab)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return vocab, step


def plain_loop(spec: TrialSpec, steps: int, warmup: int, profiled: bool = False,
               reduce_overhead: bool = False) -> Measured:
    """Median step of the plain loop, ms; ``profiled``: then its kernels per class (a few more steps)."""
    vocab, train = plain_training(spec, reduce_overhead)
    gen = torch.Generator(device="cuda").manual_seed(spec.seed)
    # uniform ids over the whole vocabulary (the harness's are arithmetic sequences over the first 128: on the
    # full-depth torch BF16 cell both, and Zipfian ids, timed within 1% of each other)
    batches = [torch.randint(0, vocab, (spec.batch_size, spec.seq_len + 1), device="cuda", generator=gen)
               for _ in range(4)]
    turn = iter(range(10**9))

    def step() -> None:
        seq = batches[next(turn) % len(batches)]
        train(seq[:, :-1], seq[:, 1:])

    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    out = Measured(ms, kernel_classes(step, ms) if profiled else None)
    train = step = None  # drops the model and its optimizer (held by the step) before the cache is emptied
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default=str(Path(__file__).resolve().parent.parent / "examples" / "your-model.yaml"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="the trial's training and warm-up steps")
    ap.add_argument("--only", nargs="+", default=[""], help="cells whose label contains any of these")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--kernels", action="store_true", help="profile both sides' steps: kernel ms per class, and gap")
    ap.add_argument("--graphs", choices=["make_graphed_callables", "reduce-overhead"], default="make_graphed_callables",
                    help="cuda_graphs cells: how the plain loop graphs its (compiled) layers")
    args = ap.parse_args()
    cells = [c for c in load_sweep(args.sweep).cells  # TE cells: benchmarks/te_hf_loop.py
             if c.spec.source.name == "hf" and c.spec.backend in ("torch", "torchao")
             and any(o in c.label for o in args.only)
             and c.spec.activation_checkpointing in ("none", "full")]  # selective: no plain-loop twin here
    rows = []
    for cell in cells:
        spec = cell.spec.replace(device="cuda", train_steps=args.warmup, warmup_steps=args.warmup,
                                 bench_steps=args.steps, repeats=1, profile=args.kernels)
        keep(rows, compare(cell.label, spec, "step_ms_p50",
                           lambda: plain_loop(spec, args.steps, untimed_steps(spec), args.kernels,
                                              args.graphs == "reduce-overhead"), args.rounds),
             args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
