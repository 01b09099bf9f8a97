"""The per-layer FP8 reads (trials/measure/fp8_layers.py): cast health on tensors built to a known share, SQNR and outlier
statistics on known signals, and a tiny torchao tensorwise model read twice from one seed."""

from __future__ import annotations

import math

import pytest
import torch

from trials import TrialSpec
from trials.measure.fp8_layers import cast_health, outlier_stats, sqnr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype,tiny,big,near", [(E4M3, 1e-4, 600.0, 460.0), (E5M2, 1e-7, 70000.0, 60000.0)])
def test_cast_health_counts_the_elements_flushed_and_saturated_by_construction(dtype, tiny, big, near):
    """1000 elements under scale 1: 100 nonzero ones below half the smallest subnormal (flushed), 50 beyond the
    maximum by more than half an ulp (saturated), 20 just above the maximum that round down to it (neither), 30
    zeros (not flushed: they were zero), the rest ordinary."""
    x = torch.cat([torch.full((100,), tiny), torch.full((50,), -big), torch.full((20,), near), torch.zeros(30),
                   torch.ones(800)])
    got = cast_health(x, torch.tensor(1.0), dtype)
    assert (got.underflow, got.saturation) == (0.1, 0.05)
    # the same tensor scaled 1/2: the tiny values round further to zero, the big ones come within range
    half = cast_health(x, torch.tensor(0.5), dtype)
    assert (half.underflow, half.saturation) == (0.1, 0.0)


def test_cast_health_takes_a_scale_per_row():
    """Row scales broadcast: row 0 scaled so that all its values saturate, row 1 so that none do."""
    x = torch.ones(2, 8)
    got = cast_health(x, torch.tensor([[1000.0], [1.0]]), E4M3)
    assert (got.underflow, got.saturation) == (0.0, 0.5)


def test_sqnr_and_outlier_statistics_of_known_signals():
    ref = torch.ones(1000)
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)  # noise power 1/100 of the signal's
    assert sqnr_db(ref, ref) == math.inf
    ratio, kurtosis = outlier_stats(torch.tensor([1.0, -1.0] * 50))
    assert (ratio, kurtosis) == pytest.approx((1.0, 1.0))
    spike = torch.zeros(10_000)
    spike[0] = 1.0  # one outlier: max/rms = sqrt(n), kurtosis ~ n
    ratio, kurtosis = outlier_stats(spike)
    assert ratio == pytest.approx(100.0) and kurtosis == pytest.approx(9998.0, rel=1e-3)


def test_a_tiny_torchao_tensorwise_model_reads_every_fp8_layer_finite_and_the_same_from_one_seed():
    """Every Float8Linear of a 2-layer llama MiniGPT read on the held batch: SQNR finite (FP8 is not exact) and
    above torchao's own floors at this size, cast shares in [0, 1], each direction; built twice from one seed, the
    same values bit for bit, and the model's gradients left empty."""
    pytest.importorskip("torchao")
    from trials.measure import fp8_floors, fp8_layers
    from trials.backends import numerics
    from trials.workloads.teacher_forced import held_pair
    from trials.workloads.train_step import build_train_step

    spec = TrialSpec(backend="torchao", precision="fp8", recipe="tensorwise", arch="llama", d_model=32, n_layers=2,
                     seq_len=16, device="cpu")
    held = held_pair(spec.vocab, spec.seq_len, "cpu", spec.seed)

    def read() -> dict:
        step = build_train_step(spec, "torchao", "fp8", "cpu")
        reads = fp8_layers.read_layers(step, numerics("torchao"), held, "cpu")
        assert all(p.grad is None for p in step.model.parameters())
        return fp8_layers.record_fields(reads, None)

    first, second = read(), read()
    assert first == second
    layers = __import__("json").loads(first["fp8_layers"])
    assert layers["modules"] == [f"blocks.{i}.{m}" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2")]
    for d, floor in fp8_floors.SQNR_FLOOR_DB.items():
        assert all(math.isfinite(v) and v > floor for v in layers["sqnr"][d]), (d, layers["sqnr"][d])
        assert first[f"sqnr_{d}_min_db"] == min(layers["sqnr"][d]) and first[f"sqnr_{d}_worst"] in layers["modules"]
    for cls in fp8_floors.OPERANDS:
        assert all(0 <= v <= 1 for kind in ("underflow", "saturation") for v in layers["cast"][cls][kind])


def test_a_compiled_units_fp8_modules_are_read_under_the_models_own_names():
    """Compiled per unit, a decoder layer's modules sit under torch.compile's ``_orig_mod``: the full-depth H200
    study's worst layer read ``model.model.layers.23._orig_mod.self_attn.k_proj``, a name the model (and the
    record's fp8_converted_names) does not have. The reads now name every module as the model does."""
    pytest.importorskip("torchao")
    import json

    from trials.backends import numerics
    from trials.measure.fp8_layers import fp8_modules
    from trials.workloads.train_step import build_train_step

    spec = TrialSpec(model="hf:llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn=64, vocab=96, seq_len=16,
                     batch_size=2, backend="torchao", precision="fp8", recipe="tensorwise", compile=True,
                     device="cpu")
    step = build_train_step(spec, "torchao", "fp8", "cpu")  # compile is lazy: nothing is compiled here
    raw = [name for name, _ in numerics("torchao").fp8_modules(step.model)]
    assert any("._orig_mod." in name for name in raw), raw
    names = [name for name, _ in fp8_modules(numerics("torchao"), step.model)]
    assert names == json.loads(step.built.info["fp8_converted_names"]) and len(names) == 14
