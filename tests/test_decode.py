"""KV-cached generation (trials.workloads.decode) against recomputing the whole prefix, on the CPU twin."""

import pytest
import torch

from trials.workloads.decode import Generator
from trials.models.minigpt_net import MiniGPT, ModelConfig

CONFIGS = [ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, ffn=128, seq_len=48),
           ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=8, ffn=96, seq_len=48, arch="llama", n_kv_heads=2)]


@torch.no_grad()
def _greedy_by_recompute(model: MiniGPT, prompts: torch.Tensor, gen_len: int) -> torch.Tensor:
    seq = prompts
    for _ in range(gen_len):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)  # the whole prefix, every step
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompts.shape[1]:]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["gpt", "llama"])
def test_kv_cached_generation_equals_recomputing_the_prefix(cfg):
    torch.manual_seed(0)
    model = MiniGPT(cfg, torch.float32, "cpu").eval()
    for p in model.parameters():  # larger weights than the init: logits far apart, no argmax near-ties
        p.data.mul_(8.0)
    prompts = torch.randint(0, cfg.vocab, (3, 10))
    generator = Generator(model, rows=3, max_len=10 + 20)
    first = generator.generate(prompts, 20)
    assert torch.equal(first.tokens, _greedy_by_recompute(model, prompts, 20))
    assert len(first.decode_ms) == 19 and first.prefill_ms > 0
    again = generator.generate(prompts.flip(0), 20)  # the cache is reused: nothing of the first run leaks in
    assert torch.equal(again.tokens, first.tokens.flip(0))
