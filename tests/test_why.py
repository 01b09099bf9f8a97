"""Why a number: kernel classes on real H200 kernel names, NVML's clock-event bits, the FP8 bound and
the energy ratio in the report, the clock and cap on both sides of a comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from orchestrator.report import build_report
from orchestrator.report.analysis import compare_runs, prepare
from orchestrator.store import Store
from trials import TrialSpec
from trials.measure.kernels import CLASSES, classify
from trials.models.minigpt_net import ModelConfig, param_count
from trials.measure.nvml import clock_event_names
from trials.record.fields import empty_record

FIXTURE = Path(__file__).parent / "fixtures" / "h200_kernels.json"


def test_every_kernel_name_seen_on_the_h200_gets_its_reviewed_class():
    """286 kernel names from TE, the twin (eager and compiled) and torchao, training and decode."""
    names = json.loads(FIXTURE.read_text())
    wrong = {n: (c, classify(n)) for n, c in names.items() if classify(n) != c}
    assert not wrong, list(wrong.items())[:5]
    assert {c for c in names.values()} <= set(CLASSES)
    # the distinctions the bound rests on, by name: cuBLASLt's FP8 GEMMs, TE's casts, torchao's fused casts
    assert classify("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_TNT") == "gemm_fp8"
    assert classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm_bf16"
    assert classify("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
                    "at::native::direct_copy_kernel_cuda") == "elementwise"


def test_clock_event_bits_are_nvmls():
    import pynvml

    mask = (pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
            | pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonSyncBoost)
    assert clock_event_names(mask) == ["power:sw_power_cap", "other:sync_boost", "thermal:hw_thermal"]
    assert clock_event_names(pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown) == ["power:hw_power_brake"]
    assert clock_event_names(pynvml.nvmlClocksEventReasonGpuIdle) == []


# A BF16 step of 100 ms: 60 in GEMMs, 20 element-wise, 15 other kernels, 5 idle. Its FP8 partner halves
# the GEMMs, casts for 5 ms and saves 2 ms of element-wise work: casts net +3 ms, bound 100 / 73.
BF16 = dict(kernel_ms_gemm_bf16=60.0, kernel_ms_elementwise=20.0, kernel_ms_attention=15.0)
FP8 = dict(kernel_ms_gemm_bf16=1.0, kernel_ms_gemm_fp8=29.0, kernel_ms_fp8_cast=5.0, kernel_ms_elementwise=18.0,
           kernel_ms_attention=15.0)


def _rec(precision: str, ms: float, joules: float, sample: int, cap: float = 700.0) -> dict:
    spec = TrialSpec(d_model=512, n_layers=2, backend="te", precision=precision, seed=sample)
    rec = empty_record()
    rec.update(spec.to_dict())
    kernels = {f"kernel_ms_{c}": 0.0 for c in CLASSES} | (FP8 if precision == "fp8" else BF16)
    total = sum(kernels.values())
    rec.update(kernels, status="ok", effective_backend="te", effective_precision=precision,
               effective_recipe="delayed" if precision == "fp8" else None, cell_id=f"c-{precision}",
               cell_label=f"d512-te-{precision}", sample=sample, n_params=param_count(ModelConfig.from_spec(spec)),
               step_ms_p50=ms, step_times_ms=[ms] * 4, loss_curve=[2.0, 1.0], loss_final=1.0, kernel_ms_total=total,
               kernel_gap_ms=ms - total, energy_j_per_step=joules, tokens_per_j=8192 / joules, power_mean_w=600.0,
               sm_clock_mean_mhz=1600.0 + sample, sm_clock_min_mhz=1500, sm_clock_max_mhz=1980, power_limit_w=cap,
               clock_limits="power:sw_power_cap", energy_gpu_shared=False, gpu_name="NVIDIA H200")
    return rec


def test_report_states_the_bound_and_the_energy_ratio_of_each_fp8_pair(tmp_path):
    store = Store(str(tmp_path), "why")
    store.ensure()
    for s, jitter in enumerate((1.0, 1.02)):
        store.write_record(_rec("bf16", 100.0, 50.0 * jitter, s))
        store.write_record(_rec("fp8", 70.0, 35.0 * jitter, s))
    report = build_report(store.root)
    md = Path(report.md_path).read_text()
    assert "## Where the training step goes" in md and "## Energy" in md
    bound = md.split("## The bound")[1].split("\n## ")[0]
    row = next(line for line in bound.splitlines() if "te-fp8-delayed" in line)
    assert "1.37" in row  # 100 / (100 - 60 + 30 + 3)
    assert "casts add 3.00 ms net" in row and "GEMMs are 60% of the BF16 step and 2.00x faster" in row
    assert "| 0.7 |" in row  # energy FP8/BF16 = 35 / 50
    html = Path(report.html_path).read_text()
    assert "Where the training step goes" in html and "power limit 700 W" in html


def test_compare_shows_the_cap_and_clock_of_both_sides():
    a = prepare(pd.DataFrame([_rec("bf16", 100.0, 50.0, s) for s in (0, 1)]))
    b = prepare(pd.DataFrame([_rec("bf16", 120.0, 50.0, s, cap=500.0) for s in (0, 1)]))
    row = compare_runs(a, b).iloc[0]
    assert (row["a_power_limit_w"], row["b_power_limit_w"]) == (700.0, 500.0)
    assert row["a_sm_clock_mean_mhz"] == pytest.approx(1600.5)


def test_scaling_across_gpus_is_the_one_rank_time_over_the_n_rank_time(tmp_path):
    """Weak scaling from records: 100 ms on one rank, 110 ms on two (FSDP2): efficiency 0.909."""
    store = Store(str(tmp_path), "scale")
    store.ensure()
    for s, jitter in enumerate((1.0, 1.01)):
        for world, ms in ((1, 100.0), (2, 110.0)):
            rec = _rec("bf16", ms * jitter, 50.0, s)
            rec.update(world_size=world, parallel="fsdp", cell_id=f"ws{world}", cell_label=f"d512-fsdp{world}",
                       tokens_per_s_per_gpu=8192 / (ms * jitter / 1000))
            store.write_record(rec)
    md = Path(build_report(store.root).md_path).read_text()
    section = md.split("## Scaling across GPUs")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if "| fsdp | 2 |" in line)
    assert "| 0.909 |" in row, row


def test_cpu_breakdown_adds_up_to_the_wall_clock_step():
    """34.7: on CPU the profiler slows the step; operator times are scaled to the timed step, so the classes
    never exceed it (was: 15.85 ms of operators on a 12.79 ms step, a gap of -3.06 ms)."""
    import torch

    from trials.measure.kernels import Breakdown, Kernel, profile

    found = Breakdown(3, 0.1, [Kernel("aten::mm", "gemm_bf16", 10.0, 4), Kernel("aten::add", "elementwise", 5.85, 9)],
                      wall_ms=17.0)  # the profiled step's own wall clock, profiler included
    f = found.fields(12.79)
    assert f["kernel_ms_total"] == pytest.approx(15.85 * 12.79 / 17.0) and f["kernel_gap_ms"] > 0
    assert f["kernel_ms_gemm_bf16"] + f["kernel_ms_elementwise"] + f["kernel_gap_ms"] == pytest.approx(12.79)
    a = torch.randn(64, 64)
    real = profile(lambda: a @ a, 2, "cpu")
    assert real.wall_ms is not None and real.wall_ms > 0
    assert real.fields(real.wall_ms)["kernel_gap_ms"] >= 0


def test_busy_time_is_the_union_of_kernel_intervals_over_streams():
    """Kernels on two streams (NCCL's beside the compute) overlap: the GPU is busy for the union of their
    intervals, not their sum. Nested, overlapping, touching, empty and out-of-order intervals."""
    from trials.measure.kernels import busy_us

    assert busy_us([]) == 0.0
    assert busy_us([(0.0, 100.0), (60.0, 90.0)]) == 100.0  # an all-reduce nested in the compute
    assert busy_us([(0.0, 10.0), (5.0, 15.0)]) == 15.0  # overlapping in part
    assert busy_us([(20.0, 25.0), (0.0, 10.0), (10.0, 20.0)]) == 25.0  # touching, out of order
    assert busy_us([(3.0, 3.0), (0.0, 1.0)]) == 1.0  # an empty interval adds nothing
    assert busy_us([(0.0, 4.0), (1.0, 2.0), (3.0, 9.0), (20.0, 21.0), (8.0, 12.0)]) == 13.0
    # one stream: kernels never overlap, and the union is the sum the breakdown recorded before
    starts = [0.0, 7.5, 8.25, 30.0, 31.125]
    lengths = [5.0, 0.5, 12.0, 1.0, 40.0]
    serial = [(s, s + n) for s, n in zip(starts, lengths)]
    assert all(a[1] <= b[0] for a, b in zip(serial, serial[1:]))
    assert busy_us(reversed(serial)) == pytest.approx(sum(lengths), rel=1e-12)


def test_an_all_reduce_overlapping_the_compute_leaves_the_gap_of_the_idle_gpu():
    """A 100 ms compute step with a 30 ms all-reduce on NCCL's stream beside it, and the GPU idle a share of the
    timed step: the classes stay sums (130 ms of kernels), the gap is the idle time (was 130 ms of kernels
    against the step: a negative gap, and a multi-rank step was never launch-bound)."""
    from trials.measure.kernels import Breakdown, Kernel, busy_us
    from trials.measure.launch import LAUNCH_BOUND_GAP_SHARE, launch_bound

    compute, comm = (0.0, 100.0), (60.0, 90.0)  # ms on the GPU's clock, one profiled step
    found = Breakdown(1, 0.1, [Kernel("nvjet_sm90_tst_128x256", "gemm_bf16", 100.0, 1),
                               Kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "comm", 30.0, 1)],
                      busy_ms=busy_us([compute, comm]))
    idle = 2 * LAUNCH_BOUND_GAP_SHARE * 100.0  # the host held the GPU back this long
    timed = 100.0 + idle
    f = found.fields(timed)
    assert f["kernel_ms_total"] == 130.0 and f["kernel_ms_comm"] == 30.0 and f["kernel_ms_gemm_bf16"] == 100.0
    assert f["kernel_gap_ms"] == pytest.approx(idle)
    assert launch_bound(timed, 10.0, f["kernel_gap_ms"]) == (True, "kernel_gap")
    # a decode token: a generation's busy time less its prefill's, per token, as the kernels are
    prefill = Breakdown(1, 0.1, [Kernel("nvjet_sm90_tst_128x256", "gemm_bf16", 20.0, 1)], busy_ms=20.0)
    token = found.minus(prefill, per=8)
    assert token.busy == pytest.approx((100.0 - 20.0) / 8) and token.total_ms == pytest.approx((130.0 - 20.0) / 8)
    # without the union (CPU operators' self times never overlap) the busy time is the sum
    assert Breakdown(1, 0.1, [Kernel("aten::mm", "gemm_bf16", 4.0, 1)]).fields(5.0)["kernel_gap_ms"] == 1.0
