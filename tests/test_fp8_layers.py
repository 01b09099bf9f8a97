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
        reads, total = fp8_layers.read_layers(step, numerics("torchao"), held, "cpu")
        assert all(p.grad is None for p in step.model.parameters())
        return fp8_layers.record_fields(reads, None, total)

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


def _tiny_read(**fields) -> dict:
    """The record fields of one tiny torchao tensorwise llama MiniGPT's per-layer read (1 layer, d32, seq 16)."""
    from trials.backends import numerics
    from trials.measure import fp8_layers
    from trials.workloads.teacher_forced import held_pair
    from trials.workloads.train_step import build_train_step

    spec = TrialSpec(backend="torchao", precision="fp8", recipe="tensorwise", arch="llama", d_model=32, n_layers=1,
                     seq_len=16, device="cpu", **fields)
    step = build_train_step(spec, "torchao", "fp8", "cpu")
    held = held_pair(spec.vocab, spec.seq_len, "cpu", spec.seed)
    reads, total = fp8_layers.read_layers(step, numerics("torchao"), held, "cpu")
    return fp8_layers.record_fields(reads, None, total)


def test_activation_checkpointing_full_reads_every_fp8_module_as_without_it():
    """Under activation checkpointing the backward recomputes each unit's forward. The read's forward hooks were
    still there, so every recomputed module looked called twice (a shared module) and was left out: 1 of this
    model's 4 FP8 modules read (the full-depth H200 study, AC full: 32 of 224, its down projections only). The
    hooks now go before the backward: every module is read, and reads what it reads without checkpointing."""
    pytest.importorskip("torchao")
    import json

    plain, full = _tiny_read(), _tiny_read(activation_checkpointing="full")
    assert json.loads(full["fp8_layers"])["modules"] == json.loads(plain["fp8_layers"])["modules"]
    assert full["fp8_layers_read"] == full["fp8_layers_total"] == plain["fp8_layers_total"] == 4
    assert full == plain


def _read(name: str, fwd: float):
    from trials.measure.fp8_layers import CastHealth, LayerRead

    return LayerRead(name, {"fwd": fwd, "dgrad": 25.0, "wgrad": 25.0}, {c: CastHealth(0.0, 0.0) for c in
                                                                        ("act", "weight", "grad")})


def test_a_layer_whose_fp8_output_is_nan_is_the_worst_and_under_its_floor(tmp_path):
    """A broken layer (its FP8 output NaN: SQNR NaN) used to vanish: the summary took the min of the other
    layers, and the report's ``NaN < floor`` is false. It now reads -inf, the worst, in the record's min and
    worst module and in the report's below-floor table; a record written before (NaN in its JSON) is read the
    same way. A read of fewer FP8 modules than the model runs is named in the report's note, and a TE cell's
    row says what its fused modules give the reads."""
    import json

    from orchestrator.report.analysis import prepare
    from orchestrator.report.numerics import TE_FUSED_NOTE, below_floor, layer_frame, sections
    from orchestrator.store import Store
    from trials.measure.fp8_layers import record_fields
    from trials.record.fields import empty_record

    good = [_read("blocks.0.qkv", 30.0), _read("blocks.0.fc2", 28.0)]
    fields = record_fields(good + [_read("blocks.0.fc1", math.nan)], None)
    assert fields["sqnr_fwd_min_db"] == -math.inf and fields["sqnr_fwd_worst"] == "blocks.0.fc1"
    assert fields["sqnr_fwd_median_db"] == 28.0
    fields.update(fp8_layers_read=3, fp8_layers_total=3)
    old = record_fields(good, None)  # as the code before wrote it: the NaN dropped from the min, kept in the JSON
    layers = json.loads(old["fp8_layers"])
    layers["modules"].append("blocks.0.fc1")
    for d in layers["sqnr"]:
        layers["sqnr"][d].append(math.nan if d == "fwd" else 25.0)
    old.update(fp8_layers=json.dumps(layers), fp8_layers_read=2, fp8_layers_total=3)  # one module short, too

    store = Store(str(tmp_path), "nan")
    store.ensure()
    for cell, f, backend, recipe in (("new", fields, "torchao", "tensorwise"), ("old", old, "te", "delayed")):
        store.write_record({**empty_record(), **f, "status": "ok", "cell_id": cell, "cell_label": cell, "sample": 0,
                            "backend": backend, "precision": "fp8", "recipe": recipe})
    df = prepare(store.read_records().to_pandas())
    low = below_floor(layer_frame(df))
    assert sorted(zip(low["cell"], low["module"], low["direction"])) == [("new", "blocks.0.fc1", "fwd"),
                                                                         ("old", "blocks.0.fc1", "fwd")]
    assert (low["lowest SQNR dB"] == -math.inf).all()
    [(_, note, table)] = [s for s in sections(df) if s[0] == "FP8 numerics per layer"]
    assert "not every FP8 module was read in old (2 of 3)" in note and "new (" not in note, note
    assert table.set_index("cell")["modules read"].to_dict() == {"new": "3 of 3", "old": "2 of 3"}
    # beside a TE cell the note says what its fused modules give the reads (its outliers are not torchao's tensors)
    assert TE_FUSED_NOTE in note
    [(_, alone, _)] = [s for s in sections(df[df["backend"] == "torchao"]) if s[0] == "FP8 numerics per layer"]
    assert TE_FUSED_NOTE not in alone and "not every FP8 module" not in alone
