"""A plain training loop over a transformers model converted to TE: what a TE cell of the harness is held to.

Issue 33's acceptance asks that each TE cell on an ``hf:`` model run within 2% of a plain loop over the same
converted model, on the same GPU, in one call. This is that loop: the model is transformers'
``AutoModelForCausalLM.from_config`` (random seeded init, SDPA, BF16), converted by
``trials/backends/te_convert.py`` (``swap`` or ``transformer_layer``; ``none`` times the HF model itself), and
each step is the harness's step without the harness: forward under ``te.autocast`` with the cell's recipe (none
for BF16), FP32 cross-entropy on the next tokens, backward, fused AdamW (``trials.train.WEIGHT_DECAY``),
``zero_grad(set_to_none=True)``. After ``--warmup`` untimed steps, each of ``--steps`` steps is timed with its
own pair of CUDA events, as the harness times its steps; it prints each cell's median ms per step and the spread.

Usage (repository root; several cells in one process, TE imported once):
    PYTHONPATH=. python benchmarks/te_hf_loop.py --model llama --d-model 4096 --n-layers 2 --n-heads 32 --n-kv-heads 8 \\
        --ffn 14336 --vocab 128256 --seq-len 4096 --batch-size 4 \\
        --cells none:bf16 swap:bf16 swap:fp8:delayed swap:fp8:current transformer_layer:bf16 transformer_layer:fp8:delayed
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch
import torch.nn.functional as F

from trials import TrialSpec, te_compat
from trials.backends import te_convert
from trials.train import make_optimizer

SHAPE_TO_HF = {"vocab": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn": "intermediate_size"}


def build(args: argparse.Namespace, te_layer: str, te) -> tuple[torch.nn.Module, list]:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {hf: getattr(args, k) for k, hf in SHAPE_TO_HF.items() if getattr(args, k) is not None}
    cfg = AutoConfig.for_model(args.model, **shape)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.seq_len)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().train()
    steps = [] if te_layer == "none" else te_convert.convert(model, te, te_layer)
    return model, steps


def time_cell(args: argparse.Namespace, te, cell: str) -> dict:
    te_layer, precision, *rest = cell.split(":")
    d = TrialSpec()  # the harness's FP8 defaults (format, amax history)
    recipe = (te_compat.make_recipe(rest[0], d.fp8_format, d.amax_history_len, d.amax_compute_algo)
              if precision == "fp8" else None)
    model, steps = build(args, te_layer, te)
    vocab = model.config.vocab_size
    opt = make_optimizer(model, args.lr, "cuda")
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    data = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device="cuda", generator=g)
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
    for _ in range(args.warmup - 1):
        step()
    events = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    per_step = [s.elapsed_time(e) for s, e in events]
    out = {"cell": cell, "model": args.model, "ms_p50": round(statistics.median(per_step), 3),
           "ms_min": round(min(per_step), 3), "ms_max": round(max(per_step), 3), "loss_first": round(first, 4),
           "loss_last": round(loss.item(), 4), "converted": sum(s.converts for s in steps),
           "kept": [s.name for s in steps if not s.converts],
           "tokens_per_s": round(args.batch_size * args.seq_len / statistics.median(per_step) * 1e3)}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama", help="transformers model_type (llama, qwen2, mistral, ...)")
    for k in SHAPE_TO_HF:
        p.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cells", nargs="+", default=["none:bf16", "swap:bf16", "swap:fp8:delayed"],
                   help="te_layer:precision[:recipe], te_layer one of none, swap, transformer_layer")
    args = p.parse_args()
    te = te_compat.import_te()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} TE {te_compat.te_version()}")
    for cell in args.cells:
        print(json.dumps(time_cell(args, te, cell)), flush=True)


if __name__ == "__main__":
    main()
