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


def test_the_timed_decodes_own_peak_leaves_the_trials_peak_whole():
    """An infer cell's peak_decode_mem_bytes is the timed generations' own peak; its peak_mem_* fields stay the
    whole trial's (the BF16 training before it, the reference), which the allocator's one high-water mark, reset
    for the decode, would otherwise lose: memory.phase keeps the trial's peaks in the record and snapshot folds
    them in."""
    from trials.measure.memory import Peaks, over_both, phase

    training, decode = Peaks(allocated=10 << 30, reserved=12 << 30), Peaks(allocated=2 << 30, reserved=3 << 30)
    assert over_both(training, decode) == training  # the decode's reset lost nothing of the training
    assert over_both(None, decode) == decode  # no phase: the allocator's own peaks
    after = Peaks(allocated=11 << 30, reserved=11 << 30)  # a phase past the first (the teacher-forced read) peaked
    assert over_both(over_both(training, decode), after) == Peaks(allocated=11 << 30, reserved=12 << 30)
    assert Peaks.of({"peak_mem_allocated_bytes": None}) is None  # a record before any phase
    kept = {"peak_mem_allocated_bytes": 10 << 30, "peak_mem_reserved_bytes": 12 << 30}
    assert Peaks.of(kept) == training  # what phase() wrote is what snapshot() reads back
    with phase("cpu", {}) as own:
        torch.ones(8)
    assert own.allocated is None  # CPU: no allocator counters (peak_decode_mem_bytes null)
