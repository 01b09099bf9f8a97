"""GPU tests (-m gpu) of TE on transformers models (trials/backends/te_convert.py): the swapped and the
transformer_layer models compute the HF model's logits within BF16 tolerance, and train in FP8.

Tolerance, said once: the relative error ||a - b|| / ||b|| of the logits. BF16 keeps 8 significant bits (unit
roundoff 2^-9 = 2e-3); TE and transformers round at different places (HF's RMSNorm rounds twice, its RoPE and
SwiGLU run in BF16, TE's fused kernels compute those in FP32 and round once), which over two layers of random
weights leaves differences of a few 1e-3. So: TE vs HF, both BF16, within REL_TOL = 2e-2; and TE's BF16 model
no further from the FP32 HF model (same weights) than HF's own BF16 model is, within a factor 2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from trials.backends import te_convert as tc
from trials.backends.te_compat import make_recipe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

REL_TOL = 2e-2
SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=256)
SEQ, BATCH = 128, 4


def hf(model_type: str, **overrides) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.cuda()


def tokens(seed: int = 0, length: int = SEQ) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (BATCH, length), device="cuda", generator=g)


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, use_cache=False).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


CASES = [("llama", "swap", {}), ("qwen2", "swap", {}), ("mistral", "swap", {}),
         ("llama", "transformer_layer", {}), ("qwen2", "transformer_layer", {}),
         ("mistral", "transformer_layer", {}),
         # a window shorter than the sequence: TE gets window_size where HF masks the window
         ("mistral", "transformer_layer", {"sliding_window": 48})]


@pytest.mark.parametrize("model_type,te_layer,extra", CASES,
                         ids=[f"{m}-{t}{'-window' if e else ''}" for m, t, e in CASES])
def test_converted_logits_equal_hf_within_bf16_tolerance(te, model_type, te_layer, extra):
    ref = hf(model_type, **extra).eval()
    exact = copy.deepcopy(ref).float()  # the same weights in FP32 (BF16 values are exact in FP32)
    model = copy.deepcopy(ref)
    steps = tc.convert(model, te, te_layer)
    assert sum(s.converts for s in steps) == (2 if te_layer == "transformer_layer" else 2 * 9 + 1)
    if te_layer == "swap":
        assert isinstance(model.model.layers[0].self_attn.q_proj, te.Linear)
        assert isinstance(model.model.norm, te.RMSNorm) and type(model.lm_head) is torch.nn.Linear
    else:
        assert isinstance(model.model.layers[1], tc.TEDecoderLayer)
    idx = tokens()
    out, base, truth = logits(model, idx), logits(ref, idx), logits(exact, idx)
    err, te_err, hf_err = rel(out, base), rel(out, truth), rel(base, truth)
    print(f"{model_type} {te_layer} {extra}: TE vs HF (bf16) {err:.2e}; vs FP32 HF: TE {te_err:.2e}, HF bf16 {hf_err:.2e}")
    assert err < REL_TOL
    assert te_err <= 2 * hf_err + 1e-4


@pytest.mark.parametrize("model_type,te_layer", [("llama", "swap"), ("llama", "transformer_layer"),
                                                 ("qwen2", "transformer_layer")])
def test_fp8_delayed_trains_the_converted_model(te, model_type, te_layer):
    """FP8 (delayed scaling) steps on a fixed batch: the loss falls; qwen2's zero biases that HF lacks stay zero."""
    model = hf(model_type).train()
    tc.convert(model, te, te_layer)
    recipe = make_recipe("delayed", "hybrid", 16, "max")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    idx = tokens(1, SEQ + 1)  # inputs of SEQ tokens: FP8 GEMMs need the token count in multiples of 16
    losses = []
    for _ in range(30):
        with te.autocast(enabled=True, recipe=recipe):
            out = model(idx[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"{model_type} {te_layer} fp8 delayed: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0]
    frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
    assert (len(frozen) == 3 * 2) == (model_type == "qwen2") and all(not p.any() for p in frozen)


TRIAL = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, vocab=512, seq_len=128, batch_size=8,
             train_steps=30, lr=1e-2, warmup_steps=2, bench_steps=5, profile=False, device="cuda")


@pytest.mark.parametrize("model,te_layer,precision,recipe", [
    ("hf:llama", "swap", "bf16", "delayed"), ("hf:llama", "swap", "fp8", "delayed"),
    ("hf:qwen2", "transformer_layer", "fp8", "delayed"), ("hf:mistral", "swap", "fp8", "current"),
])
def test_a_te_cell_on_a_transformers_model_runs_through_the_harness(te, model, te_layer, precision, recipe):
    """The wired path (trials/backends/te.py): run_trial of a TE cell on an hf: model trains, records what TE runs
    and kept, and counts the same FLOPs as the torch cell of the same model (counted before the conversion)."""
    import json

    from trials import TrialSpec, run_trial

    spec = TrialSpec(model=model, backend="te", te_layer=te_layer, precision=precision, recipe=recipe, **TRIAL)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert (rec["effective_backend"], rec["effective_precision"], rec["te_layer"]) == ("te", precision, te_layer)
    curve = rec["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.1, curve
    converted = json.loads(rec["fp8_converted_names"])
    assert rec["fp8_converted_modules"] == len(converted) == (2 if te_layer == "transformer_layer" else 2 * 9 + 1)
    assert json.loads(rec["fp8_skipped_modules"]) == ["model.lm_head"]  # both: the logits layer stays BF16
    assert rec["flops_method"] == "counted"
    torch_rec = run_trial(spec.replace(backend="torch", precision="bf16", train_steps=2))
    assert rec["flops_per_step"] == pytest.approx(torch_rec["flops_per_step"], rel=1e-9)
    # the decoder layers' Linears in FP8, the LM head in BF16 (tests/test_flop_share.py)
    assert (0.5 < rec["fp8_flop_share"] < 1) if precision == "fp8" else rec["fp8_flop_share"] == 0, rec["fp8_flop_share"]
    if precision == "fp8" and recipe == "delayed":
        assert json.loads(rec["fp8_state"])  # the first modules TE scales
    if precision == "fp8":  # teacher-forced against TE's BF16 model of the same te_layer
        assert 0 <= rec["tf_top1_agreement"] <= 1 and rec["tf_kl_mean"] >= 0 and rec["tf_bf16_top1_prob"] > 0
    else:
        assert rec["tf_top1_agreement"] is None
    print(f"{model} te {te_layer} {precision}: {rec['step_ms_p50']:.2f} ms, loss {curve[0]:.3f} -> {curve[-1]:.3f}")


@pytest.mark.parametrize("model,te_layer", [("hf:llama", "swap"), ("hf:llama", "transformer_layer"),
                                            ("minigpt", "transformer_layer"), ("minigpt", "modules")])
def test_te_cells_record_the_share_of_their_flops_that_runs_in_fp8(te, model, te_layer):
    """TE's GEMMs are invisible to FlopCounterMode; the share comes from the model before TE converts it (hf: the
    converted Linears' GEMMs, tests/test_flop_share.py) or MiniGPT's formula (its blocks'). FP8 cells: between
    0.5 and 1 (the LM head BF16), hf:llama's equal to the torchao tensorwise cell's (the same Linears); BF16: 0."""
    from trials import TrialSpec, backends
    from trials.measure.metrics import blocks_fp8_share
    from trials.models.minigpt_net import ModelConfig

    arch = {"arch": "llama"} if model == "minigpt" else {}
    spec = TrialSpec(model=model, backend="te", te_layer=te_layer, precision="fp8", recipe="delayed", **arch, **TRIAL)
    fp8 = backends.build(spec, "te", "fp8", "cuda").info["fp8_flop_share"]
    assert 0.5 < fp8 < 1, fp8
    if model == "minigpt":
        assert fp8 == pytest.approx(blocks_fp8_share(ModelConfig.from_spec(spec)), rel=1e-12)
    else:
        pytest.importorskip("torchao")
        torchao = torchao_share(spec.replace(backend="torchao", recipe="tensorwise"))
        assert fp8 == pytest.approx(torchao, rel=1e-6)  # the same Linears, counted by their float8 operands
    assert backends.build(spec.replace(precision="bf16"), "te", "bf16", "cuda").info["fp8_flop_share"] == 0


def torchao_share(spec) -> float:
    """A torchao cell's fp8_flop_share, counted as its training run counts it, without the run."""
    from trials import backends
    from trials.measure.metrics import count_flops

    built = backends.build(spec, "torchao", "fp8", "cuda")
    return count_flops(spec, built.model, spec.vocab, "cuda", 1)["fp8_flop_share"]


INFER = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, vocab=512, seq_len=128, batch_size=4,
             train_steps=150, lr=3e-3, bench_steps=3, prompt_len=32, gen_len=32, profile=False, device="cuda",
             workload="infer")


@pytest.mark.parametrize("model,extra", [
    ("hf:llama", dict(precision="bf16")),
    ("hf:llama", dict(precision="fp8", recipe="delayed")),
    ("hf:llama", dict(precision="fp8", recipe="current", weights="fp8")),
    ("hf:llama", dict(precision="fp8", recipe="delayed", weights="fp8")),
    ("hf:mistral", dict(precision="fp8", recipe="current")),
], ids=["llama-bf16", "llama-delayed", "llama-current-fp8w", "llama-delayed-fp8w", "mistral-current"])
def test_a_te_swapped_transformers_model_serves_through_transformers_cache(te, model, extra):
    """trials/workloads/serving/hf.py on TE: the swapped model (te.Linear / te.RMSNorm inside transformers' attention) trains
    in BF16, then serves through transformers' DynamicCache under te.autocast; FP8 cells decode 8 rows (TE's
    minimum), agree with the BF16 reference teacher-forced, and FP8 weights take under 60% of BF16's bytes."""
    import json

    from trials import TrialSpec, run_trial

    rec = run_trial(TrialSpec(model=model, backend="te", **{**INFER, **extra}))
    assert rec["status"] == "ok", rec["error"]
    assert (rec["effective_backend"], rec["te_layer"]) == ("te", "swap")
    assert json.loads(rec["fp8_skipped_modules"]) == ["model.lm_head"]
    print(f"\n{model} te swap infer {extra}: decode {rec['decode_ms_per_token_p50']:.3f} ms/token, prefill "
          f"{rec['prefill_ms_p50']:.3f} ms, weights {rec['weight_bytes']}, kv {rec['kv_cache_bytes']}, match "
          f"{rec['gen_match_rate']}, tf {rec['tf_top1_agreement']} / {rec['tf_kl_mean']}, stride "
          f"{rec['gen_stride_accuracy']:.3f} (bf16 ref {rec['ref_stride_accuracy']:.3f})")
    assert rec["ref_stride_accuracy"] >= 0.9  # trained: the BF16 model continues its prompts
    assert len(rec["decode_times_ms"]) == 3 * 31 and rec["timer"] == "cuda_event" and rec["kv_cache_bytes"] > 0
    if extra["precision"] == "fp8":
        assert rec["decode_rows"] == 8 and rec["gen_match_rate"] >= 0.9
        assert rec["tf_top1_agreement_decided"] >= 0.9 and 0 <= rec["tf_kl_mean"] < 0.1
    else:
        assert rec["decode_rows"] == 4 and rec["tf_top1_agreement"] is None
    # the training step's count describes no inference step, nor its FP8 share (TE's build counts it in BF16 here)
    assert rec["flops_per_step"] is None and rec["fp8_flop_share"] is None
    if extra.get("weights") == "fp8":  # block Linears hold 82% of these weights: in FP8 ~0.59 of BF16's bytes
        assert rec["weight_bytes"] < 0.75 * 2 * rec["n_params"]


def test_te_transformer_layer_inference_on_a_transformers_model_is_unsupported_with_the_reason(te):
    from trials import TrialSpec, run_trial

    rec = run_trial(TrialSpec(model="hf:llama", backend="te", te_layer="transformer_layer", precision="bf16",
                              **{**INFER, "train_steps": 2}))
    assert rec["status"] == "unsupported" and "transformer_layer" in rec["error"] and "swap" in rec["error"]
