"""What a step's counted FLOPs, its MFU and its energy per token mean, on CPU: the model's work, whatever schedule
(activation checkpointing) or attention kernel (eager, SDPA) runs it; the peak of the precision that ran; the whole
step's energy over the whole step's tokens; each GPU's own datasheet peak."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trials import TrialSpec
from trials.measure import energy
from trials.measure.metrics import PEAK_ENV, count_flops, peak_tflops
from trials.workloads.train_step import build_train_step

transformers = pytest.importorskip("transformers")

# tests/test_models.py's tiny shape: GQA (2 heads, 1 K/V head), dims multiples of 16
SHAPE = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn=128, vocab=96, seq_len=16, batch_size=4)
TOKENS = 4 * 16


def linear_flops(model: nn.Module, tokens: int) -> float:
    """Every nn.Linear's forward, dgrad and wgrad GEMMs: 6 * in * out per token."""
    return sum(6.0 * m.in_features * m.out_features * tokens for m in model.modules() if isinstance(m, nn.Linear))


def attention_term(spec: TrialSpec, attn_width: int) -> float:
    """The formula's causal attention, forward and backward (metrics.counted_flops_per_step's term)."""
    return 6.0 * spec.n_layers * spec.seq_len * attn_width * spec.batch_size * spec.seq_len


def counted(spec: TrialSpec) -> float:
    """The step's FLOPs as training.run counts them: on the model build_train_step hands it (checkpointed as the
    spec asks)."""
    step = build_train_step(spec, spec.backend, spec.precision, "cpu")
    return count_flops(spec, step.model, spec.vocab, "cpu", 1)["flops_per_step"]


@pytest.mark.parametrize("model", ["hf:llama", "py:examples.my_model:build"])
def test_a_checkpointed_step_counts_the_models_flops_not_the_recompute(model):
    """activation_checkpointing re-runs each unit's forward in the backward: the schedule's work, not the model's.
    The count (and model_tflops, mfu from it) is the same whether the units are checkpointed or not; before, full
    checkpointing added the recomputed forward (on an H200 hf:llama 8B at seq 4096: 2.394e14 against 1.976e14)."""
    spec = TrialSpec(model=model, backend="torch", precision="fp32", **SHAPE)
    none = counted(spec)
    assert counted(spec.replace(activation_checkpointing="full")) == none
    assert counted(spec.replace(activation_checkpointing="selective", ac_every=2)) == none


def test_eager_attention_counts_as_sdpa_does_by_the_formula():
    """transformers' eager attention multiplies Q by K and the probabilities by V with torch.matmul; SDPA's kernels are
    left out of the count. Either way attention is the formula's causal term once: the GEMMs counted are the Linears'
    (weight operands), and the eager model's count equals its SDPA twin's (before: 2x the formula's term more), as
    does the SDPA model's on SDPA's math kernel."""
    from trials.models.common import Logits

    spec = TrialSpec(model="hf:llama", precision="fp32", **SHAPE)
    cfg = transformers.AutoConfig.for_model("llama", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                                            max_position_embeddings=64)
    counts = {}
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = Logits(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn), use_cache=False)
        counts[attn] = count_flops(spec, model, 96, "cpu", 1)["flops_per_step"]
    assert counts["eager"] == counts["sdpa"] == linear_flops(model, TOKENS) + attention_term(spec, 64)
    # SDPA's math fallback (the meta device's; CUDA's for inputs its fused kernels refuse) runs aten's bmm inside
    # the call: attention's too, not counted
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = Logits(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), use_cache=False)
    with sdpa_kernel(SDPBackend.MATH):
        assert count_flops(spec, model, 96, "cpu", 1)["flops_per_step"] == counts["sdpa"]


def test_bloom_s_baddbmm_attention_is_the_formula_s_term():
    """hf:bloom has no SDPA path (eager only): its scores are a baddbmm over the ALiBi bias, its output a bmm; neither
    is a weight's GEMM, so the count is its Linears' plus the formula's term, as for an SDPA model."""
    spec = TrialSpec(model="hf:bloom", backend="torch", precision="fp32", **{**SHAPE, "n_kv_heads": None, "ffn": None})
    from trials.models import describe

    assert describe(spec).attn_implementation == "eager"
    step = build_train_step(spec, "torch", "fp32", "cpu")
    flops = count_flops(spec, step.model, 96, "cpu", 1)["flops_per_step"]
    assert flops == linear_flops(step.model, TOKENS) + attention_term(spec, 64)


def test_gemms_of_gathered_expert_weights_are_counted():
    """A GEMM whose operand is a parameter reached through views, indexing or casts alone (transformers'
    batched_mm experts gather each token's expert weights, gate_up_proj[expert_ids]) is a weight's GEMM and is
    counted; one between two activations (scores = q @ k^T) is not."""
    from trials.measure.metrics import counted_flops_per_step

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(96, 8)
            self.w = nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, ids):
            h = self.emb(ids).flatten(0, 1)  # (n, 8)
            picked = self.w[ids.flatten() % 4]  # (n, 8, 8): each row's expert
            h = torch.bmm(h.unsqueeze(1), picked.to(torch.float32)).squeeze(1)  # a weight's GEMM
            q = h.view(ids.shape[0], ids.shape[1], 8)
            return q @ q.transpose(1, 2)  # between activations: attention's kind, not counted

    ids = torch.arange(12).view(2, 6)
    n = 12
    assert counted_flops_per_step(Experts(), ids, 0, 0) == 3 * 2 * n * 8 * 8  # forward, dgrad, wgrad


def test_an_fp8_cell_that_ran_bf16_is_measured_against_the_bf16_peak(monkeypatch):
    """torchao converts none of hf:gpt2's GEMMs (Conv1D, not nn.Linear): the cell asked FP8 ran BF16
    (effective_precision) and its precision peak and MFU are BF16's, not FP8's twice as high."""
    from trials import run_trial

    pytest.importorskip("torchao")
    monkeypatch.setenv(PEAK_ENV, "bf16=100,fp8=200")
    spec = TrialSpec(model="hf:gpt2", backend="torchao", precision="fp8", recipe="tensorwise",
                     **{**SHAPE, "n_kv_heads": None, "ffn": None, "n_layers": 1}, train_steps=1, warmup_steps=1,
                     bench_steps=1, repeats=1, gen_len=0, device="cpu", profile=False, fp8_reads=False)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert rec["fp8_converted_modules"] == 0 and rec["effective_precision"] == "bf16"
    assert rec["peak_tflops_precision"] == rec["peak_tflops_bf16"] == 100.0
    assert rec["mfu_precision_peak"] == rec["mfu_bf16_peak"]


def test_energy_per_step_is_every_ranks_board_and_tokens_per_j_the_global_batch():
    """Each rank reads its own board over the same window of steps: the step's energy is their sum, and
    tokens_per_j the global batch's tokens over it; power and clocks stay the board this rank read."""
    window = energy.Energy(window_s=2.0, calls=10, joules=600.0, power_mw=[310_000], clocks=[1980])
    one = window.fields(4096, [600.0])
    assert one["energy_j_per_step"] == 60.0 and one["tokens_per_j"] == 4096 / 60.0
    two = window.fields(2 * 4096, [600.0, 640.0])
    assert two["energy_j_per_step"] == (600.0 + 640.0) / 10
    assert two["tokens_per_j"] == 2 * 4096 / two["energy_j_per_step"]
    assert two["power_mean_w"] == 600.0 / 2.0 and two["power_max_w"] == 310.0  # this board's
    lost = window.fields(2 * 4096, [600.0, None])  # a rank whose counter could not be read: no sum
    assert lost["energy_j_per_step"] is None and lost["tokens_per_j"] is None
    assert "rank 1" in lost["energy_why"] and lost["power_mean_w"] == 300.0


@pytest.mark.parametrize("name,bf16", [
    ("NVIDIA L40", 181.05), ("NVIDIA L40S", 362.05), ("NVIDIA L4", 121.0), ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA H20", 148.0), ("NVIDIA GB200", 2500.0), ("NVIDIA L20", None),
])
def test_a_gpus_peak_is_its_own_model_s_not_a_prefix_s(name, bf16, monkeypatch):
    """Names are matched by whole words, the longest entry winning: "L40" is not an "L4" (121 TFLOP/s against its
    181), "GH200" not an "H200", "H100 PCIe" not the SXM "H100"; a GPU the table lacks has no peak."""
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_tflops(name, "bf16") == bf16


def test_the_dry_runs_flop_probe_counts_eager_attention_by_the_formula_only():
    """memory_plan.probe's forward count (the dry run's time guess, orchestrator/plan.py) leaves eager attention's
    matmuls out as the trial's count does: hf:bloom's forward is its Linears' 2 * in * out per token, nothing
    more (it had counted QK^T and AV too, on top of the formula's term the plan adds)."""
    from trials import models
    from trials.measure import memory_plan

    spec = TrialSpec(model="hf:bloom", device="cpu", **{**SHAPE, "n_kv_heads": None, "ffn": None})  # bloom has neither
    built = models.build(spec, "fp32", "meta")
    linears = sum(2.0 * m.in_features * m.out_features * TOKENS for m in built.model.modules()
                  if isinstance(m, nn.Linear))
    assert memory_plan.probe(spec).forward_flops == linears
