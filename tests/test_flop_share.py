"""fp8_flop_share where the counter cannot see the FP8 GEMMs (Transformer Engine's, in its own kernels), on CPU
without TE: the step is counted on the model before TE converts it, and the GEMMs of the modules TE's plan turns
into FP8 ones (trials/backends/te_convert.fp8_gemms) are the FP8 share (trials/measure/metrics.py, Tally.modules).
The GPU side (TE cells record it) is tests/test_gpu_te_convert.py and tests/test_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from trials import TrialSpec, backends
from trials.backends import te_convert
from trials.measure.metrics import Tally, blocks_fp8_share, count_flops, counted_flops_per_step, flops_per_step
from trials.models.common import Logits
from trials.models.minigpt_net import MiniGPT, ModelConfig

transformers = pytest.importorskip("transformers")

# tests/test_te_convert.py's wired shape: dims multiples of 16, GQA (2 heads, 1 K/V head)
WIRED = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn=128, vocab=96, seq_len=16, batch_size=8)
TOKENS = 8 * 16
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def linear_flops(model: nn.Module, names, tokens: int) -> float:
    """2*m*n*k per Linear forward, x3 with the backward's dgrad and wgrad: 6 * in * out * tokens each."""
    return sum(6.0 * m.in_features * m.out_features * tokens for n, m in model.named_modules() if n in set(names))


@pytest.mark.parametrize("te_layer", ["swap", "transformer_layer"])
def test_a_te_fp8_cells_share_is_its_converted_linears_flops_over_the_step(te_layer):
    """hf:llama as TE's conversion takes it (trials/backends/te.source_model, which needs no TE): every decoder-layer
    Linear runs in FP8 (swapped, or one GEMM of the te.TransformerLayer that replaces the layer), the LM head in BF16;
    the share is those Linears' GEMM FLOPs over the counted step (attention's formula term in the total)."""
    from trials.backends.te import source_model

    spec = TrialSpec(model="hf:llama", backend="te", te_layer=te_layer, precision="fp8", recipe="delayed", **WIRED)
    made, steps, flops = source_model(spec, "fp8", "cpu")
    fp8 = te_convert.fp8_gemms(steps)
    assert sorted(fp8) == sorted(f"model.model.layers.{i}.{lin}" for i in range(2) for lin in LAYER_LINEARS)
    assert made.logits_layer not in fp8 and made.model.model.lm_head.__class__ is nn.Linear  # not converted yet
    expected = linear_flops(made.model, fp8, TOKENS) / flops["flops_per_step"]
    assert flops["fp8_flop_share"] == pytest.approx(expected, rel=1e-12) and 0.5 < expected < 1
    # the count leaves the model as it found it: no gradients, every forward its class's own
    assert all(p.grad is None for p in made.model.parameters())
    assert not any("forward" in m.__dict__ for m in made.model.modules())
    for precision in ("bf16", "fp32"):  # nothing in FP8: 0, as on torch
        _, _, high = source_model(spec, precision, "cpu")  # the precision argument is what builds and counts
        assert high["fp8_flop_share"] == 0.0 and high["flops_per_step"] == flops["flops_per_step"]


def test_a_te_cells_share_equals_the_torchao_cells_on_the_same_linears():
    """torchao's tensorwise cell converts the same Linears (all but the logits layer) and its share is counted from
    its float8 operands; TE's, from the names its plan converts. One step, the same GEMMs: the same share."""
    from trials.backends.te import source_model

    spec = TrialSpec(model="hf:llama", backend="torchao", precision="fp8", recipe="tensorwise", **WIRED)
    built = backends.build(spec, "torchao", "fp8", "cpu")
    torchao = count_flops(spec, built.model, 96, "cpu", 1)
    _, steps, te = source_model(spec.replace(backend="te", recipe="delayed"), "fp8", "cpu")
    assert json.loads(built.info["fp8_converted_names"]) == te_convert.fp8_gemms(steps)
    assert te["flops_per_step"] == pytest.approx(torchao["flops_per_step"], rel=1e-12)
    assert te["fp8_flop_share"] == pytest.approx(torchao["fp8_flop_share"], rel=1e-9)


def test_each_gemm_is_charged_to_its_own_linear_backward_too():
    """k_proj and v_proj 2 heads x 20 wide (not multiples of 16) stay BF16 while their sibling q_proj, which reads the
    same input, converts. FlopCounterMode's per-module counts charge a backward GEMM to every module whose backward
    is under way, so there k_proj also carries q_proj's and v_proj's gradient GEMMs; the share follows each GEMM to
    the module whose forward made it (metrics.ModuleScope) and counts q, o, gate, up and down exactly."""
    cfg = transformers.AutoConfig.for_model("llama", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                            head_dim=20, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Logits(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), use_cache=False)
    steps = te_convert.plan(model, "swap")
    fp8 = te_convert.fp8_gemms(steps)
    kept = [s.name for s in steps if not s.converts]
    assert kept == [f"model.model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")] + \
        ["model.lm_head"]
    ids = torch.randint(0, 96, (4, 16))
    tally = Tally(modules=tuple(fp8))
    total = counted_flops_per_step(model, ids, 2, 4 * 20, 1, tally)
    assert tally.fp8 == linear_flops(model, fp8, 4 * 16) > 0
    # the kept Linears' GEMMs are the rest of the count (attention's formula term apart)
    assert total - 6.0 * 2 * 16 * (4 * 20) * 4 * 16 == tally.fp8 + linear_flops(model, kept, 4 * 16)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_te_minigpts_share_is_its_blocks_and_a_count_of_the_twin_agrees(arch):
    """TE's MiniGPT (its own te.TransformerLayer or TE-module blocks; LM head an nn.Linear) takes its FLOPs and its
    share from the formula (metrics.blocks_fp8_share). The torch twin, counted with the Linears that are one GEMM
    each of TE's block named FP8 (blocks.<i>.qkv, proj, fc1, fc2; minigpt_net's _TE_TO_TWIN), gives the same share."""
    spec = TrialSpec(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2 if arch == "llama" else None, seq_len=16,
                     arch=arch, vocab=96)
    cfg = ModelConfig.from_spec(spec)
    twin = MiniGPT(cfg, torch.float32, "cpu")
    fp8 = [f"blocks.{i}.{lin}" for i in range(cfg.n_layers) for lin in ("qkv", "proj", "fc1", "fc2")]
    tally = Tally(modules=tuple(fp8))
    total = counted_flops_per_step(twin, torch.zeros(4, 16, dtype=torch.long), cfg.n_layers, cfg.d_model, 1, tally)
    assert total == pytest.approx(flops_per_step(cfg, 4 * 16), rel=1e-9)
    assert tally.fp8 == linear_flops(twin, fp8, 4 * 16)
    assert blocks_fp8_share(cfg) == pytest.approx(tally.fp8 / total, rel=1e-9)
    assert 0.5 < blocks_fp8_share(cfg) < 1


def test_a_weight_read_without_calling_its_linear_is_not_fp8():
    """nn.MultiheadAttention multiplies by out_proj.weight itself, never calling out_proj: TE's swap plan keeps
    out_proj (a te.Linear there would never run), so its GEMMs stay BF16 in the share, as on torchao
    (tests/test_models.py: fc1 and fc2 of 2 blocks are the factory's FP8 GEMMs)."""
    from trials.backends.te import source_model

    spec = TrialSpec(model="py:examples.my_model:build", backend="te", precision="fp8", recipe="delayed",
                     **{**WIRED, "n_kv_heads": None})
    made, steps, flops = source_model(spec, "fp8", "cpu")
    assert "model.blocks.0.self_attn.out_proj" not in te_convert.fp8_gemms(steps)
    fp8 = 2 * 6 * TOKENS * (2 * 64 * 128)  # linear1 and linear2 of 2 blocks, fwd + dgrad + wgrad
    assert flops["fp8_flop_share"] * flops["flops_per_step"] == pytest.approx(fp8)


def test_a_torchao_minigpt_cells_share_is_what_a_count_of_its_converted_model_finds():
    """MiniGPT's FLOPs are its formula's, so the counter never ran on it and its torchao cells had no share (null).
    The formula's share of the Linears torchao converted (trials/measure/metrics.named_fp8_share) is what
    FlopCounterMode counts in float8 GEMMs on the converted model: here every block Linear, the LM head BF16, the
    share TE's MiniGPT runs (blocks_fp8_share)."""
    from trials import run_trial

    pytest.importorskip("torchao")
    spec = TrialSpec(backend="torchao", precision="fp8", recipe="tensorwise", d_model=64, n_layers=1, n_heads=2,
                     vocab=96, seq_len=16, batch_size=2, train_steps=1, warmup_steps=1, bench_steps=1, repeats=1,
                     gen_len=0, device="cpu", profile=False, fp8_reads=False)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert json.loads(rec["fp8_converted_names"]) == ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2"]
    built = backends.build(spec, "torchao", "fp8", "cpu")
    counted = count_flops(spec, built.model, 96, "cpu", 1)
    assert counted["flops_per_step"] == pytest.approx(rec["flops_per_step"], rel=1e-9)  # formula = count here
    assert rec["fp8_flop_share"] == pytest.approx(counted["fp8_flop_share"], rel=1e-9)
    assert rec["fp8_flop_share"] == pytest.approx(blocks_fp8_share(ModelConfig.from_spec(spec)), rel=1e-9)


def test_a_recipe_that_keeps_the_weight_gradient_high_counts_two_of_three_gemms():
    """torchao's rowwise_with_gw_hp runs each converted Linear's weight-gradient GEMM in BF16: MiniGPT's
    formula share had counted all three GEMMs of every converted Linear FP8 (0.91 where a count finds 0.60)."""
    from trials.measure.metrics import named_fp8_share

    pytest.importorskip("torchao")
    spec = TrialSpec(backend="torchao", precision="fp8", recipe="rowwise_with_gw_hp", d_model=64, n_layers=1,
                     n_heads=2, vocab=96, seq_len=16, batch_size=2, device="cpu")
    built = backends.build(spec, "torchao", "fp8", "cpu")
    names = json.loads(built.info["fp8_converted_names"])
    cfg = ModelConfig.from_spec(spec)
    share = named_fp8_share(cfg, built.model, names)
    assert share == pytest.approx(2 / 3 * blocks_fp8_share(cfg), rel=1e-9)
    assert share == pytest.approx(count_flops(spec, built.model, 96, "cpu", 1)["fp8_flop_share"], rel=1e-9)
