"""TrialSpec validation: every bad value is one error naming its field."""

import pytest

from trials import SpecError, TrialSpec


def test_defaults_follow_d_model():
    spec = TrialSpec(d_model=1024)
    assert (spec.n_heads, spec.ffn, spec.head_dim) == (16, 4096, 64)
    assert TrialSpec(d_model=32).n_heads == 1
    assert spec.replace(d_model=2048).n_heads == 32
    assert spec.replace(d_model=2048, n_heads=8).n_heads == 8


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
    ({"cuda_graphs": True, "device": "cpu"}, "cuda_graphs"),
    ({"prompt_len": 300}, "prompt_len"),
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
