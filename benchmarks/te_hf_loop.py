"""A plain training loop over a transformers model converted to TE: what a TE cell of the harness is held to.

Issue 33's acceptance asks that each TE cell on an ``hf:`` model run within 2% of a plain loop over the same
converted model, on the same GPU, in one call. This is that loop: the model is transformers'
``AutoModelForCausalLM.from_config`` (random seeded init, SDPA, BF16, no KV cache), converted by
``trials/backends/te_convert.py`` (``swap`` or ``transformer_layer``; ``none`` times the HF model itself), and
each step is the harness's step without the harness: forward under ``te.autocast`` with the cell's recipe (none
for BF16), FP32 cross-entropy on the next tokens, backward, fused AdamW (``trials.workloads.train_step.make_optimizer``),
``zero_grad(set_to_none=True)``; graphed (``cuda_graphs`` cells, ``--graphs``): each decoder layer captured by hand
with ``te.make_graphed_callables`` and the recipe (plain_check.graph_layers), the rest eager. After ``--warmup``
untimed steps, each of ``--steps`` steps is timed with its own pair of CUDA events, as the harness times its
steps, and the median is taken.

Two ways to call it (repository root, one process, one GPU, TE imported once):

  --sweep FILE   every ``hf:`` TE cell of a sweep file (``examples/your-model.yaml``: Llama-3-8B, Qwen2.5-7B and
                 Mistral-7B layer shapes), interleaved round by round: the trial (``run_trial``'s step_ms_p50)
                 and this loop at the cell's shape, batch and recipe; one line per cell with both medians and
                 trial/plain (the goal: |trial/plain - 1| <= 0.02). The loop warms up as many steps as the
                 trial runs untimed (plain_check.untimed_steps).
  --cells ...    this loop alone at the shape given by flags, one line per cell (te_layer:precision[:recipe]),
                 with ``--graphs`` each decoder layer graphed.

    PYTHONPATH=. python benchmarks/te_hf_loop.py --sweep examples/your-model.yaml --rounds 3
    PYTHONPATH=. python benchmarks/te_hf_loop.py --model llama --d-model 4096 --n-layers 2 --n-heads 32 \\
        --n-kv-heads 8 --ffn 14336 --vocab 128256 --seq-len 4096 --batch-size 4 \\
        --cells none:bf16 swap:bf16 swap:fp8:delayed swap:fp8:current transformer_layer:bf16 transformer_layer:fp8:delayed
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plain_check import (HF_NAMES, Measured, compare, graph_layers,  # benchmarks/: here
                         hf_model, kernel_classes, keep, untimed_steps)
from trials import TrialSpec
from trials.backends import te_compat
from trials.backends import te_convert
from trials.backends.te import fp8_recipe
from trials.measure.gc_pauses import GcPauses
from trials.workloads.train_step import make_optimizer

@dataclass(frozen=True)
class Shape:
    """The model and batch one loop runs: a transformers model type, its shape fields (None: the type's own)."""

    model: str
    seq_len: int
    batch_size: int
    vocab: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn: int | None = None
    lr: float = 3e-4
    seed: int = 0

    @staticmethod
    def add_args(p: argparse.ArgumentParser, seq_len: int, batch_size: int) -> None:
        """The flags :meth:`from_args` reads: the model type, its shape fields, the batch, lr and seed."""
        p.add_argument("--model", default="llama", help="transformers model_type (llama, qwen2, mistral, ...)")
        for k in HF_NAMES:
            p.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int)
        p.add_argument("--seq-len", type=int, default=seq_len)
        p.add_argument("--batch-size", type=int, default=batch_size)
        p.add_argument("--lr", type=float, default=3e-4)
        p.add_argument("--seed", type=int, default=0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Shape":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def of(cls, spec: TrialSpec) -> "Shape":
        return cls(**{f.name: getattr(spec, f.name) for f in fields(cls) if f.name != "model"},
                   model=spec.model.removeprefix("hf:"))


def build(shape: Shape, te_layer: str, te) -> tuple[torch.nn.Module, list]:
    """The shape's model (plain_check.hf_model) and, unless ``te_layer`` is none, its conversion to TE."""
    model = hf_model(shape.model, {k: getattr(shape, k) for k in HF_NAMES}, shape.seq_len, shape.seed)
    steps = [] if te_layer == "none" else te_convert.convert(model, te, te_layer)
    return model, steps


def plain_loop(shape: Shape, te, te_layer: str, recipe: Any, steps: int, warmup: int, reset: bool = True,
               profiled: bool = False, graphed: bool = False) -> dict:
    """Median ms per step of the plain loop over the converted model (GPU, between CUDA events; and the host's
    time in the Python of a step, which a launch-bound step waits on), and what the conversion did. ``reset``:
    clear TE's process-wide FP8 state afterwards, as run_trial does (one trial's amax history must not reach the
    next's). ``gc``: what Python's collector did during the timed steps.
    ``profiled``: its kernels per class too (``kernel_ms``; a few more steps, after the timed ones). ``graphed``: each
    decoder layer CUDA-graphed with the recipe (plain_check.graph_layers)."""
    model, plan = build(shape, te_layer, te)
    if graphed:
        graph_layers(model, shape.batch_size, shape.seq_len, te, recipe)
    vocab = model.config.vocab_size
    opt = make_optimizer(model, shape.lr, "cuda")
    g = torch.Generator(device="cuda").manual_seed(shape.seed)
    data = torch.randint(0, vocab, (shape.batch_size, shape.seq_len + 1), device="cuda", generator=g)
    x, y = data[:, :-1], data[:, 1:]

    def step() -> torch.Tensor:
        with te_compat.autocast(te, recipe):
            logits = model(x, use_cache=False).logits  # (b, t, vocab)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = step().item()
    for _ in range(warmup - 1):
        step()
    events, host = [], []
    with GcPauses() as collector:
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            loss = step()
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            events.append((start, end))
        torch.cuda.synchronize()
    per_step = [s.elapsed_time(e) for s, e in events]
    out = {"ms_p50": statistics.median(per_step), "ms_min": min(per_step), "ms_max": max(per_step),
           "host_ms_p50": statistics.median(host), "gc": f"gc: {collector}",
           "kernel_ms": kernel_classes(step, statistics.median(per_step)) if profiled else None,
           "loss_first": first, "loss_last": loss.item(), "converted": sum(s.converts for s in plan),
           "kept": [s.name for s in plan if not s.converts]}
    model = opt = x = y = data = None  # clears step()'s cells too: the model goes before the cache is emptied
    if reset:  # as run_trial leaves TE: the next loop or trial reduces no amax of this model
        te_compat.reset_te_state()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def by_flags(args: argparse.Namespace, te) -> list[dict]:
    shape = Shape.from_args(args)
    rows = []
    for cell in args.cells:
        te_layer, precision, *rest = cell.split(":")
        recipe = fp8_recipe(TrialSpec(recipe=rest[0])) if precision == "fp8" else None  # the harness's defaults
        r = plain_loop(shape, te, te_layer, recipe, args.steps, args.warmup, graphed=args.graphs)
        rows.append({"cell": f"{args.model}-{cell}{'-graphs' if args.graphs else ''}", **r})
        print(f"{args.model} {cell}: plain {r['ms_p50']:.2f} ms (min {r['ms_min']:.2f}, max {r['ms_max']:.2f}), "
              f"{shape.batch_size * shape.seq_len / r['ms_p50'] * 1e3:.0f} tok/s, loss {r['loss_first']:.3f} -> "
              f"{r['loss_last']:.3f}, {r['converted']} modules converted, kept {r['kept']}", flush=True)
    return rows


def by_sweep(args: argparse.Namespace, te) -> list[dict]:
    from orchestrator.sweep import load_sweep

    cells = [c for c in load_sweep(args.sweep).cells
             if c.spec.source.name == "hf" and c.spec.backend == "te" and any(o in c.label for o in args.only)]
    print(f"# {len(cells)} TE cells of {args.sweep}, {args.rounds} rounds each", flush=True)
    rows = []
    for cell in cells:
        spec = cell.spec.replace(device="cuda", train_steps=args.warmup, warmup_steps=args.warmup,
                                 bench_steps=args.steps, repeats=1, profile=args.kernels)
        recipe = fp8_recipe(spec) if spec.precision == "fp8" else None

        def plain() -> Measured:
            r = plain_loop(Shape.of(spec), te, spec.te_layer, recipe, args.steps, untimed_steps(spec),
                           profiled=args.kernels, graphed=spec.cuda_graphs)
            return Measured(r["ms_p50"], r["kernel_ms"])

        keep(rows, compare(cell.label, spec, "step_ms_p50", plain, args.rounds), args.json)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", help="time every hf: TE cell of this sweep file against the trial (see above)")
    p.add_argument("--only", nargs="+", default=[""], help="--sweep: cells whose label contains any of these")
    p.add_argument("--rounds", type=int, default=3, help="--sweep: trial and plain loop, alternately, this often")
    Shape.add_args(p, seq_len=1024, batch_size=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cells", nargs="+", default=["none:bf16", "swap:bf16", "swap:fp8:delayed"],
                   help="te_layer:precision[:recipe], te_layer one of none, swap, transformer_layer")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--kernels", action="store_true", help="--sweep: profile both sides' steps: kernel ms per class")
    p.add_argument("--graphs", action="store_true", help="--cells: each decoder layer CUDA-graphed (--sweep: as the "
                   "cell's cuda_graphs says)")
    args = p.parse_args()
    te = te_compat.import_te()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} TE {te_compat.te_version()}", flush=True)
    rows = by_sweep(args, te) if args.sweep else by_flags(args, te)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
