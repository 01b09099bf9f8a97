"""The pure-PyTorch twin: parameter count, FLOP basis and causality (CPU)."""

import pytest
import torch

from trials.data import ArithmeticSequences
from trials.model import MiniGPT, ModelConfig, matmul_param_count, param_count


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab=96, d_model=768, n_layers=4, n_heads=12, ffn=3072, seq_len=256),
    ModelConfig(vocab=50, d_model=64, n_layers=3, n_heads=2, ffn=100, seq_len=33),
])
def test_twin_parameter_count_matches_formula(cfg):
    model = MiniGPT(cfg, torch.float32, "cpu")
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    matmul = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and (n.startswith("blocks.") or n.startswith("head.")))
    assert matmul == matmul_param_count(cfg)


def test_tutorial_size():
    cfg = ModelConfig(vocab=96, d_model=768, n_layers=4, n_heads=12, ffn=3072, seq_len=256)
    assert param_count(cfg) == 28_697_088


def test_twin_is_causal_and_rows_are_independent():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, ffn=128, seq_len=32)
    model = MiniGPT(cfg, torch.float32, "cpu").eval()
    idx = torch.randint(0, 96, (3, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 5) % 96
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3
    other = idx.clone()
    other[0] = (other[0] + 1) % 96
    with torch.no_grad():
        c = model(other)
    assert torch.allclose(a[1:], c[1:], atol=1e-6)


def test_data_is_seeded_arithmetic():
    data = ArithmeticSequences(vocab=96, seq_len=16, device="cpu", seed=3)
    x, y = data.batch(8)
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    stride = (x[:, 1] - x[:, 0]) % 96
    assert torch.equal((x[:, 2:] - x[:, 1:-1]) % 96, stride.unsqueeze(1).expand(8, 14))
    x2, _ = ArithmeticSequences(vocab=96, seq_len=16, device="cpu", seed=3).batch(8)
    assert torch.equal(x, x2)
