"""The twin's graphed decode against a bare plain-PyTorch graphed decode loop of the same model.

The bare loop is what a hand-written server would do: one CUDA graph holding the whole decode step
(embedding, every block over the KV cache, LM head, argmax, the token fed back and the position
advanced), replayed back to back with two events around all of it. JuicyTalk's ``Generator`` does the
same step with the token copy, position fill and the per-step events outside the graph. If the two
differ by more than a few percent, the harness puts work in the timed window a server would not do.
Usage: python benchmarks/decode_loop.py [--d-model 4096] [--n-layers 4] [--batch 32] [--prompt 128] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from plain_check import graphed_ms_per_step  # benchmarks/ is this script's directory
from trials import TrialSpec
from trials.workloads.decode import Generator, TwinCache
from trials.models.minigpt_net import MiniGPT, ModelConfig


def bare_ms_per_token(model: MiniGPT, rows: int, max_len: int, start: int, steps: int, repeats: int) -> list[float]:
    cache = TwinCache(model, rows, Generator(model, rows, max_len).max_len)
    token = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
    position = torch.full((1,), start, dtype=torch.long, device="cuda")

    @torch.no_grad()
    def step() -> None:
        cache.start(position)
        hidden = model.features(token, position, cache)  # (rows, 1, d_model)
        token.copy_(model.head(hidden[:, -1]).argmax(-1, keepdim=True))
        position.add_(1)

    return graphed_ms_per_step(step, lambda: position.fill_(start), steps, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = TrialSpec(d_model=args.d_model, n_layers=args.n_layers, backend="torch", device="cuda")
    model = MiniGPT(ModelConfig.from_spec(spec), torch.bfloat16, "cuda").eval()
    max_len = args.prompt + args.new
    prompts = torch.randint(0, spec.vocab, (args.batch, args.prompt), device="cuda")
    generator = Generator(model, args.batch, max_len, graphs=True)
    generator.generate(prompts, args.new)
    harness = [statistics.median(generator.generate(prompts, args.new).decode_ms) for _ in range(args.repeats)]
    bare = bare_ms_per_token(model, args.batch, max_len, args.prompt, args.new - 1, args.repeats)
    h, b = statistics.median(harness), statistics.median(bare)
    print(f"d{args.d_model}x{args.n_layers} batch {args.batch}: harness decode p50 {h:.4f} ms/token "
          f"(repeats {', '.join(f'{v:.4f}' for v in harness)}); bare graphed loop {b:.4f} ms/token "
          f"(repeats {', '.join(f'{v:.4f}' for v in bare)}); harness / bare = {h / b:.4f}")


if __name__ == "__main__":
    main()
