"""The per-layer FP8 reads (trials/measure/fp8_layers.py) on a GPU: Transformer Engine's delayed and current scaling,
MiniGPT (te.TransformerLayer) and hf:llama (converted), and torchao on CUDA. Run with ``-m gpu``."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from trials import run_trial

from .test_gpu import _fp8_meta, _small

pytestmark = pytest.mark.gpu

HF_LLAMA = {"model": "hf:llama", "n_kv_heads": 2, "ffn": 512, "vocab": 512}
# Two runs of one seeded cell read the same model: the read is of what the timed steps left, before the energy
# window trains on for a timing-dependent number of steps (before that fix, two H200 runs differed already in the
# first decimal of the first module's forward SQNR, 30.26 dB in one). The forward reads are then the same bit for
# bit. The backward ones (dgrad, wgrad, and the grad operand's cast health, all from the read's own backward) may
# move by a rounding: a backward kernel that accumulates with atomics (split-K GEMMs, attention's dQ, a wgrad
# reduction) can sum in another order, and a last-bit change in an upstream gradient flips single FP8 roundings
# and, under current scaling, the amax that scales the whole tensor: expected to move a module's SQNR by
# hundredths of a dB at most. 0.5 dB leaves that room with margin while a read of another model or a worse layer
# still fails; the test prints the largest backward difference it saw, so a GPU run says how much room is used.
BWD_SQNR_TOLERANCE_DB = 0.5
BWD_CAST_TOLERANCE = 1e-3  # share of a gradient's elements: a few roundings flipped, not a scale that moved


def _same_read(first: str, second: str) -> None:
    """Two runs' ``fp8_layers``: forward parts equal, backward parts within the tolerances above."""
    a, b = json.loads(first), json.loads(second)
    backward = {"sqnr": ("dgrad", "wgrad"), "cast": ("grad",)}
    moved = {(part, key): (a[part].pop(key), b[part].pop(key)) for part, keys in backward.items() for key in keys}
    assert a == b, "the forward reads of two runs of one seeded cell differ"
    for (part, key), (x, y) in moved.items():
        if part == "sqnr":
            assert x == pytest.approx(y, abs=BWD_SQNR_TOLERANCE_DB), (key, x, y)
        else:
            for kind in x:
                assert x[kind] == pytest.approx(y[kind], abs=BWD_CAST_TOLERANCE), (key, kind, x[kind], y[kind])
    gap = max((abs(u - v) for d in ("dgrad", "wgrad") for u, v in zip(*moved[("sqnr", d)]) if u != v), default=0.0)
    print(f"\nbackward SQNR, largest difference between the two runs: {gap:.3g} dB")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("extra", [{}, HF_LLAMA], ids=["minigpt", "hf-llama"])
def test_te_fp8_cells_read_every_layer_the_same_twice_and_train_the_same_without_the_reads(te, monkeypatch, recipe,
                                                                                        extra):
    """Reads on, twice: finite SQNR per TE module in every direction, the forward reads the same bit for bit and
    the backward ones within a rounding (TE's attention held to its deterministic kernels; _same_read); reads
    off: the same losses through the benchmark and the same tokens."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    spec = _small(backend="te", precision="fp8", recipe=recipe, train_steps=16, n_heads=4, **extra)
    first, second = run_trial(spec), run_trial(spec)
    assert first["status"] == second["status"] == "ok", (first["error"], second["error"])
    layers = json.loads(first["fp8_layers"])
    assert layers["modules"], "no TE module read"
    for d in ("fwd", "dgrad", "wgrad"):
        assert all(math.isfinite(v) for v in layers["sqnr"][d]), (d, layers["sqnr"][d])
    _same_read(first["fp8_layers"], second["fp8_layers"])
    assert all(first[f"cast_{k}_{c}"] is not None for k in ("underflow", "saturation") for c in ("act", "weight", "grad"))
    unread = run_trial(replace(spec, fp8_reads=False))
    assert unread["status"] == "ok" and unread["fp8_layers"] is None, unread["error"]
    assert unread["loss_curve"] == first["loss_curve"] and unread["bench_loss_final"] == first["bench_loss_final"]
    assert unread["gen_tokens"] == first["gen_tokens"]
    print(f"\n{recipe} {extra.get('model', 'minigpt')}: fwd min {first['sqnr_fwd_min_db']:.1f} dB "
          f"({first['sqnr_fwd_worst']}), dgrad {first['sqnr_dgrad_min_db']:.1f}, wgrad {first['sqnr_wgrad_min_db']:.1f}; "
          f"grad underflow {first['cast_underflow_grad']:.2e}; reads {first['fp8_layers_s']:.2f} s + "
          f"{first['outliers_s']:.2f} s")


def test_the_te_layer_read_leaves_delayed_scaling_state_exactly_as_it_was(te):
    """The per-layer read of a trained delayed-scaling model (FP8 forwards and backwards of every module) leaves
    every scale and amax history bit for bit as they were."""
    from trials.measure import fp8_layers
    from trials.backends import numerics
    from trials.workloads import teacher_forced
    from trials.workloads.data import ArithmeticSequences
    from trials.workloads.train_step import build_train_step, train

    spec = _small(backend="te", precision="fp8", recipe="delayed", train_steps=5)
    step = build_train_step(spec, "te", "fp8", "cuda")
    train(step, ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed), spec.train_steps, spec.batch_size)
    before = _fp8_meta(step.model)
    reads = fp8_layers.read_layers(step, numerics("te"), teacher_forced.held_pair(spec.vocab, spec.seq_len, "cuda",
                                                                                   spec.seed), "cuda")
    assert reads and all(math.isfinite(r.sqnr["fwd"]) for r in reads)
    after = _fp8_meta(step.model)
    assert len(after) == len(before) and all(a.equal(b) for a, b in zip(after, before))


def test_torchao_fp8_cells_on_cuda_read_every_layer():
    """torchao tensorwise and rowwise on the GPU's float8 GEMMs: finite SQNR above torchao's own floors."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trials.measure.fp8_floors import SQNR_FLOOR_DB

    for recipe in ("tensorwise", "rowwise"):
        rec = run_trial(_small(backend="torchao", precision="fp8", recipe=recipe, train_steps=16))
        assert rec["status"] == "ok", rec["error"]
        assert all(rec[f"sqnr_{d}_min_db"] > floor for d, floor in SQNR_FLOOR_DB.items()), rec["fp8_layers"]
