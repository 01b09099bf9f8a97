"""Serving models JuicyTalk did not build (trials/workloads/serving): transformers' own KV cache on CPU at one tiny shape, the
teacher-forced read through the cache, the static cache the graphed decode runs (here uncaptured), and a py:
module that cannot be served."""

from __future__ import annotations

import json

import pytest
import torch

from trials import TrialSpec, run_trial
from trials.workloads import serving, teacher_forced
from trials import backends, models
from trials.workloads.decode import Generator
from trials.models.minigpt_net import MiniGPT, ModelConfig
from trials.workloads.serving.hf import StaticGenerator

pytest.importorskip("transformers")

SHAPE = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn=128, vocab=96)  # GQA: 2 heads, 1 K/V head
INFER = dict(workload="infer", seq_len=32, train_steps=12, lr=1e-2, bench_steps=2, prompt_len=8, gen_len=6,
             batch_size=3, profile=False, device="cpu")


def tiny(model: str, **kw) -> TrialSpec:
    return TrialSpec(model=model, **{**SHAPE, **INFER, **kw})


@pytest.mark.parametrize("model,precision", [("hf:llama", "fp32"), ("hf:qwen2", "bf16")])
def test_a_transformers_model_trains_then_serves_through_its_own_kv_cache(model, precision):
    spec = tiny(model, backend="torch", precision=precision)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert (rec["model"], rec["workload"], rec["effective_precision"]) == (model, "infer", precision)
    assert rec["model_class"].endswith("ForCausalLM") and rec["loss_final"] < rec["loss_first"]
    assert len(rec["prefill_times_ms"]) == 2 and len(rec["decode_times_ms"]) == 2 * 5
    assert 0 < rec["decode_ms_per_token_p50"] <= rec["decode_ms_per_token_p90"] and rec["prefill_tokens_per_s"] > 0
    size = 4 if precision == "fp32" else 2
    assert rec["weight_bytes"] == size * rec["n_params"]
    # K and V x layers x rows x K/V heads x positions after the generation (8 + 6 - 1) x head dim 32
    assert rec["kv_cache_bytes"] == 2 * 2 * 3 * 1 * 13 * 32 * size
    assert rec["decode_rows"] == 3 and len(rec["gen_tokens"]) == 8 + 6 and all(0 <= t < 96 for t in rec["gen_tokens"])
    assert 0 <= rec["gen_stride_accuracy"] <= 1 and rec["ref_stride_accuracy"] == rec["gen_stride_accuracy"]
    assert rec["gen_match_rate"] is None and rec["tf_top1_agreement"] is None  # bf16/fp32: nothing to compare


def _sharp(model: torch.nn.Module) -> torch.nn.Module:
    """Larger weights than the init: logits far apart, no argmax near-ties between cached and recomputed runs."""
    for p in model.parameters():
        if p.dim() > 1:
            p.data.mul_(4.0)
    return model.eval()


@torch.no_grad()
def _greedy_by_recompute(model: torch.nn.Module, prompts: torch.Tensor, gen_len: int) -> torch.Tensor:
    seq = prompts
    for _ in range(gen_len):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)  # the whole prefix, every step
    return seq[:, prompts.shape[1]:]


@pytest.mark.parametrize("model", ["hf:llama", "hf:mistral"])
def test_cached_generation_equals_recomputing_the_prefix_and_forced_reads_its_own_tokens(model):
    spec = tiny(model, backend="torch", precision="fp32")
    built = models.build(spec, "fp32", "cpu")
    net = _sharp(built.model)
    prompts = torch.randint(0, 96, (3, 8), generator=torch.Generator().manual_seed(0))
    gen = serving.of(spec).generator(net, 3, 8 + 10)
    first = gen.generate(prompts, 10)
    assert torch.equal(first.tokens, _greedy_by_recompute(net, prompts, 10))
    assert len(first.decode_ms) == 9 and first.prefill_ms > 0
    assert torch.equal(gen.generate(prompts.flip(0), 10).tokens, first.tokens.flip(0))  # a fresh cache each time
    # teacher-forced on its own greedy tokens: its argmax at the last prompt position and every decode step are them
    lp = gen.forced(prompts, first.tokens[:, :-1], keep=2)
    assert lp.shape == (2, 8 + 9, 96) and lp.dtype == torch.float32 and lp.device.type == "cpu"
    assert torch.equal(lp[:, 7:].argmax(-1), first.tokens[:2])
    assert torch.allclose(lp.exp().sum(-1), torch.ones(2, 17), atol=1e-4)


@pytest.mark.parametrize("model", ["hf:llama", "mistral-window5"])
def test_the_static_cache_of_graphed_decode_generates_and_reads_as_the_dynamic_cache_does(model, tmp_path):
    """StaticGenerator uncaptured (what cuda_graphs replays): the same greedy tokens and teacher-forced log-probs
    as the DynamicCache path; mistral's window (5) is shorter than the 18 positions, so its sliding mask works."""
    if model.startswith("mistral"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 5}))
        model = f"hf:{tmp_path}"
    spec = tiny(model, backend="torch", precision="fp32")
    net = _sharp(models.build(spec, "fp32", "cpu").model)
    prompts = torch.randint(0, 96, (3, 8), generator=torch.Generator().manual_seed(0))
    dynamic = serving.of(spec).generator(net, 3, 8 + 10)
    static = StaticGenerator(net, 3, 8 + 10, capture=False)
    ref = dynamic.generate(prompts, 10)
    assert torch.equal(static.generate(prompts.flip(0), 10).tokens, ref.tokens.flip(0))  # other rows first
    out = static.generate(prompts, 10)  # the reset forgets them
    assert torch.equal(out.tokens, ref.tokens) and len(out.decode_ms) == 9
    lp = static.forced(prompts, ref.tokens[:, :-1], keep=2)
    assert torch.allclose(lp, dynamic.forced(prompts, ref.tokens[:, :-1], keep=2), atol=1e-4)
    # preallocated: K and V x layers x rows x K/V heads x 18 positions x head dim 32 x fp32
    assert static.cache_bytes == 2 * 2 * 3 * 1 * 18 * 32 * 4


def test_cuda_graphs_is_built_for_a_transformers_models_inference_and_its_training():
    for model in ("hf:llama", "py:tests.fixtures.factories:transformers_llama"):
        for workload in ("infer", "train"):  # training: one graph per decoder layer (trials/workloads/unit_graphs.py)
            assert TrialSpec(model=model, workload=workload, cuda_graphs=True, device="cuda").cuda_graphs


def test_minigpts_generator_reads_teacher_forced_log_probs_through_its_cache_too():
    cfg = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, ffn=128, seq_len=48, arch="llama", n_kv_heads=2)
    torch.manual_seed(0)
    model = _sharp(MiniGPT(cfg, torch.float32, "cpu"))
    prompts = torch.randint(0, 96, (3, 10))
    gen = Generator(model, rows=3, max_len=10 + 12)
    out = gen.generate(prompts, 12)
    lp = gen.forced(prompts, out.tokens[:, :-1], keep=3)
    assert lp.shape == (3, 10 + 11, 96) and torch.equal(lp[:, 9:].argmax(-1), out.tokens)
    with torch.no_grad():  # the prefill positions equal the full forward's
        assert torch.allclose(lp[:, :10], model(prompts).float().log_softmax(-1), atol=1e-4)


def test_teacher_forced_through_the_cache_fp8_against_bf16_disagrees_somewhere_and_bf16_against_itself_not():
    """The inference cells' numerics: the BF16 model against itself reads agreement 1 and KL 0; the same seeded
    init with torchao's FP8 Linears (on CPU: torchao's training conversion, which runs here; serving's quantize_
    needs a GPU) reads a KL above 0, on prefill positions and on decode steps fed BF16's tokens."""
    spec = tiny("hf:llama", workload="train", backend="torchao", precision="fp8", recipe="tensorwise")
    bf16 = backends.build(spec, "torch", "bf16", "cpu").model.eval()
    fp8 = backends.build(spec, "torchao", "fp8", "cpu").model.eval()
    server = serving.of(spec)
    prompts = torch.randint(0, 96, (3, 8), generator=torch.Generator().manual_seed(1))
    ref_gen = server.generator(bf16, 3, 16)
    ref = ref_gen.generate(prompts, 8)
    forced = ref.tokens[:, :-1]
    ref_lp = ref_gen.forced(prompts, forced, keep=3)
    same = teacher_forced.compare(ref_gen.forced(prompts, forced, keep=3), ref_lp)
    assert (same["tf_top1_agreement"], same["tf_kl_mean"]) == (1.0, 0.0)
    diff = teacher_forced.compare(server.generator(fp8, 3, 16).forced(prompts, forced, keep=3), ref_lp)
    assert 0 < diff["tf_top1_agreement"] <= 1 and diff["tf_kl_mean"] > 0


def test_a_py_module_that_is_not_a_transformers_model_is_unsupported_with_what_serving_needs():
    rec = run_trial(tiny("py:examples.my_model:build", n_kv_heads=None, backend="torch", precision="fp32"))
    assert rec["status"] == "unsupported"
    assert "needs a transformers causal LM" in rec["error"] and "TinyLM" in rec["error"]
    assert rec["train_s"] is None  # refused before it trains


def test_a_py_factory_returning_a_transformers_model_is_served_like_hf():
    spec = tiny("py:tests.fixtures.factories:transformers_llama", backend="torch", precision="fp32")
    built = models.build(spec, "fp32", "cpu")
    assert serving.of(spec).refusal(built.model) == ""
    gen = serving.of(spec).generator(built.model.eval(), 2, 12)
    assert gen.generate(torch.zeros(2, 4, dtype=torch.long), 3).tokens.shape == (2, 3)
