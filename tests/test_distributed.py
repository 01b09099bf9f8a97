"""Multi-rank trials on CPU with gloo: one trial, two processes (torchrun), one record; DDP and FSDP2
give the one-process loss curve of the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.sweep import SweepError, parse_sweep
from trials import SpecError, TrialSpec, run_trial

from .conftest import REPO, _free_port, cli_env, juicytalk, wait_for

TINY = dict(d_model=32, n_layers=2, seq_len=32, train_steps=8, warmup_steps=1, bench_steps=3, gen_len=4, device="cpu",
            backend="torch", precision="fp32")
TOLERANCE = 1e-4  # fp32: DDP's all-reduce and FSDP2's reduce-scatter sum the same gradients in another order


def ranks_trial(tmp_path, name: str, **fields) -> dict:
    """Two ranks under torchrun, each ``python -m trials`` with the trial's flags (one process per rank, as on a
    GPU host); rank 0 writes the record."""
    out = tmp_path / f"{name}.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**TINY, **fields}.items()]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          f"--master-port={_free_port()}", "-m", "trials", *flags, "-q", "--json", str(out)],
                         capture_output=True, text=True, cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ddp_and_fsdp2_on_two_ranks_train_like_one_process_on_the_global_batch(tmp_path):
    one = run_trial(TrialSpec(batch_size=8, **TINY))  # in this process, on one thread (conftest), as a rank is
    ddp = ranks_trial(tmp_path, "ddp", batch_size=4, world_size=2, parallel="ddp")
    fsdp = ranks_trial(tmp_path, "fsdp", batch_size=4, world_size=2, parallel="fsdp")
    alone = run_trial(TrialSpec(batch_size=8, parallel="fsdp", **TINY))  # FSDP2 on a group of one
    for rec in (ddp, fsdp, alone):
        assert rec["status"] == "ok", rec["error"]
        assert rec["loss_curve"] == pytest.approx(one["loss_curve"], abs=TOLERANCE), rec["parallel"]
        # the timed steps' last loss too is the global batch's (the ranks' mean), not rank 0's rows' alone
        assert rec["bench_loss_final"] == pytest.approx(one["bench_loss_final"], abs=TOLERANCE), rec["parallel"]
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
    ({"precision": "fp8", "backend": "te", "recipe": "mxfp8", "fp8_all_gather": True, "parallel": "fsdp"},
     "fp8_all_gather"),
    ({"precision": "fp8", "backend": "torchao", "recipe": "rowwise", "fp8_all_gather": True, "parallel": "fsdp"},
     "fp8_all_gather"),
])
def test_multi_rank_settings_that_cannot_run_name_their_field(values, field):
    with pytest.raises(SpecError) as exc:
        TrialSpec(**values)
    assert exc.value.field == field, str(exc.value)


SHARD_CHECK = """
import pathlib, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
from trials.parallel.ranks import local_shard
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 7))  # 5 and 7 rows: uneven shards over 2 ranks
full = {k: v.detach().clone() for k, v in model.state_dict().items()}
for block in model:
    fully_shard(block)
fully_shard(model)
for name, p in model.named_parameters():
    mine = local_shard(full[name], p)
    assert mine.shape[0] < full[name].shape[0] and torch.equal(mine, p.to_local()), name
pathlib.Path(sys.argv[1], f"rank{dist.get_rank()}.ok").touch()  # a file each: the ranks share one stdout
"""


def test_a_whole_tensor_is_cut_as_fsdp2_cut_the_parameter(tmp_path):
    """TE's FP8-weight cells seed FusedAdam's masters, shard by shard, from the whole BF16 init: each
    rank's part must be the rows FSDP2 gave that rank's parameter (uneven shards included)."""
    script = tmp_path / "shard.py"
    script.write_text(SHARD_CHECK)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          f"--master-port={_free_port()}", str(script), str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == ["rank0.ok", "rank1.ok"]


def test_fp8_all_gather_is_accepted_where_a_stack_builds_it():
    """TE's FP8 primary weights (delayed, current, block) and torchao tensorwise; the spec says so, once."""
    for backend, recipe in (("te", "delayed"), ("te", "current"), ("te", "block"), ("torchao", "tensorwise")):
        spec = TrialSpec(precision="fp8", backend=backend, recipe=recipe, fp8_all_gather=True, parallel="fsdp")
        assert spec.fp8_all_gather


def test_a_sweep_cell_with_ranks_but_no_parallel_is_one_line():
    with pytest.raises(SweepError) as exc:
        parse_sweep(textwrap.dedent("""
            name: mg
            grid: {world_size: [1, 2]}
        """), source="s.yaml")
    assert exc.value.key == "grid.world_size" or exc.value.key.endswith("parallel"), str(exc.value)
    assert "parallel: ddp or fsdp" in str(exc.value)


def test_cpu_ranks_take_the_cpus_the_file_gives_each_so_two_fit_one_two_core_host():
    """Issue 31: world_size 2 with resources {cpu: 1} on one 2-core host was refused ("2 ranks need 4 CPUs"):
    each rank was widened to a whole node, as a one-rank CPU trial is. Ranks are not; one-rank trials still are."""
    from orchestrator.runner import SweepInputError, check_ranks, check_resources

    host = [{"Alive": True, "NodeID": "n0", "NodeManagerAddress": "127.0.0.1",  # ray.nodes() of a 2-core laptop
             "Resources": {"CPU": 2.0, "memory": 8e9, "object_store_memory": 1e9, "node:127.0.0.1": 1.0}},
            {"Alive": False, "NodeID": "n1", "NodeManagerAddress": "127.0.0.2", "Resources": {"CPU": 64.0}}]
    resources = check_resources(host, {"gpu": 1, "cpu": 1})  # the default resources, on a host without GPUs
    assert (resources["cpu"], resources["gpu"], resources["rank_cpu"]) == (2, 0, 1)  # a one-rank trial: the host
    assert check_ranks(host, [1, 2], resources) == 1  # both ranks at once, one such trial at a time
    with pytest.raises(SweepInputError) as exc:
        check_ranks(host, [2], check_resources(host, {"gpu": 0, "cpu": 2}))
    assert str(exc.value) == ("world_size: 2 ranks need 4 CPUs at once; this cluster has 2 (2 per rank); write "
                              "resources: {cpu: 1} (each rank's CPUs) or a smaller world_size")
    with pytest.raises(SweepInputError, match="this cluster has 2 .1 per rank.; write a world_size of at most 2$"):
        check_ranks(host, [4], resources)


def test_the_dry_run_says_when_this_machine_cannot_hold_a_cells_ranks(tmp_path, capsys, monkeypatch):
    """Issue 54.9: world_size 3 on a 2-CPU machine was refused only by the real sweep, after Ray had started (13 s);
    its dry run said nothing. The dry run now asks the real sweep's rule (runner.resources_refusal) of the local
    Ray's node, told before it starts (its CPUs, whatever this machine has: one rank more than fit)."""
    from orchestrator.cli import main
    from orchestrator.runner import local_nodes

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cpus = int(local_nodes()[0]["Resources"]["CPU"])
    path = tmp_path / "ranks.yaml"
    path.write_text(f"name: ranks\ngrid: {{world_size: [{cpus + 1}]}}\nfixed: {{d_model: 32, n_layers: 2, "
                    "seq_len: 32, batch_size: 4, backend: torch, parallel: ddp, device: cpu}\nresources: {cpu: 1}\n")
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"refused world_size: {cpus + 1} ranks need {cpus + 1} CPUs at once; this cluster has {cpus} " in said \
        and "a real sweep refuses it before any trial starts" in said, said


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_two_rank_cells_through_ray_train_one_record_each_even_when_a_rank_dies_or_stops(
        tmp_path, ray_cluster):
    """On the test cluster's two one-CPU nodes: each two-rank cell is one Tune trial holding nothing, its two
    Ray Train workers a CPU each, gloo between them; one record per cell. Of three cells, one is left alone,
    one loses a rank to SIGKILL mid-trial (error), one has a rank stopped with SIGSTOP, so the other
    rank's collective times out after trial_timeout_s (timeout: that rank writes its record and fails the run,
    the path a rank's OOM takes too; which record wins is test_a_failed_multi_rank_trial_keeps_its_root_cause's);
    afterwards no rank process is left and the sweep went on. world_size 4 cannot fit: one line, exit 2. (A
    fourth cell, too large for a rank's memory, cost ~35 s of the suite's 2-core time: a Ray Train start.)"""
    sweep = tmp_path / "mg.yaml"
    body = """
        name: {name}
        grid:
          - {{world_size: [{world}], parallel: [ddp], d_model: [32, 40, 48]}}
        fixed: {{n_layers: 2, seq_len: 32, batch_size: 4, train_steps: 200, warmup_steps: 1, bench_steps: 3,
                gen_len: 4, backend: torch, precision: fp32, profile: false}}
        resources: {{cpu: 1, gpu: 0}}
        trial_timeout_s: 12
    """
    sweep.write_text(textwrap.dedent(body.format(name="mg", world=2)))
    env = cli_env(RAY_ADDRESS=ray_cluster, OMP_NUM_THREADS="1")
    running = tmp_path / "out" / "mg" / "running"
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(sweep), "--out",
                               str(tmp_path / "out"), "--no-progress", "--no-report"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    actions, acted, ranks = [None, signal.SIGKILL, signal.SIGSTOP], {}, set()
    deadline = time.time() + 600  # a slow 2-core host under the suite: ~40-80 s a cell, the stopped one 12 s more
    while driver.poll() is None and time.time() < deadline:
        keys = [m.stem for m in running.glob("*.json")] if running.exists() else []
        # mid-trial: both ranks of the running trial have started their trial (each wrote its pid file)
        pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "out" / "mg" / "ray" / "train").glob(
            f"{keys[0]}-*.rank*.pid.json")] if len(keys) == 1 and keys[0] not in acted else []
        if len(pids) == 2:
            ranks.update(pids)
            time.sleep(0.5)
            action = actions[len(acted)] if len(acted) < len(actions) else None
            acted[keys[0]] = action
            if action is not None:
                os.kill(max(pids), action)
        time.sleep(0.1)
    out, err = driver.communicate(timeout=120)
    assert driver.returncode == 1 and "3 trials: 0 already done, 3 run now, 2 failed, 0 missing" in out, (
        out[-3000:] + err[-3000:])  # exit 1: the sweep ended, with failed trials (error, timeout)
    import pyarrow.parquet as pq

    records = {p.stem: pq.read_table(p).to_pylist()[0] for p in (tmp_path / "out" / "mg" / "trials").glob("*.parquet")}
    assert len(records) == 3 and len(acted) == 3, (sorted(records), acted)
    status = {action: records[key]["status"] for key, action in acted.items()}
    assert status == {None: "ok", signal.SIGKILL: "error", signal.SIGSTOP: "timeout"}, (
        status, {k: r["error"] for k, r in records.items()})
    ok = records[next(k for k, a in acted.items() if a is None)]
    assert ok["world_size"] == 2 and ok["parallel"] == "ddp" and ok["tokens_per_step"] == 2 * 4 * 32
    assert ok["kernel_ms_comm"] is None or ok["kernel_ms_comm"] >= 0
    wait_for(lambda: not [pid for pid in ranks if _alive(pid)], timeout=30)  # no rank process is left
    sweep.write_text(textwrap.dedent(body.format(name="mg4", world=4)))
    big = juicytalk("sweep", str(sweep), "--out", str(tmp_path / "out"), "--no-progress", env=env)
    assert big.returncode == 2 and "world_size: 4 ranks need 4 CPUs at once; this cluster has 2" in big.stderr
    assert not (tmp_path / "out" / "mg4" / "trials").exists() or not list((tmp_path / "out" / "mg4" / "trials").iterdir())


def test_a_failed_multi_rank_trial_keeps_its_root_cause():
    """Rank 0's record when it is ok; a rank's final status (OOM, divergence, unsupported: the sweep keeps it and
    does not rerun the cell) over rank 0's timeout or error (its collective waited on that rank); else rank 0's."""
    from orchestrator.launchers.ranks import one_record

    ok, timeout = {"status": "ok", "error": None}, {"status": "timeout", "error": "Timed out waiting 12000ms"}
    oom = {"status": "oom", "error": "CUDA out of memory"}
    assert one_record({0: ok}) is ok and one_record({}) is None
    assert one_record({0: timeout, 1: oom}) == {"status": "oom", "error": "rank 1: CUDA out of memory"}
    assert one_record({0: timeout, 1: {"status": "error", "error": "closed by peer"}}) is timeout
    assert one_record({1: {"status": "error", "error": "closed by peer"}})["error"] == "rank 1: closed by peer"
    for status in ("diverged", "unsupported"):
        final = {"status": status, "error": "why"}
        assert one_record({0: timeout, 1: final}) == {"status": status, "error": "rank 1: why"}
        assert one_record({0: {"status": "error", "error": "closed by peer"}, 2: final})["status"] == status
    assert one_record({0: {**oom}, 1: {"status": "diverged", "error": "nan"}}) == oom  # rank 0's own comes first
