"""The memory plan (trials/measure/memory_plan.py) against what a CPU step measures, and the dry run's estimates from the
module (issue 45 item 3, issue 44 item 5). Tiny shapes: a plan is one forward under fake tensors."""

from __future__ import annotations

import functools

import pytest
import torch

from trials import TrialSpec
from trials.measure import memory_plan
from trials.parallel.checkpointing import SavedBytes

pytest.importorskip("transformers")

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, vocab=96, seq_len=32, batch_size=8, backend="torch", device="cpu")
GPTLIKE = "py:tests/fixtures/gptlike.py:build"


def _trial_saved_bytes(spec: TrialSpec) -> int:
    """What a trial records as ``saved_activation_bytes``: the bytes its first training step on CPU (forward, the
    trial's fp32 loss, backward) keeps for backward, counted by the trial's own ``train``."""
    from trials.workloads.data import ArithmeticSequences
    from trials.workloads.train_step import build_train_step, train

    step = build_train_step(spec, "torch", spec.precision, "cpu")
    data = ArithmeticSequences(spec.vocab, spec.seq_len, "cpu", spec.seed)
    return train(step, data, 1, spec.batch_size).saved_bytes


@pytest.mark.parametrize("model, extra", [("minigpt", {}), ("minigpt", {"arch": "llama", "precision": "fp32"}),
                                          ("hf:llama", {"ffn": 128}), (GPTLIKE, {})])
@pytest.mark.parametrize("vocab", [96, 2048])
def test_the_records_activation_estimate_is_what_its_step_saves(model, extra, vocab):
    """Issue 54.1: ``est_activation_bytes`` is ``saved_activation_bytes`` on CPU, to the byte, for every source, vocab
    and checkpointing setting: the plan and the step see the same storages (fake CPU tensors take the CPU kernels'
    choices). The loss's fp32 log-softmax is most of it at a large vocabulary (at 32000, 31 MiB of 32 MiB): the plan
    once left it out and estimated 1.1 MiB. Under checkpointing a unit keeps all it is handed: a transformers layer's
    position ids and RoPE's cos and sin besides its hidden state, counted once (the plan once took the first only)."""
    for setting in ("none", "selective", "full"):
        spec = TrialSpec(model=model, **{**SHAPE, "n_layers": 3, "vocab": vocab, **extra},
                         activation_checkpointing=setting)
        est = memory_plan.record_fields(spec)["est_activation_bytes"]
        assert est == _trial_saved_bytes(spec), setting


def test_full_checkpointing_keeps_what_torch_checkpoint_keeps():
    """Held after the forward and the loss with every unit under torch.utils.checkpoint: the units' inputs and what
    lies outside them, as the plan says; fewer bytes than without, and selective in between."""
    from torch.utils.checkpoint import checkpoint

    from trials import models
    from trials.workloads.loss import next_token_loss

    spec = TrialSpec(model="minigpt", **SHAPE)
    acts = memory_plan.probe(spec).activations
    built = models.build(spec, "bf16", "cpu")
    model = built.model
    for name in built.units:
        unit = model.get_submodule(name)
        unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    ids = torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long)
    with SavedBytes(model) as saved:
        next_token_loss(model(ids), torch.zeros_like(ids))
    assert acts.held("full") == saved.bytes
    assert acts.held("full") < acts.held("selective") < acts.held("none")
    largest = max(sum(unit.values()) for unit in acts.units)
    assert acts.peak("full") == acts.held("full") + largest
    # the plan's (and the record's) activations are the held bytes, the measured saved_activation_bytes' partner;
    # the recomputed unit's bytes count in the total only
    full = memory_plan.plan(spec, "full")
    assert full.activations == acts.held("full") and full.recomputed == largest
    assert full.total == full.weights + full.optimizer + max(acts.peak("full") + full.logits, full.grads)
    fields = memory_plan.record_fields(TrialSpec(model="minigpt", **SHAPE, activation_checkpointing="full"))
    assert fields["est_activation_bytes"] == acts.held("full")


def test_a_factory_is_priced_from_its_module_not_as_llama():
    """Issue 44.5: a nanoGPT-shaped factory's estimate is its own (that of MiniGPT gpt, the same network), not
    hf:llama's of the same shape fields."""
    from orchestrator.plan import estimate_flops_guess

    shape = {**SHAPE, "d_model": 128, "ffn": 512, "seq_len": 64}
    flops = {m: estimate_flops_guess(TrialSpec(model=m, **shape)) for m in ("minigpt", GPTLIKE, "hf:llama")}
    assert not any(guess for _, guess in flops.values())
    assert flops[GPTLIKE][0] == pytest.approx(flops["minigpt"][0], rel=0.01)  # the same GEMMs (nanoGPT's head is tied)
    assert abs(flops[GPTLIKE][0] / flops["hf:llama"][0] - 1) > 0.2  # SwiGLU's three matrices, not nanoGPT's two
    mem = {m: memory_plan.plan(TrialSpec(model=m, **shape)).total for m in (GPTLIKE, "hf:llama")}
    assert mem[GPTLIKE] != mem["hf:llama"]


def test_a_cell_that_does_not_fit_names_the_cheapest_setting_that_does(tmp_path):
    from orchestrator.plan import expected_ooms, plan_rows
    from orchestrator.store import Store
    from orchestrator.sweep import Sweep, load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("name: fit\ngrid: {d_model: [256]}\nfixed: {n_layers: 4, seq_len: 512, batch_size: 16, vocab: 96, "
                    "backend: torch, device: cuda}\n")
    s: Sweep = load_sweep(path)
    spec = s.cells[0].spec
    limit = (memory_plan.plan(spec, "full").total + memory_plan.plan(spec, "selective").total) // 2
    rows = plan_rows(s, Store(str(tmp_path), s.name))
    [line] = expected_ooms(rows, limit)
    assert "fits with activation_checkpointing full, 1 GPU" in line, line
    [line] = expected_ooms(rows, memory_plan.plan(spec, "full", "fsdp", 4, 4).total)  # the global batch, 4 ranks
    assert "fits with activation_checkpointing" in line and "parallel fsdp, world_size 4, batch_size 4 per rank" \
        in line, line


def test_a_sweep_refuses_a_cell_far_over_the_gpu_memory_before_anything_starts(tmp_path, capsys):
    """Over ``FIT_MARGIN`` (1.4) x the GPU's memory, beyond the plan's measured error: a real sweep exits 2 with one
    line naming the cell, its estimate, the memory and the dry run's cheapest setting that fits; no results directory
    (nor Ray: it is never imported). ``--no-fit-check`` lets it through: its dry run says only 'expected OOM'."""
    from orchestrator.cli import main

    from .conftest import juicytalk, user_env

    path = tmp_path / "big.yaml"  # 404M parameters: an estimated 6.3 GiB per rank, planned from the module
    path.write_text("name: big\ngrid: {d_model: [2048]}\nfixed: {n_layers: 8, backend: torch}\n")
    dry = ["sweep", str(path), "--gpu-memory", "1", "--dry-run", "--out", str(tmp_path / "out")]
    assert main(dry) == 0
    said = capsys.readouterr().out
    assert "will not fit d2048-L8-torch-bf16" in said and "a real sweep refuses it" in said, said
    assert main([*dry, "--no-fit-check"]) == 0
    said = capsys.readouterr().out
    assert "expected OOM d2048-L8-torch-bf16: estimated" in said and "will not fit" not in said, said

    out = juicytalk("sweep", str(path), "--gpu-memory", "1", "--out", str(tmp_path / "out"),
                    env=user_env(tmp_path / "home"), timeout=300)
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("juicytalk: error: d2048-L8-torch-bf16: estimated ") and "GiB > 1 GiB of GPU memory; fits " \
        "with activation_checkpointing full, parallel fsdp, world_size 4" in line and "--no-fit-check" in line, line
    assert out.stdout == "" and not (tmp_path / "out").exists()


# MiniGPT at d_model 65536, 8 layers: an estimated 3.0 TiB, over any host's RAM (planned in seconds: fake tensors)
HUGE = "name: huge\ngrid: {d_model: [65536]}\nfixed: {n_layers: 8, backend: torch, device: cpu}\n"


def test_a_cpu_cell_over_the_hosts_memory_is_refused_before_anything_starts(tmp_path, capsys):
    """Issue 54.3: a CPU cell the plan puts over the host's RAM was run and killed by the kernel's OOM killer (exit
    137, no record, other processes at risk). ``juicytalk trial`` and a real sweep refuse it in one line, exit 2,
    before anything is allocated (no results directory, no Ray); the dry run says it will not fit;
    ``--no-fit-check`` lets it through (the dry run then says only 'expected OOM')."""
    from orchestrator.cli import main

    from .conftest import juicytalk, user_env

    path = tmp_path / "huge.yaml"
    path.write_text(HUGE)
    dry = ["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]
    assert main(dry) == 0
    said = capsys.readouterr().out
    assert "will not fit d65536-L8-torch-bf16" in said and " GiB of host memory: more than the host's RAM" in said \
        and "a real sweep refuses it" in said, said
    assert main([*dry, "--no-fit-check"]) == 0
    said = capsys.readouterr().out
    assert "expected OOM d65536-L8-torch-bf16" in said and "will not fit" not in said, said

    env = user_env(tmp_path / "home")
    for command in (("sweep", str(path), "--out", str(tmp_path / "out")),
                    ("trial", "--d-model", "65536", "--n-layers", "8", "--backend", "torch", "--device", "cpu")):
        out = juicytalk(*command, env=env, timeout=300)
        assert out.returncode == 2, out.stderr
        [line] = out.stderr.strip().splitlines()
        assert f"juicytalk{' trial' if command[0] == 'trial' else ''}: error: d65536-L8-torch-bf16" in line and \
            " GiB of host memory: " in line and line.endswith("--no-fit-check runs it anyway"), line
        assert out.stdout == ""
    assert not (tmp_path / "out").exists()


def test_the_ranks_of_a_cell_share_its_hosts_memory(tmp_path):
    """Issue 54.2: a multi-rank cell's ranks run on one host: their estimates together are held against its RAM
    (one rank's alone was, though two ranks need twice it)."""
    from orchestrator.plan import expected_ooms, plan_rows, will_not_fit
    from orchestrator.store import Store
    from orchestrator.sweep import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("name: ranks\ngrid: {world_size: [2]}\nfixed: {d_model: 64, n_layers: 2, n_heads: 4, vocab: 96, "
                    "seq_len: 32, batch_size: 8, backend: torch, parallel: ddp, device: cpu}\n")
    s = load_sweep(path)
    [row] = plan_rows(s, Store(str(tmp_path), s.name), cpu_here=True)
    one = memory_plan.plan(s.cells[0].spec).total
    host = one * 3 // 2  # room for one rank, not for two
    assert row["est_mem_bytes"] == one and row["est_host_bytes"] == 2 * one
    [line] = expected_ooms([row], None, host)
    assert "estimated 2 ranks x " in line and "(they share the host)" in line and "of host memory" in line, line
    assert will_not_fit([row], None, host) == [row] and will_not_fit([row], None, 2 * one) == []


def test_gpu_memory_given_on_a_machine_without_a_gpu_keeps_the_cpu_warnings(tmp_path, capsys):
    """Issue 54.16: ``--gpu-memory`` on a CPU-only machine (its ``device: auto`` cells run on CPU) hid the dry run's
    slow-on-CPU and host-memory lines: they come as without it. The same cell on TE is recorded unsupported here,
    never run: neither the dry run nor a real sweep refuses it."""
    from orchestrator.cli import main
    from orchestrator.plan import local_gpu_memory_bytes

    if local_gpu_memory_bytes() is not None:
        pytest.skip("needs a machine without a GPU")
    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\ngrid: {d_model: [65536], backend: [torch, te]}\nfixed: {n_layers: 8}\n")
    run = ["sweep", str(path), "--gpu-memory", "1e9", "--out", str(tmp_path / "out")]
    assert main([*run, "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "slow on CPU d65536-L8-torch-bf16" in said and "will not fit d65536-L8-torch-bf16" in said and \
        " GiB of host memory" in said and "unsupported here d65536-L8-te-bf16" in said, said
    assert "will not fit d65536-L8-te" not in said, said
    assert main(run) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("juicytalk: error: d65536-L8-torch-bf16: ") and "more cell" not in line, line
    assert not (tmp_path / "out").exists()


def test_fsdp_shards_weights_grads_and_optimizer_per_rank():
    """Every parameter sharded; two units gathered whole; the root's own parameters (outside the units: embeddings,
    final norm, head) whole too, since FSDP2 does not reshard the root after forward; grads stay sharded."""
    from trials import models

    spec = TrialSpec(model="minigpt", **SHAPE)
    one, four = memory_plan.plan(spec), memory_plan.plan(spec, parallel="fsdp", world_size=4)
    assert four.optimizer == one.optimizer // 4 and four.grads == one.grads // 4
    got = memory_plan.probe(spec)
    gathered = 2 * got.largest_unit_params * 2  # two bf16 units whole: running and prefetched
    built = models.build(spec, "bf16", "meta")
    inside = {id(p) for u in built.units for p in built.model.get_submodule(u).parameters()}
    root = sum(p.numel() * 2 for p in built.model.parameters() if id(p) not in inside)
    assert root > 0 and got.outside_weight_bytes == root
    assert four.weights == one.weights // 4 + root + gathered and four.activations == one.activations  # per rank


def test_a_guessed_fsdp_plan_is_smaller_than_the_unsharded_one():
    """A guess knows no unit's size: one layer's share of the parameters is gathered, not the whole model."""
    spec = TrialSpec(model=f"{GPTLIKE[:-len('build')]}reads_ids", **{**SHAPE, "n_layers": 8})
    one, four = memory_plan.plan(spec), memory_plan.plan(spec, parallel="fsdp", world_size=4)
    assert one.guess and four.guess and one.weights > 0
    layer = one.weights // 2 // 8  # parameters over the layers, bf16
    assert four.weights == one.weights // 4 + 2 * layer * 2 < one.weights


def test_a_module_fake_tensors_cannot_run_is_called_a_guess(tmp_path):
    """A forward that reads its ids' values cannot run under fake tensors: the dry run says its numbers are a guess
    (6 x parameters per token; weights and optimizer state only) instead of passing them off as the module's."""
    from orchestrator.plan import plan_rows, plan_table, slow_on_cpu
    from orchestrator.store import Store
    from orchestrator.sweep import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("name: guess\ngrid: {model: ['py:tests/fixtures/gptlike.py:reads_ids']}\n"
                    "fixed: {d_model: 64, n_layers: 2, vocab: 96, seq_len: 32, batch_size: 8, backend: torch}\n")
    s = load_sweep(path)
    [row] = plan_rows(s, Store(str(tmp_path), s.name), cpu_here=True)
    assert row["mem_guess"] and row["flops_guess"]
    assert "(guess)" in "".join(str(c) for col in plan_table(s, [row]).columns for c in col._cells)
    [line] = slow_on_cpu([row], flops_per_s=1.0)
    assert "a guess" in line


def test_an_fp32_moe_cell_is_planned_from_its_module_and_a_guess_says_why(tmp_path, capfd):
    """Issue 54.7: torch's meta kernel for grouped GEMMs takes BF16 only, so an fp32 MoE cell's dry run logged a torch
    traceback and its estimate was silently a guess. It is planned from its module now, to the byte of what its CPU
    step saves; a module that cannot be planned says why, in one line of the dry run."""
    from orchestrator.cli import main

    spec = TrialSpec(model="hf:mixtral", **{**SHAPE, "ffn": 128, "precision": "fp32"})
    assert memory_plan.record_fields(spec)["est_activation_bytes"] == _trial_saved_bytes(spec)
    path = tmp_path / "moe.yaml"
    path.write_text("name: moe\ngrid: {model: ['hf:mixtral', 'py:tests/fixtures/gptlike.py:reads_ids']}\n"
                    "fixed: {d_model: 64, n_layers: 2, n_heads: 4, ffn: 128, vocab: 96, seq_len: 32, batch_size: 8, "
                    "precision: fp32, backend: torch}\n")
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err
    [line] = [line for line in out.splitlines() if line.startswith("a guess ")]
    assert "reads_ids" in line and "does not run under fake tensors (" in line, line


@pytest.mark.gpu
def test_the_local_gpu_memory_is_read_without_a_cuda_context():
    """The fit check runs in the driver before Ray: reading the GPU's memory must not start CUDA there (a context on
    GPU 0 is another compute process to every trial on it: disturbed). A fresh process: CUDA stays uninitialised.
    What it reads is NVML's total, the board's; CUDA's (torch's total_memory) is smaller by what the driver keeps
    for itself (they differed on the H200), far less than the 2% allowed here, let alone the fit check's 1.4x."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = ("import torch; from orchestrator.plan import local_gpu_memory_bytes as m; got = m(); "
            "print(torch.cuda.is_initialized(), got, torch.cuda.get_device_properties(0).total_memory)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    initialised, nvml_total, cuda_total = out.stdout.split()
    assert initialised == "False", out
    nvml_total, cuda_total = int(nvml_total), int(cuda_total)
    assert abs(nvml_total - cuda_total) <= 0.02 * cuda_total, \
        f"NVML {nvml_total / 2**20:.0f} MiB, CUDA {cuda_total / 2**20:.0f} MiB"
    print(f"\nNVML total {nvml_total / 2**20:.0f} MiB, CUDA's {cuda_total / 2**20:.0f} MiB")
