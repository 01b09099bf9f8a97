"""Multi-rank trials on CPU with gloo: one trial, two processes (torchrun), one record; DDP and FSDP2
give the one-process loss curve of the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from orchestrator.sweep import SweepError, parse_sweep
from trials import SpecError, TrialSpec

from .conftest import REPO, _free_port, cli_env

TINY = ["--d-model", "32", "--n-layers", "2", "--seq-len", "32", "--train-steps", "8", "--warmup-steps", "1",
        "--bench-steps", "3", "--gen-len", "4", "--device", "cpu", "--backend", "torch", "--precision", "fp32", "-q"]
TOLERANCE = 1e-4  # fp32: DDP's all-reduce and FSDP2's reduce-scatter sum the same gradients in another order


def trial(tmp_path, name: str, *args: str, ranks: int = 1) -> dict:
    out = tmp_path / f"{name}.json"
    launch = [sys.executable, "-m", "trials"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={_free_port()}",
        "-m", "trials"]
    run = subprocess.run([*launch, *TINY, *args, "--json", str(out)], capture_output=True, text=True, cwd=REPO,
                         env=cli_env(OMP_NUM_THREADS="1"), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_ddp_and_fsdp2_on_two_ranks_train_like_one_process_on_the_global_batch(tmp_path):
    one = trial(tmp_path, "one", "--batch-size", "8")
    ddp = trial(tmp_path, "ddp", "--batch-size", "4", "--world-size", "2", "--parallel", "ddp", ranks=2)
    fsdp = trial(tmp_path, "fsdp", "--batch-size", "4", "--world-size", "2", "--parallel", "fsdp", ranks=2)
    alone = trial(tmp_path, "fsdp1", "--batch-size", "8", "--parallel", "fsdp")  # FSDP2 on a group of one
    for rec in (ddp, fsdp, alone):
        assert rec["status"] == "ok", rec["error"]
        assert rec["loss_curve"] == pytest.approx(one["loss_curve"], abs=TOLERANCE), rec["parallel"]
        assert rec["tokens_per_step"] == one["tokens_per_step"] == 8 * 32 and rec["interconnect"] == "same host"
    for rec in (ddp, fsdp):
        assert rec["world_size"] == 2 and rec["tokens_per_s_per_gpu"] == pytest.approx(rec["tokens_per_s"] / 2)
        assert rec["kernel_ms_comm"] > 0  # gloo's collectives, in the breakdown
    assert one["kernel_ms_comm"] == 0


@pytest.mark.parametrize("values, field", [
    ({"world_size": 2}, "parallel"),
    ({"parallel": "zero3"}, "parallel"),
    ({"parallel": "ddp", "workload": "infer"}, "parallel"),
    ({"parallel": "ddp", "cuda_graphs": True}, "cuda_graphs"),
    ({"precision": "fp8", "fp8_all_gather": True, "parallel": "ddp"}, "fp8_all_gather"),
    ({"precision": "fp8", "backend": "te", "fp8_all_gather": True, "parallel": "fsdp"}, "fp8_all_gather"),
    ({"precision": "fp8", "backend": "torchao", "recipe": "rowwise", "fp8_all_gather": True, "parallel": "fsdp"},
     "fp8_all_gather"),
])
def test_multi_rank_settings_that_cannot_run_name_their_field(values, field):
    with pytest.raises(SpecError) as exc:
        TrialSpec(**values)
    assert exc.value.field == field, str(exc.value)


def test_a_sweep_with_world_size_2_is_refused_in_one_line_before_ray_starts():
    text = textwrap.dedent("""
        name: mg
        grid: {world_size: [1, 2], parallel: [ddp]}
    """)
    with pytest.raises(SweepError) as exc:
        parse_sweep(text, source="s.yaml")
    assert exc.value.key == "grid.world_size" and exc.value.line == 3 and "torchrun" in str(exc.value)
    assert TrialSpec(parallel="fsdp").world_size == 1  # world_size 1 with FSDP2 is a cell a sweep runs
