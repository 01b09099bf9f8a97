"""TrialSpec validation: every bad value is one error naming its field."""

import pytest

from trials import SpecError, TrialSpec


def test_defaults_follow_d_model():
    spec = TrialSpec(d_model=1024)
    assert (spec.n_heads, spec.ffn, spec.head_dim) == (16, 4096, 64)
    assert TrialSpec(d_model=32).n_heads == 1
    assert spec.replace(d_model=2048).n_heads == 32
    assert spec.replace(d_model=2048, n_heads=8).n_heads == 8


def test_default_heads_divide_d_model_with_a_head_te_and_sdpa_take():
    """d_model 224 (a search in steps of 32) once got 224 // 64 = 3 heads, which do not divide it. The rule
    leaves every default that was valid alone (those numbers do not move) and fixes the rest."""
    spec = TrialSpec(d_model=224)
    assert (spec.n_heads, spec.head_dim) == (2, 112)
    assert TrialSpec(d_model=536).head_dim == 8  # 8 * 67: only 8-wide heads divide it within 256
    for d in range(8, 16392, 8):
        old = max(1, d // 64)
        n = TrialSpec(d_model=d).n_heads
        assert d % n == 0 and (d // n) % 8 == 0 and d // n <= 256, d
        if d % old == 0 and (d // old) % 8 == 0:
            assert n == old, d


def test_choice_errors_suggest_close_names():
    with pytest.raises(SpecError, match=r"got 'bf61' \(did you mean bf16\?\)"):
        TrialSpec(precision="bf61")


@pytest.mark.parametrize("kwargs,field", [
    ({"backend": "jax"}, "backend"),
    ({"precision": "fp16"}, "precision"),
    ({"recipe": "fp4-magic"}, "recipe"),
    ({"fp8_format": "e5m2"}, "fp8_format"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"device": "tpu"}, "device"),
    ({"d_model": 100, "n_heads": 3}, "n_heads"),
    ({"d_model": 0}, "d_model"),
    ({"n_layers": -1}, "n_layers"),
    ({"batch_size": 0}, "batch_size"),
    ({"lr": 0.0}, "lr"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"d_model": "768"}, "d_model"),
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
    ({"n_layers": True}, "n_layers"),
    ({"precision": "fp8", "backend": "torch"}, "backend"),
    ({"precision": "fp8", "device": "cpu"}, "device"),
    ({"precision": "fp8", "d_model": 72, "n_heads": 1}, "d_model"),
    ({"precision": "fp8", "ffn": 1000}, "ffn"),
    ({"precision": "fp8", "batch_size": 3, "seq_len": 15}, "batch_size*seq_len"),
    ({"backend": "te", "device": "cpu"}, "backend"),
    ({"backend": "torchao", "precision": "fp8", "recipe": "delayed"}, "recipe"),  # a te recipe on torchao
    ({"backend": "te", "precision": "fp8", "recipe": "tensorwise"}, "recipe"),  # a torchao recipe on te
    ({"backend": "te", "compile": True}, "compile"),
    ({"backend": "auto", "compile": True}, "compile"),
    ({"backend": "torchao", "precision": "fp8", "recipe": "tensorwise", "workload": "infer"}, "weights"),  # torchao serves FP8 weights only
    ({"cuda_graphs": True, "device": "cpu"}, "cuda_graphs"),
    ({"prompt_len": 300}, "prompt_len"),
    ({"arch": "mamba"}, "arch"),
    ({"te_layer": "blocks"}, "te_layer"),
    ({"d_model": 100}, "d_model"),  # head dim 100 (one default head) is not a multiple of 8
    ({"d_model": 480, "n_heads": 8}, "n_heads"),  # head dim 60
    ({"arch": "llama", "d_model": 512, "n_heads": 8, "n_kv_heads": 3}, "n_kv_heads"),
    ({"arch": "llama", "n_kv_heads": 0}, "n_kv_heads"),
    ({"n_kv_heads": 4}, "n_kv_heads"),  # GQA belongs to arch llama
    ({"arch": "llama", "d_model": 768, "n_heads": 96, "n_kv_heads": 1, "precision": "fp8"}, "n_kv_heads*head_dim"),
    ({"tokens_per_step": 1000, "seq_len": 256}, "tokens_per_step"),
    ({"workload": "serve"}, "workload"),
    ({"weights": "int4"}, "weights"),
    ({"weights": "fp8", "precision": "fp8"}, "weights"),  # fp8 weights with workload train
    ({"weights": "fp8", "workload": "infer"}, "weights"),  # fp8 weights without fp8 compute
    ({"workload": "infer", "prompt_len": 200, "gen_len": 100}, "gen_len"),  # 300 > seq_len 256
    ({"workload": "infer", "gen_len": 1}, "gen_len"),
    ({"workload": "infer", "te_layer": "modules"}, "te_layer"),
    ({"tokens_per_step": 1024, "seq_len": 256, "batch_size": 8}, "tokens_per_step"),
])
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(SpecError) as info:
        TrialSpec(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_unknown_field_is_rejected():
    with pytest.raises(SpecError) as info:
        TrialSpec.from_dict({"d_modle": 768})
    assert info.value.field == "d_modle" and "allowed" in str(info.value)


def test_round_trip():
    spec = TrialSpec(d_model=256, precision="fp8", recipe="current")
    assert TrialSpec.from_dict(spec.to_dict()) == spec


def test_llama_defaults_and_tokens_per_step_sizing():
    spec = TrialSpec(arch="llama", d_model=4096, n_heads=32, n_kv_heads=8, seq_len=4096, tokens_per_step=16384)
    assert (spec.ffn, spec.kv_heads, spec.batch_size, spec.tokens) == (11008, 8, 4, 16384)  # Llama-2-7B's 11008
    assert TrialSpec(arch="llama", d_model=2048).ffn == 5632 and TrialSpec(d_model=2048).ffn == 8192
    assert TrialSpec(d_model=1024).kv_heads == 16 and TrialSpec(d_model=1024).n_kv_heads is None
    assert TrialSpec.from_dict(spec.to_dict()) == spec


def test_a_recipe_of_the_other_stack_names_both_fields():
    with pytest.raises(SpecError) as err:
        TrialSpec(backend="torchao", precision="fp8", recipe="delayed")
    assert str(err.value) == "recipe: delayed is a te recipe; backend torchao takes tensorwise, rowwise, rowwise_with_gw_hp"
    spec = TrialSpec(backend="torchao", precision="fp8", recipe="rowwise", compile=True, device="cpu")
    assert spec.compile and spec.device == "cpu"  # torchao's FP8 is not TE's: no CUDA device needed to ask


def test_batch_size_given_beside_tokens_per_step_is_refused_even_at_its_default():
    """batch_size: 32 (its default) with tokens_per_step 1024 at seq_len 256 ran batch 4 without a word."""
    with pytest.raises(SpecError) as err:
        TrialSpec.from_dict({"batch_size": 32, "tokens_per_step": 1024})
    assert err.value.field == "tokens_per_step" and "not both" in str(err.value)
    assert TrialSpec.from_dict({"tokens_per_step": 1024}).batch_size == 4
    resolved = TrialSpec.from_dict({"tokens_per_step": 8192})  # batch 32: as a worker rebuilds it from its config
    assert TrialSpec.from_dict(resolved.to_dict()) == resolved


def test_numbers_take_their_fields_type():
    """lr: 1 and lr: 1.0 are one value: the spec (and so the cell id) holds a float either way."""
    spec = TrialSpec(lr=1)
    assert type(spec.lr) is float and spec == TrialSpec(lr=1.0) and spec.to_dict() == TrialSpec(lr=1.0).to_dict()


def test_a_spec_error_is_one_line():
    assert "\n" not in str(SpecError("model", "hf:llama: refused:\n    ValueError: no"))
