"""Does the harness time a transformers model's CUDA-graphed decode as a hand-written server would? Within 2%.

For every graphed ``hf:`` serving cell of a sweep file (default ``examples/your-model-infer.yaml``) on the torch,
torchao and TE BF16 stacks, in one process on one GPU, interleaved round by round:
  trial  - ``run_trial``'s decode_ms_per_token_p50 (the harness: trials/workloads/serving/hf.py's StaticGenerator, the
           decode step captured with the token copy, position fill and per-step CUDA events outside the graph)
  plain  - the same model written here without the harness: ``AutoModelForCausalLM.from_config`` (BF16, SDPA;
           benchmarks/hf_loop.py's ``plain_model``), torchao's ``quantize_`` called directly for FP8 cells
           (``lm_head`` and dims not multiples of 16 kept), TE's Linear/RMSNorm swap for TE cells
           (trials/backends/te_convert.py, as benchmarks/te_hf_loop.py), transformers' ``StaticCache``, and ONE
           graph holding the whole decode step (forward, argmax, the token fed back, the position advanced),
           replayed back to back for the generation with two events around all of it: ms per token = total /
           tokens, the median over ``--repeats`` generations
The weights are random in both (decode time does not depend on them). Prints one line per cell with both and
trial/plain; the goal is |trial/plain - 1| <= 0.02.
Usage (repository root): PYTHONPATH=. python benchmarks/hf_decode_loop.py [--sweep examples/your-model-infer.yaml]
       [--rounds 1] [--repeats 5] [--only SUBSTR] [--batch 32]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

from hf_loop import fp8_layer, plain_model  # benchmarks/ is this script's directory
from orchestrator.sweep import load_sweep
from plain_check import compare, graphed_ms_per_step
from trials import TrialSpec
from trials.backends import te_compat

STACKS = ("torch", "torchao", "te")


def serving_model(spec: TrialSpec) -> nn.Module:
    """The cell's model as a hand-written server would load it: BF16, then the stack's conversion."""
    model = plain_model(spec.replace(precision="bf16", weights="bf16"))
    if spec.backend == "torchao":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        granularity = {"tensorwise": PerTensor, "rowwise": PerRow}[spec.recipe]()
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity), filter_fn=fp8_layer)
    elif spec.backend == "te":
        from trials.backends import te_convert

        te_convert.convert(model, te_compat.import_te(), "swap")
    return model.eval()


@torch.no_grad()
def plain_decode_ms(spec: TrialSpec, repeats: int) -> float:
    """Median ms per decode token of the one-graph decode loop (prefill eager, then gen_len - 1 replays)."""
    from transformers import StaticCache

    model = serving_model(spec)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows, prompt_len, steps = spec.batch_size, spec.prompt_len, spec.gen_len - 1
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + spec.gen_len)
    gen = torch.Generator(device="cuda").manual_seed(spec.seed)
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt_len), device="cuda", generator=gen)
    token = torch.zeros(rows, 1, dtype=torch.long, device="cuda")  # (rows, 1): the token fed in
    position = torch.zeros(1, 1, dtype=torch.long, device="cuda")  # (1, 1): its position

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # -> (rows, 1) next tokens
        out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def prefill() -> None:
        cache.reset()
        token.copy_(forward(prompts, torch.arange(prompt_len, device="cuda").unsqueeze(0)))
        position.fill_(prompt_len)

    def step() -> None:
        token.copy_(forward(token, position))
        position.add_(1)

    times = graphed_ms_per_step(step, prefill, steps, repeats + 1)  # the first generation untimed
    model = cache = None  # clears the closures' cells too, before the cache is emptied
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default=str(Path(__file__).resolve().parent.parent / "examples" /
                                           "your-model-infer.yaml"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed generations of the plain loop")
    ap.add_argument("--only", default="", help="cells whose label contains this")
    ap.add_argument("--batch", type=int, help="only cells of this batch size")
    args = ap.parse_args()
    cells = [c for c in load_sweep(args.sweep).cells
             if c.spec.source.name == "hf" and c.spec.workload == "infer" and c.spec.cuda_graphs
             and c.spec.backend in STACKS and not (c.spec.backend == "te" and c.spec.precision == "fp8")
             and args.only in c.label and args.batch in (None, c.spec.batch_size)]
    for cell in cells:
        # training only makes generation mean something; the decode's kernels do not depend on the weights
        spec = cell.spec.replace(device="cuda", train_steps=2, profile=False)
        compare(f"{cell.label} batch {spec.batch_size}", spec, "decode_ms_per_token_p50",
                lambda: plain_decode_ms(spec, args.repeats), args.rounds, unit="ms/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
