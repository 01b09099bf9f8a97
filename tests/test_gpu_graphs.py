"""CUDA-graphed training on the GPU (-m gpu; issue 56): per stack and model source (MiniGPT's whole forward, hf:llama
and a py: factory unit by unit) a graphed cell trains as its eager twin does at the same seed; a unit that cannot be
graphed says why; the memory plan holds the pool the graphs keep. The CPU side: tests/test_unit_graphs.py."""

from __future__ import annotations

import gc

import pytest
import torch

from trials import TrialSpec, run_trial

pytestmark = pytest.mark.gpu

BASE = dict(d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=8, train_steps=30, warmup_steps=3,
            bench_steps=5, gen_len=8, lr=1e-3, device="cuda", fp8_reads=False)
HF = dict(model="hf:llama", n_kv_heads=2, ffn=512, vocab=512)
PY = dict(model="py:tests.fixtures.factories:named_units", vocab=96)
FP8 = {"precision": "fp8"}

# (id, the cell, the largest relative difference of a graphed loss from the eager one over the curve): BF16 graphs
# replay the eager kernels; FP8 and compiled cells round where their eager twins do, but cuBLAS and Inductor may
# pick other kernels under capture
CELLS = [
    ("minigpt-torch", dict(backend="torch", precision="bf16"), 1e-2),
    ("minigpt-torch-compiled", dict(backend="torch", precision="bf16", compile=True), 2e-2),
    ("minigpt-torchao-tensorwise", dict(backend="torchao", recipe="tensorwise", **FP8), 2e-2),
    ("minigpt-te-fp8-delayed", dict(backend="te", recipe="delayed", **FP8), 2e-2),
    ("minigpt-te-modules-fp8-current-accum2", dict(backend="te", te_layer="modules", recipe="current", grad_accum=2,
                                                   **FP8), 2e-2),
    ("hf-torch", dict(backend="torch", precision="bf16", **HF), 1e-2),
    ("hf-torch-compiled", dict(backend="torch", precision="bf16", compile=True, **HF), 2e-2),
    ("hf-torchao-rowwise-compiled", dict(backend="torchao", recipe="rowwise", compile=True, **FP8, **HF), 2e-2),
    ("hf-te-swap-bf16", dict(backend="te", precision="bf16", **HF), 1e-2),
    ("hf-te-swap-fp8-delayed", dict(backend="te", recipe="delayed", **FP8, **HF), 2e-2),
    ("hf-te-swap-fp8-current", dict(backend="te", recipe="current", **FP8, **HF), 2e-2),
    ("hf-te-transformer_layer-fp8-delayed", dict(backend="te", te_layer="transformer_layer", recipe="delayed", **FP8,
                                                 **HF), 2e-2),
    ("hf-te-swap-fp8-delayed-accum2", dict(backend="te", recipe="delayed", grad_accum=2, **FP8, **HF), 2e-2),
    ("py-torch", dict(backend="torch", precision="bf16", **PY), 1e-2),
    ("py-te-swap-fp8-delayed", dict(backend="te", recipe="delayed", **FP8, **PY), 2e-2),
    # dropout in each unit: the graphs' warm-up draws from the CUDA generator, which the capture must leave as it was
    # (unit_graphs.torch_graphed) for the replays to draw the eager step's masks
    ("py-dropout-torch", dict(backend="torch", precision="bf16", **{**PY, "model": "py:tests.fixtures.factories:"
                                                                              "with_dropout"}), 1e-2),
]


def _needs(extra: dict, request: pytest.FixtureRequest) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if extra.get("backend") == "te":
        request.getfixturevalue("te")  # skips without TE
    if extra.get("backend") == "torchao":
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("torchao's float8 needs compute capability 8.9+")


@pytest.mark.parametrize("extra,tol", [c[1:] for c in CELLS], ids=[c[0] for c in CELLS])
def test_graphed_training_gives_the_eager_losses_at_the_same_seed(extra, tol, request, monkeypatch):
    """The same seeded cell eager and with cuda_graphs: its loss curve within ``tol`` of the eager one at every step,
    both learning; the graphs replayed per step (forward and backward per unit, or of MiniGPT's whole forward, per
    micro-batch), their capture timed, their pool measured beside the plan's, and a compiled cell not taken for one
    whose compiled regions never ran (a replay runs their kernels, not the region the profiler counts)."""
    _needs(extra, request)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TE's attention deterministic: runs compare
    spec = TrialSpec(**{**BASE, **extra})
    eager = run_trial(spec)
    graphed = run_trial(spec.replace(cuda_graphs=True))
    assert eager["status"] == "ok", eager["error"]
    assert graphed["status"] == "ok", graphed["error"]
    units = 1 if spec.source.graphs_whole else spec.n_layers
    assert graphed["graphs_per_step"] == 2 * units * spec.grad_accum, graphed["cuda_graphs_why"]
    assert graphed["graph_capture_s"] > 0 and graphed["graph_pool_bytes"] > 0 and graphed["est_graph_pool_bytes"] > 0
    assert graphed["compiled_eager_why"] is None
    gap = max(abs(g - e) / abs(e) for g, e in zip(graphed["loss_curve"], eager["loss_curve"]))
    print(f"\n{request.node.callspec.id}: loss {eager['loss_first']:.4f} -> {eager['loss_final']:.4f} eager, "
          f"{graphed['loss_final']:.4f} graphed (largest step gap {gap:.2e}); p50 {eager['step_ms_p50']:.3f} -> "
          f"{graphed['step_ms_p50']:.3f} ms; capture {graphed['graph_capture_s']:.2f} s; pool "
          f"{graphed['graph_pool_bytes'] / 2**20:.1f} MiB (plan {graphed['est_graph_pool_bytes'] / 2**20:.1f} MiB); "
          f"{graphed['cuda_graphs_why']}")
    assert gap <= tol
    assert graphed["loss_final"] < graphed["loss_first"]


@pytest.mark.parametrize("factory,status,words", [
    ("host_branch_units", "unsupported", "cuda_graphs: the units could not be captured: "),
    ("no_units", "ok", "the model has no units (decoder layers) to graph one by one"),
    ("moe_units", "ok", "unit model.body.0 holds MoE experts (model.body.0.1)"),
], ids=["host-sync", "no-units", "moe"])
@pytest.mark.parametrize("backend", ["torch", "te"])
def test_a_unit_that_cannot_be_graphed_says_why(factory, status, words, backend, request):
    """A unit whose forward reads a value on the host fails its capture: the trial is unsupported in the capture's
    words, and the next trial in the process (TE's capture flag cleared, Python's gc, which TE stops around a
    capture, running again, the capture's side stream no longer current, and torch's CUDA generator no longer
    marked capturing: the next model's init draws from it) trains graphed. Units that cannot be graphed at all leave the step eager, the record
    saying why."""
    _needs({"backend": backend}, request)
    spec = TrialSpec(**{**BASE, "model": f"py:tests.fixtures.factories:{factory}", "vocab": 96, "backend": backend,
                        "precision": "bf16", "cuda_graphs": True, "train_steps": 5})
    rec = run_trial(spec)
    assert rec["status"] == status, rec["error"]
    if status == "unsupported":
        assert rec["error"].startswith(f"Unsupported: {words}"), rec["error"]
        assert gc.isenabled() and torch.cuda.current_stream() == torch.cuda.default_stream()
        after = run_trial(spec.replace(model="py:tests.fixtures.factories:named_units"))
        assert after["status"] == "ok" and after["graphs_per_step"] == 4, after["error"]
    else:
        assert rec["graphs_per_step"] == 0 and rec["cuda_graphs_why"].startswith(words)
        assert rec["cuda_graphs_why"].endswith("; the step ran eager")


def test_a_read_after_graphed_accumulation_casts_the_weights_as_they_are(request):
    """TE's graphs under accumulation cast each FP8 weight on a step's first micro-batch only, told by a flag the
    last micro-batch leaves at 'skip'; a read (te_compat.read_autocast, TE's ``_graph`` autocast, whose modules obey
    that flag) gives what a plain FP8 forward of the trained model gives, not the casts of the weights before the
    last optimizer step."""
    _needs({"backend": "te"}, request)
    from trials.backends import te_compat
    from trials.workloads import teacher_forced
    from trials.workloads.data import ArithmeticSequences
    from trials.workloads.train_step import build_train_step

    spec = TrialSpec(**{**BASE, "backend": "te", "te_layer": "modules", "recipe": "current", "grad_accum": 2,
                        "cuda_graphs": True, **FP8})
    te_compat.reset_te_state()
    try:
        step = build_train_step(spec, "te", "fp8", "cuda")
        data = ArithmeticSequences(spec.vocab, spec.seq_len, "cuda", spec.seed)
        step.capture(data.batch(spec.batch_size)[0])
        for _ in range(3):
            step(*data.batch(spec.step_rows))
        held = teacher_forced.held_batch(spec.vocab, spec.seq_len, "cuda", spec.seed)
        read = teacher_forced.log_probs(step.model, held, lambda: te_compat.read_autocast(step.te, step.recipe))
        plain = teacher_forced.log_probs(step.model, held, lambda: te_compat.autocast(step.te, step.recipe))
        assert torch.equal(read, plain), (read - plain).abs().max()
    finally:
        te_compat.reset_te_state()


SHAPE = dict(d_model=2048, n_layers=2, n_heads=16, vocab=32000, seq_len=2048, batch_size=4, backend="torch",
             precision="bf16", device="cuda", train_steps=3, warmup_steps=1, bench_steps=2, gen_len=2, prompt_len=4,
             profile=False, cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [{"arch": "llama", "n_kv_heads": 4}, {"model": "hf:llama", "n_kv_heads": 4,
                                                                         "ffn": 5632}], ids=["minigpt", "hf-llama"])
def test_the_memory_plan_holds_the_graphs_pool(extra):
    """tests/test_gpu_memory_plan.py's cells graphed: the plan's peak, the pool included, within 15% of the measured
    peak (the allocator's, and the pool's bytes it counts free, which the replays use), and its pool within a factor
    1.5 of the bytes the graphs' pools hold after the capture."""
    rec = run_trial(TrialSpec(**SHAPE, **extra))
    assert rec["status"] == "ok", rec["error"]
    measured = rec["peak_mem_allocated_bytes"] + rec["graph_pool_free_bytes"] - rec["mem_at_start_bytes"]
    print(f"\n{extra}: plan {rec['est_peak_mem_bytes'] / 2**30:.2f} GiB "
          f"(pool {rec['est_graph_pool_bytes'] / 2**30:.2f}), measured {measured / 2**30:.2f} GiB (pool {rec['graph_pool_bytes'] / 2**30:.2f})")
    assert 0.85 <= rec["est_peak_mem_bytes"] / measured <= 1.15, (rec["est_peak_mem_bytes"], measured)
    assert 1 / 1.5 <= rec["est_graph_pool_bytes"] / rec["graph_pool_bytes"] <= 1.5
