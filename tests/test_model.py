"""The pure-PyTorch twin: parameter count, FLOP basis and causality (CPU)."""

import pytest
import torch

from trials.workloads.data import ArithmeticSequences
from trials.models.minigpt_net import MiniGPT, ModelConfig, apply_rope, matmul_param_count, param_count, rope_freqs

LLAMA = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=8, ffn=96, seq_len=32, arch="llama", n_kv_heads=2)


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab=96, d_model=768, n_layers=4, n_heads=12, ffn=3072, seq_len=256),
    ModelConfig(vocab=50, d_model=64, n_layers=3, n_heads=2, ffn=100, seq_len=33),
    LLAMA,
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


def test_llama_8b_layer_sizes():
    """Llama-3-8B's published count: 8.03B parameters (32 layers, GQA 32/8, SwiGLU 14336, vocab 128256, untied)."""
    cfg = ModelConfig(vocab=128256, d_model=4096, n_layers=32, n_heads=32, ffn=14336, seq_len=8192, arch="llama",
                      n_kv_heads=8)
    assert param_count(cfg) == 8_030_261_248


def test_rope_scores_depend_on_relative_position_only():
    """q.k after RoPE depends on the offset between positions, not where they sit; norms are kept."""
    torch.manual_seed(0)
    freqs = rope_freqs(64, 16, "cpu")
    q, k = torch.randn(1, 1, 1, 16).double(), torch.randn(1, 1, 1, 16).double()
    def at(x, pos):  # x placed at position pos of a (1, 64, 1, 16) sequence, rotated there
        seq = torch.zeros(1, 64, 1, 16, dtype=torch.float64)
        seq[:, pos] = x[:, 0]
        return apply_rope(seq, freqs.double())[:, pos]
    s1 = (at(q, 10) * at(k, 3)).sum()
    s2 = (at(q, 50) * at(k, 43)).sum()
    assert torch.allclose(s1, s2) and not torch.allclose(s1, (at(q, 10) * at(k, 9)).sum())
    assert torch.allclose(at(q, 37).norm(), q.norm())


@pytest.mark.parametrize("cfg", [ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, ffn=128, seq_len=32), LLAMA])
def test_twin_is_causal_and_rows_are_independent(cfg):
    torch.manual_seed(0)
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


@pytest.mark.parametrize("cfg", [ModelConfig(vocab=96, d_model=128, n_layers=4, n_heads=2, ffn=512, seq_len=32), LLAMA])
def test_init_is_gpt2_style_for_every_parameter(cfg):
    """N(0, 0.02) weights and embeddings, residual projections scaled by 1/sqrt(2 L), zero biases, unit norm
    gains: the distribution TE's layers start from too. (A check that matched every tensor once skipped
    this init and left torch's defaults: N(0, 1) embeddings and uniform biases.)"""
    torch.manual_seed(0)
    model = MiniGPT(cfg, torch.float32, "cpu")
    for name, p in model.named_parameters():
        p = p.detach()
        if p.dim() >= 2:
            want = 0.02 / (2 * cfg.n_layers) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
            assert float(p.std()) == pytest.approx(want, rel=0.15), name
            assert abs(float(p.mean())) < 0.2 * want, name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        else:
            assert torch.all(p == 1.0), name
