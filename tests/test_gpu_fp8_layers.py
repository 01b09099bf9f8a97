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
    reads, _ = fp8_layers.read_layers(step, numerics("te"), teacher_forced.held_pair(spec.vocab, spec.seq_len,
                                                                                      "cuda", spec.seed), "cuda")
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


def _trained_te_delayed():
    from trials.workloads.data import ArithmeticSequences
    from trials.workloads.train_step import build_train_step, train

    spec = _small(backend="te", precision="fp8", recipe="delayed", train_steps=5)
    step = build_train_step(spec, "te", "fp8", "cuda")
    train(step, ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed), spec.train_steps, spec.batch_size)
    return spec, step


def test_te_delayed_reads_judge_and_run_every_pass_under_the_scales_training_left(te):
    """TE's backward rolls the gradient it just saw into ``scaling_bwd`` and sets new scales, the read's own
    backward and each module's FP8 pass included (``_graph`` skips only the forward's update). The read judged
    the grad casts by that refreshed scale (every delayed record: cast_saturation_grad 0.0) and ran each pass
    under what the passes before it left. Here each FP8 module runs a pass on a gradient far beyond any training
    saw: TE's backward puts its amax into one backward slot (the slot TE casts it with: LayerNormMLP's fc2 grad
    output, 2, not fc1's 0); the read judges the gradient by that slot's scale as training left it (so it
    saturates), over all of the module's GEMM weights; the next FP8 pass starts from training's state again."""
    import torch
    from transformer_engine.common.recipe import Format

    from trials.backends import numerics
    from trials.measure import fp8_layers
    from trials.workloads import teacher_forced

    spec, step = _trained_te_delayed()
    seam = numerics("te")
    before = _fp8_meta(step.model)
    bwd_max = torch.finfo(torch.float8_e4m3fn if step.recipe.fp8_format == Format.E4M3 else torch.float8_e5m2).max
    modules = fp8_layers.fp8_modules(seam, step.model)
    trained = {name: module.fp8_meta["scaling_bwd"].scale.clone() for name, module in modules}
    kinds = set()
    with fp8_layers.quiet(step.model, "cuda"), seam.read_context(step) as saved:
        for name, module in modules:
            kinds.add(type(module).__name__)
            first = seam.weights(module)[0]  # the first GEMM's (out, in) weight: in is the module's input width
            x = torch.randn(1, spec.seq_len, first.shape[-1], device="cuda", dtype=first.dtype)
            with torch.no_grad():
                shape = seam.run(module, x, fp8=False).shape
            # far beyond any gradient training saw (its loss a mean over 2048 tokens); its scale (max / ~4e3)
            # far from the initial 1 of a slot TE never fills
            dy = torch.randn(shape, device="cuda", dtype=first.dtype) * 1e3
            with seam.fp8_context(step, saved):
                fp8_layers._module_pass(seam, module, x, dy, fp8=True)
            refreshed = module.fp8_meta["scaling_bwd"].scale
            slot = int(torch.argmin((refreshed - bwd_max / dy.abs().amax().float()).abs() / refreshed))
            assert float(refreshed[slot]) == pytest.approx(bwd_max / float(dy.abs().amax()), rel=1e-3), name
            t, s, _ = seam.casts(module, x, dy, step, saved)["grad"]
            assert torch.equal((t.float() * s.float()).flatten(), dy.float().flatten() * trained[name][slot]), name
            assert fp8_layers.cast_health(*seam.casts(module, x, dy, step, saved)["grad"]).saturation > 0, name
            w, _, _ = seam.casts(module, x, dy, step, saved)["weight"]
            assert w.numel() == sum(p.numel() for p in seam.weights(module)), name
        assert not all(a.equal(b) for a, b in zip(_fp8_meta(step.model), before))  # the passes moved TE's state
        with seam.fp8_context(step, saved):
            assert all(a.equal(b) for a, b in zip(_fp8_meta(step.model), before))  # every pass starts from training's
    assert "LayerNormMLP" in kinds, kinds
    # the whole read on a held gradient 2048x training's (train_tokens 1 against batch 16 x seq 128): saturates
    held = teacher_forced.held_pair(spec.vocab, spec.seq_len, "cuda", spec.seed)
    reads, total = fp8_layers.read_layers(step, seam, held, "cuda", train_tokens=1)
    big = fp8_layers.record_fields(reads, None, total)
    assert big["cast_saturation_grad"] > 0, big
    assert all(a.equal(b) for a, b in zip(_fp8_meta(step.model), before))


@pytest.mark.parametrize("backend,recipe", [("te", "delayed"), ("torchao", "tensorwise")])
def test_activation_checkpointed_cells_read_every_fp8_module_on_the_gpu(request, backend, recipe):
    """Activation checkpointing full (TE: te.distributed.checkpoint; torchao: torch's): the recompute in the
    read's backward no longer counts as a second forward, every FP8 module is read."""
    import torch

    if backend == "te":
        request.getfixturevalue("te")  # skips without TE or a GPU
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rec = run_trial(_small(backend=backend, precision="fp8", recipe=recipe, train_steps=4,
                           activation_checkpointing="full"))
    assert rec["status"] == "ok", rec["error"]
    assert rec["fp8_layers_read"] == rec["fp8_layers_total"] > 0, rec["fp8_layers"]
    assert all(math.isfinite(v) for v in json.loads(rec["fp8_layers"])["sqnr"]["fwd"])
