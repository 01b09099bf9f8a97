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

from .conftest import REPO, _free_port, cli_env, juicytalk

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


def test_a_sweep_cell_with_ranks_but_no_parallel_is_one_line():
    with pytest.raises(SweepError) as exc:
        parse_sweep(textwrap.dedent("""
            name: mg
            grid: {world_size: [1, 2]}
        """), source="s.yaml")
    assert exc.value.key == "grid.world_size" or exc.value.key.endswith("parallel"), str(exc.value)
    assert "parallel: ddp or fsdp" in str(exc.value)


def test_a_two_rank_cell_runs_through_ray_train_inside_its_tune_trial(tmp_path, ray_cluster):
    """On the test cluster's two one-CPU nodes: the Tune trial holds nothing, its two Ray Train workers a CPU
    each (one per node), gloo between them; one record. world_size 4 cannot fit: one line, exit 2."""
    sweep = tmp_path / "mg.yaml"
    body = """
        name: {name}
        grid: {{world_size: [{world}], parallel: [ddp]}}
        fixed: {{d_model: 32, n_layers: 2, seq_len: 32, batch_size: 4, train_steps: 8, warmup_steps: 1, bench_steps: 3,
                gen_len: 4, backend: torch, precision: fp32}}
        resources: {{cpu: 1, gpu: 0}}
    """
    sweep.write_text(textwrap.dedent(body.format(name="mg", world=2)))
    env = cli_env(RAY_ADDRESS=ray_cluster, OMP_NUM_THREADS="1")
    run = juicytalk("sweep", str(sweep), "--out", str(tmp_path / "out"), "--no-progress", "--no-report", env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = list((tmp_path / "out" / "mg" / "trials").glob("*.parquet"))
    assert len(records) == 1
    import pyarrow.parquet as pq

    rec = pq.read_table(records[0]).to_pylist()[0]
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["parallel"] == "ddp", rec["error"]
    assert rec["tokens_per_step"] == 2 * 4 * 32 and rec["kernel_ms_comm"] > 0
    sweep.write_text(textwrap.dedent(body.format(name="mg4", world=4)))
    big = juicytalk("sweep", str(sweep), "--out", str(tmp_path / "out"), "--no-progress", env=env)
    assert big.returncode == 2 and "world_size: 4 ranks need 4 CPUs at once; this cluster has 2" in big.stderr
    assert not (tmp_path / "out" / "mg4" / "trials").exists() or not list((tmp_path / "out" / "mg4" / "trials").iterdir())
