"""TE on any model, without TE: the converters' plans (which modules swap, which stay and why) and the
transformer_layer weight mapping, on tiny transformers llama / qwen2 / mistral / gemma models and a plain module.
The GPU side (logits equal HF's, FP8 trains) is tests/test_gpu_te_convert.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from trials.backends import te_convert as tc

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=64)


def tiny(model_type: str, dtype: torch.dtype = torch.bfloat16, **overrides) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {"llama": tiny("llama"), "qwen2": tiny("qwen2"), "mistral": tiny("mistral"),
            # k/v out 2 heads x 20 = 40: not a multiple of 16, while q (80) and o (80 -> 64) are
            "llama_odd": tiny("llama", head_dim=20)}


def by_name(steps: list[tc.Step]) -> dict[str, tc.Step]:
    return {s.name: s for s in steps}


BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_swap_plan_converts_every_block_linear_and_rmsnorm_but_not_the_logits_layer(models, kind):
    steps = by_name(tc.plan(models[kind]))
    for i in range(2):
        for lin in BLOCK_LINEARS:
            assert steps[f"model.layers.{i}.{lin}"] == tc.Step(f"model.layers.{i}.{lin}", "linear", "convert")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert steps[f"model.layers.{i}.{norm}"].kind == "rmsnorm" and steps[f"model.layers.{i}.{norm}"].converts
    assert steps["model.norm"].kind == "rmsnorm" and steps["model.norm"].converts
    assert not steps["lm_head"].converts and "logits" in steps["lm_head"].reason
    rec = tc.record(list(steps.values()))
    assert rec["fp8_converted_modules"] == 2 * 9 + 1 and json.loads(rec["fp8_skipped_modules"]) == ["lm_head"]
    assert len(json.loads(rec["fp8_converted_names"])) == rec["fp8_converted_modules"]


def test_swap_plan_keeps_a_non_multiple_linear_and_goes_on_with_its_siblings(models):
    """accelerate's convert_model returned at the first such Linear; here k/v stay BF16 and v's later siblings
    (o_proj, the MLP) and the next layer are still converted."""
    steps = by_name(tc.plan(models["llama_odd"]))
    for i in range(2):
        for lin in ("k_proj", "v_proj"):
            s = steps[f"model.layers.{i}.self_attn.{lin}"]
            assert not s.converts and "out_features 40 not a multiple of 16" in s.reason
        for lin in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert steps[f"model.layers.{i}.{lin}"].converts, lin


class TinyPy(nn.Module):
    """A user's own module (``py:``): no transformers, a logits Linear found by its vocab, a LayerNorm, a
    torch RMSNorm, a mean-subtracting norm that is no RMSNorm, and an odd bottleneck between convertible Linears."""

    def __init__(self, vocab: int = 100, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.a = nn.Linear(d, d)
        self.down = nn.Linear(d, 24)  # 24: not a multiple of 16
        self.up = nn.Linear(24, d)
        self.b = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d, eps=1e-6)
        self.centred = MeanNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.a(self.emb(idx))
        h = self.b(h + self.up(self.down(h)))
        return self.head(self.centred(self.rms(self.ln(h))))


class MeanNorm(nn.Module):
    """Looks like an RMSNorm (one 1-D weight, an eps) but subtracts the mean: a LayerNorm without bias."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


def test_swap_plan_on_a_plain_module():
    model = TinyPy()
    assert tc.find_logits_layer(model) == "head"
    steps = by_name(tc.plan(model))
    assert [n for n, s in steps.items() if s.converts] == ["a", "b", "ln", "rms"]
    assert steps["ln"].kind == "layernorm" and steps["rms"].kind == "rmsnorm"
    assert "out_features 24" in steps["down"].reason and "in_features 24" in steps["up"].reason
    assert steps["centred"].kind == "rmsnorm" and "neither" in steps["centred"].reason
    assert "logits" in steps["head"].reason
    assert not by_name(tc.plan(model, logits_layer="b"))["b"].converts  # the source's word for it wins


def test_rmsnorm_is_recognised_by_what_it_computes():
    """transformers' Llama RMSNorm gains by w, Gemma's by 1 + w (TE's zero_centered_gamma); neither is told by name."""
    llama, gemma = tiny("llama", torch.float32), tiny("gemma", torch.float32)
    assert tc.rmsnorm_spec(llama.model.norm) == tc.RMSNormSpec(llama.config.rms_norm_eps, False)
    assert tc.rmsnorm_spec(gemma.model.norm) == tc.RMSNormSpec(gemma.config.rms_norm_eps, True)
    assert tc.rmsnorm_spec(nn.RMSNorm(64)).eps == torch.finfo(torch.float32).eps
    assert tc.rmsnorm_spec(nn.Linear(4, 4)) is None and tc.rmsnorm_spec(nn.Embedding(4, 4)) is None


def test_tied_linear_stays_bf16():
    model = TinyPy(vocab=64)
    model.b.weight = model.a.weight  # a tied pair: swapping either would untie them
    steps = by_name(tc.plan(model))
    assert "tied to b" in steps["a"].reason and "tied to a" in steps["b"].reason


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_transformer_layer_plan_and_weight_mapping(models, kind):
    model = models[kind]
    assert tc.plan(model, "transformer_layer") == [*(tc.Step(f"model.layers.{i}", "decoder_layer", "convert")
                                                     for i in range(2)),
                                                   tc.Step("lm_head", "linear", "keep", tc.LOGITS_KEPT)]
    layer = model.model.layers[1]
    state, frozen = tc.decoder_state(layer)
    ffn, d = SHAPE["intermediate_size"], SHAPE["hidden_size"]
    fc1 = state["layernorm_mlp.fc1_weight"]
    assert fc1.shape == (2 * ffn, d)
    assert torch.equal(fc1[:ffn], layer.mlp.gate_proj.weight) and torch.equal(fc1[ffn:], layer.mlp.up_proj.weight)
    assert state["self_attention.layernorm_qkv.key_weight"] is layer.self_attn.k_proj.weight
    assert state["self_attention.layernorm_qkv.layer_norm_weight"] is layer.input_layernorm.weight
    assert state["layernorm_mlp.layer_norm_weight"] is layer.post_attention_layernorm.weight
    assert state["layernorm_mlp.fc2_weight"] is layer.mlp.down_proj.weight
    if kind == "qwen2":  # q/k/v biases are HF's; TE's other biases are zero and frozen
        assert state["self_attention.layernorm_qkv.value_bias"] is layer.self_attn.v_proj.bias
        assert frozen == ("self_attention.proj.bias", "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_bias")
        assert all(not state[n].any() for n in frozen) and state["layernorm_mlp.fc1_bias"].shape == (2 * ffn,)
    else:
        assert frozen == () and not any(n.endswith("bias") for n in state)


def test_transformer_layer_applies_to_the_llama_family_only(models):
    odd = tc.plan(models["llama_odd"], "transformer_layer")
    assert [s.action for s in odd] == ["keep", "keep", "keep"] and "head_dim 20" in odd[0].reason
    with pytest.raises(tc.ConvertError, match="llama, mistral, qwen2 models; this one is a transformers 'gemma'"):
        tc.plan(tiny("gemma"), "transformer_layer")
    with pytest.raises(tc.ConvertError, match="not a transformers model"):
        tc.plan(TinyPy(), "transformer_layer")
    assert tc.layer_refusal("transformer_layer", "qwen2") == tc.layer_refusal("swap", "gemma") == ""
    assert "one of swap, transformer_layer" in tc.layer_refusal("modules", "llama")
    yarn = tiny("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                          "original_max_position_embeddings": 32})
    with pytest.raises(tc.ConvertError, match="rope type 'yarn'"):
        tc.plan(yarn, "transformer_layer")


def test_rotary_angles_are_transformers_own_in_rotate_half_layout():
    """cos/sin of the table TE gets equal the ones transformers' rotary embedding gives the attention."""
    model = tiny("llama", torch.float32, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                          "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 32})
    rotary = model.model.rotary_emb
    t = 48
    cos, sin = rotary(torch.zeros(1, t, 64), torch.arange(t)[None])  # (1, t, head_dim)
    table = tc.RotaryAngles(rotary.inv_freq)(t, torch.device("cpu"))
    assert table.shape == (t, 1, 1, 16)
    torch.testing.assert_close(table[:, 0, 0].cos(), cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, 0, 0].sin(), sin[0], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- wiring (issue 33)
# backend te on hf: and py: models through the spec, the sweep, the trial and the FLOP count, without TE

WIRED = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn=128, vocab=96, seq_len=16, batch_size=8)


def test_the_spec_takes_te_on_your_model_with_swap_by_default_and_refuses_what_cannot_convert():
    from trials.spec import SpecError, TrialSpec, check_model

    spec = TrialSpec(model="hf:llama", backend="te", precision="fp8", **WIRED)
    check_model(spec)
    assert spec.te_layer == "swap" and TrialSpec(backend="te").te_layer == "transformer_layer"  # each source's own
    check_model(spec.replace(te_layer="transformer_layer"))
    assert TrialSpec(model="hf:qwen2").replace(model="minigpt").te_layer == "transformer_layer"  # it follows
    refusals = [  # (spec, field, message): one line each, before Ray (the CLI turns it into exit 2)
        (TrialSpec(model="hf:gpt2", backend="te", te_layer="transformer_layer", vocab=96, seq_len=16), "te_layer",
         "transformer_layer applies to transformers' llama, mistral, qwen2 models; this one is a transformers "
         "'gpt2' model: use te_layer swap"),
        (TrialSpec(model="py:examples.my_model:build", backend="te", te_layer="transformer_layer", d_model=64,
                   n_layers=1, seq_len=16), "te_layer", "this one is not a transformers model: use te_layer swap"),
    ]
    for bad, field, message in refusals:
        with pytest.raises(SpecError, match=message) as exc:
            check_model(bad)
        assert exc.value.field == field and "\n" not in str(exc.value)
        assert str(exc.value).startswith(f"{field}: transformer_layer applies to"), str(exc.value)  # named once
    with pytest.raises(SpecError, match=r"te_layer: model hf:llama takes swap or transformer_layer \(te_layer "
                                        r"modules is for model minigpt\)"):
        TrialSpec(model="hf:llama", backend="te", te_layer="modules")


def test_the_cli_refuses_transformer_layer_on_a_py_model_in_one_line_exit_2(capsys):
    from trials.cli import main

    assert main(["--model", "py:examples.my_model:build", "--backend", "te", "--te-layer", "transformer_layer",
                 "--d-model", "64", "--n-layers", "1", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: te_layer: transformer_layer applies to transformers'" in err[0], err
    assert "not a transformers model" in err[0] and err[0].count("te_layer") == 2, err  # the field, then "use te_layer swap"


def test_a_te_cell_on_your_model_is_unsupported_on_cpu_with_tes_reason():
    """As MiniGPT's te cells are on a machine without CUDA: the record says why, nothing is built."""
    from trials import TrialSpec, run_trial

    rec = run_trial(TrialSpec(model="hf:qwen2", backend="te", precision="fp8", **WIRED))
    assert (rec["status"], rec["error"]) == ("unsupported", "backend te: no CUDA device")
    assert rec["te_layer"] == "swap" and rec["model_class"] == "Qwen2ForCausalLM" and rec["n_params"] > 0
    # TE serves a converted model with its swapped modules, not with te.TransformerLayer: one sentence from the
    # source table, wherever it is asked
    from trials.models import SOURCES

    assert SOURCES["hf"].te_unsupported("infer", "transformer_layer") and not SOURCES["hf"].te_unsupported("infer")
    assert not SOURCES["minigpt"].te_unsupported("infer", "transformer_layer")
    assert SOURCES["py"].te_unsupported("train", "transformer_layer") == ""


def test_te_counts_the_flops_of_the_source_module_before_converting_it():
    """FlopCounterMode does not see TE's GEMMs, so a TE cell's FLOPs are counted on the model its source built,
    before the conversion: the same figure as the torch cell's (same module, same math), so MFU compares."""
    from trials import TrialSpec, models
    from trials.backends.te import source_model
    from trials.measure.metrics import count_flops

    spec = TrialSpec(model="hf:llama", backend="te", **WIRED)
    made, steps, flops = source_model(spec, "fp32", "cpu")
    assert steps == tc.plan(made.model, "swap", made.logits_layer)  # the plan TE's conversion then applies
    assert flops["flops_method"] == "counted"
    assert made.model.model.model.layers[0].self_attn.q_proj.__class__ is nn.Linear  # not converted yet
    assert all(p.grad is None for p in made.model.parameters())  # the count leaves no gradients behind
    torch_model = models.build(spec.replace(backend="torch"), "fp32", "cpu").model
    assert flops == count_flops(spec, torch_model, 96, "cpu", 1)
    assert flops["flops_per_step"] > 6 * models.describe(spec).n_params


def test_a_sweep_of_te_on_your_model_expands_labels_and_skips_what_does_not_convert(tmp_path):
    """The grid the study runs, tiny: swap is the unlabelled default on hf models, transformer_layer names its
    cells; transformer_layer on gpt2 is skipped with the converter's reason; the dry run shows every cell, and on
    this CPU machine each TE cell as unsupported with TE's reason."""
    from orchestrator.plan import plan_rows, unsupported_here
    from orchestrator.store import Store
    from orchestrator.sweep import parse_sweep

    sweep = parse_sweep("""
name: te-yours
grid:
  - {model: [hf:llama, hf:gpt2], backend: [te], precision: [bf16, fp8], recipe: [delayed],
     te_layer: [swap, transformer_layer, modules]}
  - {model: [hf:llama], backend: [torch], precision: [bf16]}
fixed: {d_model: 64, n_layers: 2, n_heads: 2, vocab: 96, seq_len: 16, batch_size: 8}
""")
    labels = sorted(c.label for c in sweep.cells)
    assert labels == ["hf:gpt2-d64-L2-te-bf16", "hf:gpt2-d64-L2-te-fp8-delayed",
                      "hf:llama-d64-L2-te-bf16", "hf:llama-d64-L2-te-bf16-transformer_layer",
                      "hf:llama-d64-L2-te-fp8-delayed", "hf:llama-d64-L2-te-fp8-delayed-transformer_layer",
                      "hf:llama-d64-L2-torch-bf16"]
    reasons = sorted({why.split(":")[0] for _, why in sweep.skipped})
    assert reasons == ["te_layer modules does not apply to model hf",
                       "te_layer transformer_layer applies to transformers' llama, mistral, qwen2 models; this one "
                       "is a transformers 'gpt2' model"]
    assert len(sweep.skipped) == 4 + 2
    rows = plan_rows(sweep, Store(str(tmp_path), sweep.name), unsupported_here(sweep))
    assert all(r["params"] > 0 for r in rows)
    here = {r["label"]: r["unsupported"] for r in rows}
    assert all(why == "backend te: no CUDA device" for label, why in here.items() if "-te-" in label)
    assert here["hf:llama-d64-L2-torch-bf16"] is None


def test_a_grid_line_that_transformer_layer_cannot_convert_at_all_is_bad_input():
    """Every cell of the line refused by te_layer (gpt2 is not a Llama-family model): one line naming the grid,
    not a sweep of 0 trials that exits 0 (the empty-grid-line rule, as for a te recipe on torchao)."""
    from orchestrator.sweep import SweepError, parse_sweep

    with pytest.raises(SweepError, match="grid: leaves no cell to run: model=hf:gpt2: te_layer transformer_layer "
                                         "applies to transformers' llama, mistral, qwen2 models"):
        parse_sweep("""
name: te-gpt2
grid: {model: [hf:gpt2]}
fixed: {backend: te, te_layer: transformer_layer, d_model: 64, n_layers: 2, n_heads: 2, vocab: 96, seq_len: 16}
""")


def test_te_unpickling_guard_is_lifted_only_around_the_load(monkeypatch):
    """NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is 1 inside own_extra_state only; after it, as it was: unset, or the
    user's own value (a warm server runs many trials in one process)."""
    from trials.backends import te_compat

    name = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    monkeypatch.delenv(name, raising=False)
    with te_compat.own_extra_state():
        assert os.environ[name] == "1"
    assert name not in os.environ
    monkeypatch.setenv(name, "0")
    with pytest.raises(RuntimeError), te_compat.own_extra_state():
        assert os.environ[name] == "1"
        raise RuntimeError("a load that fails")
    assert os.environ[name] == "0"


def test_a_linear_its_parent_reads_by_weight_is_kept_on_both_stacks():
    """nn.MultiheadAttention multiplies by out_proj's weight itself (F.multi_head_attention_forward): swapped
    for te.Linear or Float8Linear, out_proj would be listed as converted while its GEMM ran in BF16 (the py:
    example listed 6 converted Linears, 4 of which ran FP8)."""
    from examples.my_model import TinyLM
    from trials import TrialSpec
    from trials.backends import torchao
    from trials.models.common import WEIGHT_READ_BY_PARENT

    model = TinyLM(vocab=64, d_model=32, n_layers=2, n_heads=2, ffn=64, max_len=16)
    steps = by_name(tc.plan(model))
    heads = [f"blocks.{i}.self_attn.out_proj" for i in range(2)]
    assert all(steps[h].reason == WEIGHT_READ_BY_PARENT for h in heads)
    spec = TrialSpec(model="py:examples.my_model:build", d_model=32, n_layers=2, n_heads=2, ffn=64, vocab=64,
                     seq_len=16, backend="torchao", precision="fp8", recipe="tensorwise", device="cpu")
    info = torchao.build(spec, "fp8", "cpu").info
    assert json.loads(info["fp8_converted_names"]) == [f"model.blocks.{i}.linear{j}" for i in range(2) for j in (1, 2)]
    wrapped = [f"model.{h}" for h in heads]  # the trial wraps a factory's module as .model
    assert {h: json.loads(info["fp8_skipped_why"])[h] for h in wrapped} == dict.fromkeys(wrapped, WEIGHT_READ_BY_PARENT)
