"""The rules a multi-rank trial lives by, checked without Ray or a worker group: what its ranks ask of the cluster
and whether the cluster can give it, where each rank writes on the sweep's storage, how the ranks' timing readings
become the record's, and that a rank whose measuring fails still runs the steps its peers' collectives wait on."""

from __future__ import annotations

import json

import pytest

from orchestrator.launchers.ranks import RANKS_DRIVER_CPU, pid_path, rank_cpu, record_path
from orchestrator.runner import SweepInputError, check_ranks, check_resources


def node(ip: str, cpu: float, gpu: float = 0) -> dict:
    """One alive node as ``ray.nodes()`` lists it."""
    return {"Alive": True, "NodeID": ip, "NodeManagerAddress": ip,
            "Resources": {"CPU": float(cpu), "GPU": float(gpu), "memory": 1e11, f"node:{ip}": 1.0}}


def test_gpu_ranks_and_their_trial_fit_the_node_the_check_passed():
    """One node of 8 GPUs and 128 CPUs, {gpu: 1, cpu: 16} per rank, world_size 8: the check passes, so the 8 ranks
    and the trial's own sliver must fit its CPUs (8 x 16 + 0.01 never did: the worker group waited for ever)."""
    host = [node("10.0.0.1", 128, 8)]
    resources = check_resources(host, {"gpu": 1, "cpu": 16})
    assert check_ranks(host, [8], resources) == 1
    assert 8 * rank_cpu(resources) + RANKS_DRIVER_CPU <= 128
    assert rank_cpu(resources) > 0
    cpu_only = check_resources([node("10.0.0.2", 2)], {"gpu": 0, "cpu": 1})  # gloo ranks: the same rule
    assert 2 * rank_cpu(cpu_only) + RANKS_DRIVER_CPU <= 2


def test_a_node_holds_as_many_gpu_ranks_as_its_cpus_allow():
    """A rank's GPU and CPUs are on one node: a node's rank slots are min(GPUs, CPUs // rank_cpu), for the refusal
    and for how many multi-rank trials run at once."""
    short = [node("10.0.0.1", 100, 8)]
    resources = check_resources(short, {"gpu": 1, "cpu": 16})
    with pytest.raises(SweepInputError) as exc:
        check_ranks(short, [8], resources)
    assert str(exc.value) == ("world_size: 8 ranks need 8 GPUs with 16 CPUs each at once (a rank's GPU and CPUs on "
                              "one node); this cluster has room for 6; write resources: {cpu: 12} (each rank's CPUs) "
                              "or a smaller world_size")
    assert check_ranks(short, [6], resources) == 1
    wide = [node("10.0.0.1", 128, 8)]  # 4 ranks of 32 CPUs: the node's CPUs hold one such trial, not two
    assert check_ranks(wide, [4], check_resources(wide, {"gpu": 1, "cpu": 32})) == 1
    assert check_ranks(wide, [4], check_resources(wide, {"gpu": 1, "cpu": 16})) == 2
    two = [node("10.0.0.1", 16, 8), node("10.0.0.2", 128, 8)]  # ranks spread over nodes; each node counts its own
    assert check_ranks(two, [4], check_resources(two, {"gpu": 1, "cpu": 16})) == 2
    with pytest.raises(SweepInputError, match=r"^world_size: 4 ranks need 4 GPUs at once; this cluster has 2 \(1 per "
                                              r"rank\); write a smaller world_size \(at most 2\)$"):
        check_ranks([node("10.0.0.3", 64, 2)], [4], {"gpu": 1, "cpu": 16, "rank_cpu": 16})


def test_cpu_ranks_are_counted_per_node():
    """Two 3-CPU nodes hold 6 CPUs, but only two ranks of 2 CPUs: a third would straddle them."""
    nodes = [node("10.0.0.1", 3), node("10.0.0.2", 3)]
    resources = check_resources(nodes, {"gpu": 0, "cpu": 2})
    assert check_ranks(nodes, [2], resources) == 1
    with pytest.raises(SweepInputError) as exc:
        check_ranks(nodes, [3], resources)
    assert str(exc.value) == ("world_size: 3 ranks need 6 CPUs at once; this cluster has 6 (2 per rank, room for 2 "
                              "ranks: a rank's CPUs are on one node); write resources: {cpu: 1} (each rank's CPUs) or "
                              "a smaller world_size")


@pytest.mark.parametrize("storage", ["/sweeps/s/ray/train", "/sweeps/s/ray/train/",
                                     "s3://bucket/sweeps/s/ray/train?endpoint_override=http%3A%2F%2F127.0.0.1%3A9000"])
def test_each_rank_writes_its_own_file_beside_the_run_a_storage_query_kept_last(storage):
    """A storage URI keeps its query (``store.url``: ``?endpoint_override=...``); a rank's file goes before it,
    else every rank's path is one object's."""
    head, sep, query = storage.partition("?")
    for path in (record_path, pid_path):
        paths = {path(storage, "cell-1", rank) for rank in range(2)}
        assert len(paths) == 2
        for rank in range(2):
            got = path(storage, "cell-1", rank)
            assert got.startswith(head.rstrip("/") + "/cell-1.rank" + str(rank)) and got.endswith(sep + query)
            assert got.partition("?")[0].endswith(".json")


def test_the_ranks_timing_readings_become_one():
    """Step times are the slowest rank's, so what disturbed any rank disturbed them: the flag is any rank's, the
    reasons and other processes every rank's, the shares and GC pauses the largest."""
    from trials.parallel.ranks import merged_timing

    quiet = {"timing_wait_share": 0.01, "timing_foreign_cpu_share": 0.1, "timing_load_1m": 1.0,
             "timing_foreign_gpu_processes": "[]", "timing_disturbed": False, "timing_disturbed_why": None,
             "timing_gc_ms_per_step": 0.5, "timing_gc_full_collections": 0}
    busy = {**quiet, "timing_wait_share": 0.4, "timing_load_1m": 3.0, "timing_gc_ms_per_step": 2.5,
            "timing_gc_full_collections": 1, "timing_foreign_gpu_processes": json.dumps([{"pid": 7, "used_bytes": 9}]),
            "timing_disturbed": True, "timing_disturbed_why": "1 other process(es) on the GPU (0 MiB)"}
    assert merged_timing([quiet]) == quiet
    merged = merged_timing([quiet, busy])
    assert merged["timing_disturbed"] is True
    assert merged["timing_disturbed_why"] == "rank 1: 1 other process(es) on the GPU (0 MiB)"
    assert json.loads(merged["timing_foreign_gpu_processes"]) == [{"pid": 7, "used_bytes": 9, "rank": 1}]
    assert (merged["timing_wait_share"], merged["timing_load_1m"]) == (0.4, 3.0)
    assert (merged["timing_gc_ms_per_step"], merged["timing_gc_full_collections"]) == (2.5, 1)
    assert merged["timing_foreign_cpu_share"] == 0.1
    assert merged_timing([quiet, quiet])["timing_disturbed"] is False
    unknown = {**quiet, "timing_disturbed": None, "timing_wait_share": None, "timing_foreign_gpu_processes": None}
    assert merged_timing([unknown, quiet])["timing_disturbed"] is None  # quiet only where every rank could tell
    assert merged_timing([unknown, quiet])["timing_foreign_gpu_processes"] is None  # not "none seen"
    assert merged_timing([unknown, busy])["timing_disturbed"] is True
    both_unknown = merged_timing([unknown, unknown])
    assert both_unknown["timing_foreign_gpu_processes"] is None and both_unknown["timing_wait_share"] is None


class Steps:
    """A step that only counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_rank_without_an_energy_counter_still_runs_the_windows_steps():
    """Every rank runs the window's steps (its peers' collectives wait on them); one that cannot read its counter
    (here: a CUDA trial where NVML cannot start) skips the reading only, and says why."""
    from trials.measure import energy, nvml

    with nvml.session() as nv:
        if nv is not None:
            pytest.skip("NVML starts here: this checks a host without it")
    steps = Steps()
    window = energy.measure(steps, 7, "cuda")
    assert steps.calls == 7
    assert window.why and window.drawn() is None and window.fields(64) == {"energy_why": window.why}
    cpu = Steps()
    assert energy.measure(cpu, 7, "cpu").why and cpu.calls == 0  # a CPU trial's ranks all skip the window alike


def test_a_profiler_that_fails_to_start_still_runs_the_profiled_steps():
    """The kernel breakdown's steps run on every rank though the profiler failed before any (here: a CUDA profile
    on a host without CUDA), with the baseline's too; the record says why it has no breakdown."""
    import torch

    from trials.measure import kernels

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: this checks a profiler that cannot start")
    run, baseline = Steps(), Steps()
    fields = kernels.breakdown_fields(True, run, "cuda", 1.0, baseline=baseline, per=2)
    assert fields["breakdown_why"].startswith("profiler: ")
    assert run.calls == baseline.calls == kernels.DEFAULT_STEPS


def test_a_step_that_fails_under_the_profiler_is_not_run_again():
    """A step's own failure is the cell's, not the profiler's: the remaining steps are not forced through it."""
    from trials.measure import kernels

    calls = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("out of memory")

    fields = kernels.breakdown_fields(True, failing, "cpu", 1.0)
    assert fields["breakdown_why"] == "profiler: RuntimeError: out of memory" and len(calls) == 1
