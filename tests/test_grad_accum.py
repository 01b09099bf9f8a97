"""Gradient accumulation (``grad_accum``): a global batch split into micro-batches trains the loss curve of the
unsplit batch, on every model source and every stack CPU runs, one process or two gloo ranks (DDP, FSDP2); a
step, its tokens and its FLOPs are the optimizer step's; bad values are one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from orchestrator.cli import main
from trials import SpecError, TrialSpec, run_trial
from trials.measure import memory_plan
from trials.measure.metrics import count_flops
from trials.workloads.data import ArithmeticSequences
from trials.workloads.train_step import build_train_step, train

from .conftest import REPO, _free_port, cli_env

MINIGPT = dict(d_model=32, n_layers=2)
HF = dict(model="hf:llama", vocab=96, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn=64)
PY = dict(model="py:tests.fixtures.factories:named_units", vocab=96, d_model=32, n_layers=2)
CPU = dict(seq_len=32, device="cpu", backend="torch", precision="fp32")
STEPS = 4
TOLERANCE = 1e-5  # fp32: the micro-batches' gradients summed in another order than one batch's


def trained(model: dict, **fields) -> tuple[list[float], list[torch.Tensor]]:
    """(loss curve, AdamW's first moments) of STEPS steps on the seeded data: the moments are 0.1 x the first
    step's gradient plus the later ones', so they hold the gradients' size, which AdamW's update does not."""
    spec = TrialSpec(**model, **{**CPU, **fields})
    step = build_train_step(spec, spec.backend, spec.precision, "cpu")
    losses = train(step, ArithmeticSequences(96, spec.seq_len, "cpu", spec.seed), STEPS, spec.step_rows).losses
    moments = [step.optimizer.state[p]["exp_avg"] for p in step.model.parameters() if p in step.optimizer.state]
    return losses, moments


def relative_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).norm() / x.float().norm()) for x, y in zip(a, b))


@pytest.mark.parametrize("model", [MINIGPT, HF, PY], ids=["minigpt", "hf-llama", "py-factory"])
def test_a_global_batch_split_into_micro_batches_trains_the_unsplit_loss_curve(model):
    """8 rows in one batch and 4 micro-batches of 2 see the same token ids each step and make the same update:
    the loss curve and the gradients (AdamW's moments) agree within fp32 rounding."""
    whole, whole_moments = trained(model, batch_size=8)
    split, split_moments = trained(model, batch_size=2, grad_accum=4)
    assert split == pytest.approx(whole, abs=TOLERANCE)
    assert relative_gap(whole_moments, split_moments) < TOLERANCE


def test_torchao_fp8_splits_its_batch_within_fp8s_own_noise():
    """torchao's tensorwise FP8 (on CPU, its reference path) scales each micro-batch's activations by that
    micro-batch's amax, so a split is not bit-for-bit the unsplit batch; its losses stay within FP8's noise
    (3e-4 at these sizes) and its gradients within a few percent, where a loss left undivided by grad_accum
    would make them 4x."""
    fp8 = dict(backend="torchao", precision="fp8", recipe="tensorwise")
    whole, whole_moments = trained(MINIGPT, batch_size=8, **fp8)
    split, split_moments = trained(MINIGPT, batch_size=2, grad_accum=4, **fp8)
    assert split == pytest.approx(whole, abs=2e-3)
    assert relative_gap(whole_moments, split_moments) < 0.5


def test_a_split_trial_counts_the_optimizer_steps_tokens_and_flops_and_one_micro_batchs_activations():
    """A trial's step is the optimizer step: tokens_per_step and flops_per_step are the whole batch's whatever its
    split, tokens/s is them over the step time, and the bytes held for backward are one micro-batch's, as the
    memory plan estimates them."""
    run = dict(**MINIGPT, **CPU, train_steps=STEPS, warmup_steps=1, bench_steps=2, gen_len=4, profile=False)
    whole = run_trial(TrialSpec(**run, batch_size=8))
    split = run_trial(TrialSpec(**run, batch_size=2, grad_accum=4))
    for rec in (whole, split):
        assert rec["status"] == "ok", rec["error"]
        assert rec["tokens_per_step"] == 8 * 32
        assert rec["tokens_per_s"] == pytest.approx(rec["tokens_per_step"] / (rec["step_ms_mean"] / 1000))
    assert split["grad_accum"] == 4 and split["flops_per_step"] == whole["flops_per_step"]
    assert split["loss_curve"] == pytest.approx(whole["loss_curve"], abs=TOLERANCE)
    assert split["est_activation_bytes"] == memory_plan.plan(TrialSpec(**run, batch_size=2)).activations
    assert 0 < split["saved_activation_bytes"] < whole["saved_activation_bytes"] / 2


def test_a_counted_models_flops_are_the_whole_steps():
    """hf: and py: models count their FLOPs on one micro-batch; the step's are every micro-batch's."""
    spec = TrialSpec(**HF, **CPU, batch_size=8)
    model = build_train_step(spec, "torch", "fp32", "cpu").model
    whole = count_flops(spec, model, 96, "cpu", 1)["flops_per_step"]
    assert count_flops(spec.replace(batch_size=2, grad_accum=4), model, 96, "cpu", 1)["flops_per_step"] == \
        pytest.approx(whole, rel=1e-12)


def test_the_memory_plan_holds_one_micro_batchs_activations_beside_the_gradients():
    """Activations and logits are a micro-batch's; a later micro-batch's backward runs with the gradients held,
    and FSDP2 accumulates them whole until the step's last micro-batch reduces them."""
    one = memory_plan.plan(TrialSpec(**MINIGPT, **CPU, batch_size=2))
    split = memory_plan.plan(TrialSpec(**MINIGPT, **CPU, batch_size=2, grad_accum=4))
    assert (split.activations, split.logits, split.grads) == (one.activations, one.logits, one.grads)
    assert split.total == one.weights + one.optimizer + one.activations + one.logits + one.grads
    fsdp = dict(**MINIGPT, **CPU, batch_size=2, world_size=2, parallel="fsdp")
    sharded = memory_plan.plan(TrialSpec(**fsdp)).grads
    assert memory_plan.plan(TrialSpec(**fsdp, grad_accum=4)).grads == sharded + one.grads


def test_tokens_per_step_sizes_the_micro_batch():
    """A fixed tokens_per_step split another way (a search's move) re-sizes the micro-batch."""
    spec = TrialSpec(seq_len=256, tokens_per_step=4096, grad_accum=4)
    assert (spec.batch_size, spec.step_rows, spec.tokens) == (4, 16, 4096)
    assert (spec.replace(grad_accum=2).batch_size, spec.replace(seq_len=128).batch_size) == (8, 8)
    with pytest.raises(SpecError, match="multiple of seq_len=256 x grad_accum=4"):
        TrialSpec(seq_len=256, tokens_per_step=512, grad_accum=4)


@pytest.mark.parametrize("values, words", [
    ({"grad_accum": 0}, "grad_accum: must be a positive integer"),
    ({"grad_accum": 1.5}, "grad_accum: must be an integer"),
    ({"grad_accum": True}, "grad_accum: must be an integer"),
    ({"grad_accum": 2, "workload": "infer"}, "grad_accum: accumulates gradients over micro-batches: workload train"),
])
def test_a_bad_grad_accum_is_one_line_exit_2(capsys, values, words):
    assert main(["trial", "--spec-json", json.dumps(values)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_sweep_with_a_bad_grad_accum_is_one_line_exit_2(capsys, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ngrid: {grad_accum: [1, -2]}\nfixed: {device: cpu}\n")
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grad_accum: must be a positive integer" in err[0], err


# One torchrun launch: every rank runs each cell's steps; a DDP comm hook counts the buckets reduced
RANKS_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
torch.set_num_threads(1)
from trials import TrialSpec
from trials.parallel import ranks as distributed
from trials.workloads.data import ArithmeticSequences
from trials.workloads.train_step import build_train_step, train
dist.init_process_group("gloo")
ranks = distributed.Ranks.from_env()
out = {}
for cell in json.loads(sys.argv[1]):
    spec = TrialSpec(**cell)
    step = build_train_step(spec, "torch", "fp32", "cpu", ranks)
    reduced = []
    if spec.parallel == "ddp":
        step.wrapped.register_comm_hook(None, lambda state, bucket: reduced.append(1) or allreduce_hook(state, bucket))
    data = distributed.RankData(ArithmeticSequences(96, spec.seq_len, "cpu", spec.seed), ranks)
    losses = distributed.mean(train(step, data, int(sys.argv[3]), spec.step_rows).losses, ranks)
    out[f"{spec.parallel} {spec.batch_size}x{spec.grad_accum}"] = {"losses": losses, "reduced": len(reduced)}
if ranks.lead:
    open(sys.argv[2], "w").write(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_and_fsdp2_split_the_global_batch_and_reduce_once_a_step(tmp_path):
    """Two gloo ranks, 4 rows each a step, in one batch or in 4 micro-batches of 1: DDP and FSDP2 train one loss
    curve, and DDP reduces its buckets once a step (no_sync on all but the last micro-batch), not once a
    micro-batch."""
    cells = [dict(**MINIGPT, **CPU, world_size=2, parallel=parallel, batch_size=batch, grad_accum=accum)
             for parallel in ("ddp", "fsdp") for batch, accum in ((4, 1), (1, 4))]
    script, out = tmp_path / "ranks.py", tmp_path / "out.json"
    script.write_text(RANKS_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          f"--master-port={_free_port()}", str(script), json.dumps(cells), str(out), str(STEPS)],
                         capture_output=True, text=True, cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    whole = got["ddp 4x1"]["losses"]
    for name in ("ddp 1x4", "fsdp 4x1", "fsdp 1x4"):
        assert got[name]["losses"] == pytest.approx(whole, abs=1e-4), name  # DDP and FSDP2 sum in other orders
    assert got["ddp 1x4"]["reduced"] == got["ddp 4x1"]["reduced"] >= STEPS


GPU = dict(vocab=128, d_model=256, n_layers=2, seq_len=128, device="cuda")
GPU_HF = dict(GPU, model="hf:llama", n_heads=4, n_kv_heads=2, ffn=512)


def gpu_trained(model: dict, graphs: bool = False, **fields) -> tuple[list[float], int]:
    """(loss curve of 6 steps, FP8 weight casts TE's modules keep between micro-batches) on the GPU."""
    spec = TrialSpec(**{**model, **fields})
    step = build_train_step(spec, spec.backend, spec.precision, "cuda")
    if graphs:  # as the trial captures: one micro-batch's shape, from data of its own
        step.capture(ArithmeticSequences(128, spec.seq_len, "cuda", spec.seed).batch(spec.batch_size)[0])
    losses = train(step, ArithmeticSequences(128, spec.seq_len, "cuda", spec.seed), 6, spec.step_rows).losses
    return losses, sum(len(getattr(m, "_fp8_workspaces", None) or {}) for m in step.model.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [dict(backend="torch", precision="bf16"),
                                    dict(backend="te", precision="fp8", recipe="delayed")], ids=["torch-bf16", "te-fp8"])
def test_a_graphed_split_step_replays_its_micro_batch_and_trains_the_eager_splits_curve(fields):
    """cuda_graphs with grad_accum 4: the captured micro-batch replays 4 times a step; the gradients add up
    (autograd never keeps a graph's static buffer as .grad for the next replay to overwrite) and TE casts its
    FP8 weights on the first replay only: the eager split's loss curve (H100: identical)."""
    eager, _ = gpu_trained(GPU, batch_size=4, grad_accum=4, **fields)
    graphed, _ = gpu_trained(GPU, graphs=True, batch_size=4, grad_accum=4, **fields)
    assert graphed == pytest.approx(eager, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("model, fields", [
    (GPU, dict(recipe="delayed")),  # MiniGPT's te.TransformerLayer blocks
    (GPU, dict(recipe="current", te_layer="modules")),  # TE's modules composed
    (GPU_HF, dict(recipe="delayed")),  # transformers' Llama, its Linears swapped
    (GPU_HF, dict(recipe="delayed", te_layer="transformer_layer")),  # its decoder layers converted
], ids=["transformer_layer", "modules", "hf-swap", "hf-transformer_layer"])
def test_te_casts_its_fp8_weights_once_a_step_whatever_calls_its_modules(model, fields):
    """No model's forward passes is_first_microbatch; the hook gives it to TE's outermost modules, which then keep
    their FP8 weight casts between micro-batches (an unsplit step keeps none). The split's loss curve is the
    unsplit one within FP8's noise (H100: within 6.5e-3; each micro-batch's activations scale by their own amax)."""
    te = dict(backend="te", precision="fp8", **fields)
    whole, whole_casts = gpu_trained(model, batch_size=16, **te)
    split, split_casts = gpu_trained(model, batch_size=4, grad_accum=4, **te)
    assert whole_casts == 0 < split_casts
    assert split == pytest.approx(whole, abs=3e-2)
