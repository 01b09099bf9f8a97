"""The training workload: build, train briefly, benchmark forward+backward+optimizer steps, check generation."""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
import time
from typing import Any, Callable

import torch

from ..parallel import ranks as distributed
from ..measure import energy, fp8_layers, kernels
from . import teacher_forced
from ..backends import STACKS, numerics
from ..measure.bench import benchmark
from ..measure.launch import launch_bound
from ..backends.capability import Resolution
from .data import ArithmeticSequences
from .generation import generation_check
from ..measure.metrics import count_flops, fp8_ran, named_fp8_share, step_stats, throughput
from ..models.minigpt_net import ModelConfig
from ..models.common import output_vocab
from ..spec import TrialSpec
from .train_step import build_train_step, fp8_state, train

log = logging.getLogger(__name__)

BENCH_BATCHES = 4  # distinct pre-made batches cycled through the timed steps


def run(spec: TrialSpec, res: Resolution, cfg: ModelConfig | None, record: dict[str, Any], t0: float,
        ranks: distributed.Ranks = distributed.SINGLE
        ) -> Callable[[teacher_forced.Partners | None], dict[str, Any]] | None:
    """Build, train, benchmark and check one model; fills ``record`` in place (on every rank of a
    multi-rank trial: each holds the same slowest-rank timing; rank 0's record is the one kept).
    ``cfg``: MiniGPT's config where its closed forms apply, else None (FLOPs are counted here).
    Returns, for FP8 cells it applies to, the teacher-forced comparison with the BF16 partner, for
    ``run_trial`` to call once the cell's own memory peaks are recorded (the partner trains a second model),
    given the process's :class:`~trials.workloads.teacher_forced.Partners` where it keeps one."""
    t_setup = time.perf_counter()
    step = build_train_step(spec, res.backend, res.precision, res.device, ranks)
    model, te, recipe = step.model, step.te, step.recipe
    record.update(step.built.info)
    if record["vocab"] is None:  # a factory's model that could not say its vocabulary before it existed
        record["vocab"] = output_vocab(model, res.device)
    vocab = record["vocab"]  # the model's (the spec's, or an hf/py model's own)
    if record["flops_method"] is None:
        record.update(count_flops(spec, model, vocab, res.device, ranks.world))
    elif cfg is not None and record["fp8_flop_share"] is None and record.get("fp8_converted_names") is not None:
        names = json.loads(record["fp8_converted_names"])  # torchao's MiniGPT: the formula's FLOPs, its Linears'
        record["fp8_flop_share"] = named_fp8_share(cfg, step.built.model, names)
    if res.precision != "fp8":  # nothing asked FP8: none of its FLOPs ran there, on every stack and model source
        record["fp8_flop_share"] = 0.0
    if res.precision == "fp8" and not fp8_ran(record["fp8_flop_share"], record["fp8_converted_modules"]):
        record.update(effective_precision="bf16", effective_recipe=None)  # not an FP8 result: never paired as one
        share = record["fp8_flop_share"]
        log.warning("fp8 asked, but %s ran in FP8 (%s converted modules): this cell ran BF16 and is recorded so "
                    "(fp8_skipped_modules, fp8_skipped_why: what was kept and why)", "none of the step's FLOPs" if not share else f"{share:.1%} of the "
                    "step's FLOPs", record["fp8_converted_modules"])
    data: Any = ArithmeticSequences(vocab, spec.seq_len, res.device, spec.seed)
    if spec.parallel != "none":
        data = distributed.RankData(data, ranks)  # this rank's rows of the global batch
    if spec.cuda_graphs:  # a sample of the batch's shape, from data of its own: training's batches stay the
        # partner's (teacher_forced_fields), batch 1 first; capture runs no optimizer step on it
        sample = ArithmeticSequences(vocab, spec.seq_len, res.device, spec.seed).batch(spec.batch_size)[0]
        record.update(step.capture(sample, whole=spec.source.graphs_whole).record())
    record["setup_s"] = time.perf_counter() - t_setup

    t_train = time.perf_counter()
    record["startup_s"] = t_train - t0
    seam = numerics(res.backend) if reads_apply(spec, record) else None  # effective precision is known by now
    layer_held = teacher_forced.held_pair(vocab, spec.seq_len, res.device, spec.seed) if seam is not None else None
    sampler = (fp8_layers.OutlierSampler(step, seam, layer_held[0], res.device, fp8_layers.outlier_every(spec.train_steps),
                                         spec.train_steps) if seam is not None else None)
    trained = train(step, data, spec.train_steps, spec.step_rows, after_step=sampler)
    losses = distributed.mean(trained.losses, ranks)  # the global batch's loss
    record.update(train_s=time.perf_counter() - t_train, first_step_s=trained.first_step_s, loss_first=losses[0],
                  loss_final=losses[-1], loss_curve=losses, saved_activation_bytes=trained.saved_bytes,
                  model_units=len(step.built.units) or None, checkpointed_units=len(step.checkpointed.units))
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if bad is not None:
        record.update(status="diverged", error=f"non-finite training loss at step {bad}")
        return
    if recipe is not None and spec.recipe == "delayed":
        record["fp8_state"] = fp8_state(model)
    # as trained, before the benchmark trains it on; a cell that ran no FP8 has no FP8 numerics to compare
    held, fp8_log_probs = fp8_read(spec, res, step, vocab) if fp8_alone(spec, record) else (None, None)

    t_bench = time.perf_counter()
    batches = [data.batch(spec.step_rows) for _ in range(BENCH_BATCHES)]
    result = benchmark(step, batches, res.device, spec.warmup_steps, spec.bench_steps, spec.repeats)
    record["bench_s"] = time.perf_counter() - t_bench
    step_ms = distributed.slowest(result.step_ms, ranks)  # a step takes as long as its slowest rank
    stats = step_stats(step_ms)
    record.update(stats)
    # the peak of the precision that ran: an FP8 cell that ran BF16 (above) is measured against BF16's
    record.update(throughput(record["flops_per_step"], spec.tokens, stats["step_ms_mean"],
                             record["gpu_name"], record["effective_precision"], gpus=ranks.world))
    if ranks.world > 1 or spec.parallel != "none":
        record.update(distributed.facts(ranks, res.device))
        if res.device == "cuda":
            peaks = distributed.gathered(int(torch.cuda.max_memory_allocated()), ranks)
            record.update(rank_peak_mem_min_bytes=min(peaks), rank_peak_mem_max_bytes=max(peaks))
    medians = [statistics.median(step_ms[i:i + spec.bench_steps]) for i in range(0, len(step_ms), spec.bench_steps)]
    # the global batch's loss, as the training losses: every rank then decides divergence alike (one that stopped
    # here alone would leave the others waiting in the window's collectives)
    bench_loss = distributed.mean([result.last_loss], ranks)[0]
    record.update(timer=result.timer, step_times_ms=step_ms, repeat_medians_ms=medians,
                  host_ms_per_step=result.host_ms_per_step, bench_loss_final=bench_loss)
    # by the host-issue rule until the profile's gap is known (why_this_number); a diverged cell keeps this one
    record["launch_bound"], record["launch_bound_by"] = launch_bound(stats["step_ms_p50"], result.host_ms_per_step)
    # what else ran meanwhile, on any rank: the step times are the slowest rank's
    record.update(distributed.timing({**result.disturbance.fields(), **result.gc.fields(len(result.step_ms))}, ranks))
    if not math.isfinite(bench_loss):
        record.update(status="diverged", error="non-finite loss during the benchmark")
        return
    if seam is not None:
        # after the timed steps (the read runs a backward of its own), of the model they left: a fixed number of
        # steps on. Not after the energy window and the profiler: they train on for as many steps as the measured
        # step time asks (energy.calls_for), so a read after them was of a model trained a timing-dependent number
        # of steps further, never the same twice (two H200 runs of one seeded cell differed from the first value)
        record.update(layer_reads(step, seam, layer_held, res.device, sampler.trend, spec.step_rows * spec.seq_len))
    # the generation check too: before the energy window's timing-dependent steps, as the reads above
    t_gen = time.perf_counter()
    with distributed.whole(model, spec.parallel):
        gen = generation_check(model, spec.prompt_len, spec.gen_len, spec.seed + 1, vocab, spec.seq_len, te, recipe)
    record.update(gen_s=time.perf_counter() - t_gen, gen_tokens=gen.tokens, gen_stride_accuracy=gen.stride_accuracy)
    why_this_number(spec, res.device, step, batches, record, ranks)
    # the profiler's gap, where it ran, is the GPU waiting on the host itself (trials/measure/launch.py)
    record["launch_bound"], record["launch_bound_by"] = launch_bound(record["step_ms_p50"], result.host_ms_per_step,
                                                                     record["kernel_gap_ms"])
    record.update(status="ok", error=None)
    if fp8_log_probs is None:
        return None
    return lambda partners: teacher_forced_fields(spec, res, vocab, held, fp8_log_probs, partners)


def fp8_alone(spec: TrialSpec, record: dict[str, Any]) -> bool:
    """The reads of the FP8 model (teacher-forced, per-layer) apply: the cell is an FP8 result of one rank. Its
    ``effective_precision``, not the precision asked: a cell that ran (almost) nothing in FP8
    (trials/measure/metrics.fp8_ran, decided once the model is built and its FLOPs counted, before training)
    is a BF16 result and has no FP8 numerics to show."""
    return record["effective_precision"] == "fp8" and spec.parallel == "none"


def reads_apply(spec: TrialSpec, record: dict[str, Any]) -> bool:
    """The per-layer FP8 reads (trials/measure/fp8_layers.py) run: :func:`fp8_alone`, with ``fp8_reads``."""
    return spec.fp8_reads and fp8_alone(spec, record)


def layer_reads(step: Any, seam: Any, held: Any, device: str, trend: fp8_layers.OutlierTrend,
                train_tokens: int) -> dict[str, Any]:
    """The per-layer SQNR and cast-health read and the outlier trend as record fields, with their cost; a failure
    (a held length an FP8 GEMM refuses, an OOM) leaves the fields empty and the cell as it was. ``train_tokens``:
    the tokens one rank's training loss averages over (every micro-batch of its step: each one's loss is divided by
    grad_accum), so the held gradients are the size training's were."""
    t = time.perf_counter()
    try:
        reads, total = fp8_layers.read_layers(step, seam, held, device, train_tokens)
    except Exception as exc:  # noqa: BLE001 - the cell's own numbers stand without it
        log.warning("per-layer FP8 read failed: %s: %s", type(exc).__name__, exc)
        reads, total = [], None
    fields = fp8_layers.record_fields(reads, trend, total)
    log.info("per-layer FP8 read: %d modules, fwd SQNR min %s dB (%.1f s)", len(reads), fields.get("sqnr_fwd_min_db"),
             time.perf_counter() - t)
    return {**fields, "fp8_layers_s": time.perf_counter() - t, "outliers_s": trend.seconds}


def fp8_read(spec: TrialSpec, res: Resolution, step: Any, vocab: int) -> tuple[Any, Any]:
    """(held ids, the FP8 model's log-probabilities on them) for the teacher-forced comparison (a cell where
    :func:`fp8_alone`), or (None, None) where the read fails (the cell runs on without it).
    The read leaves the model as it was: it runs under the stack's numerics seam
    (trials/backends/<stack>_numerics.py: ``fp8_context``, TE's FP8 autocast outside its amax bookkeeping,
    inside ``read_context``, which restores TE's scaling state exactly) and ``fp8_layers.quiet`` (the RNG states
    restored too), so the benchmark that follows times and trains the model a trial without the read would have."""
    seam = numerics(res.backend)
    held = teacher_forced.held_batch(vocab, spec.seq_len, res.device, spec.seed)
    try:
        with fp8_layers.quiet(step.model, res.device), seam.read_context(step) as saved:
            return held, teacher_forced.log_probs(step.model, held, lambda: seam.fp8_context(step, saved))
    except Exception as exc:  # noqa: BLE001 - e.g. a held length TE's FP8 GEMMs refuse; the cell stands without
        log.warning("teacher-forced read of the FP8 model failed: %s: %s", type(exc).__name__, exc)
        return None, None


def teacher_forced_fields(spec: TrialSpec, res: Resolution, vocab: int, held: Any, fp8_log_probs: Any,
                          partners: teacher_forced.Partners | None = None) -> dict:
    """The FP8 cell against its BF16 partner (``trials.workloads.teacher_forced``): the partner stack's BF16 model from the
    same seeded init, trained eager on the same batches for the same steps, read on the same held sequence.
    The partner is ``Stack.bf16_partner``, the stack the report pairs the cell with: for TE, TE's BF16 model of the
    same ``te_layer`` (same modules and kernels but for FP8), so the difference measured is FP8's alone.
    ``partners``: the read of the partner an earlier FP8 cell in this process trained, taken where it is this
    cell's partner too (``tf_partner_reused``), and this cell's read kept for the next.
    A failure here (an OOM of the second model) leaves the fields empty and the timed cell as it was."""
    t = time.perf_counter()
    pspec = teacher_forced.partner_spec(spec, STACKS[res.backend].bf16_partner)
    bf16 = partners.get(pspec, res.device) if partners is not None else None
    reused = bf16 is not None
    try:
        if bf16 is None:
            partner = build_train_step(pspec, pspec.backend, "bf16", res.device)
            data = ArithmeticSequences(vocab, spec.seq_len, res.device, spec.seed)  # the FP8 run's batches, in turn
            train(partner, data, spec.train_steps, spec.step_rows)
            bf16 = teacher_forced.log_probs(partner.model, held)
        fields = teacher_forced.compare(fp8_log_probs, bf16)
    except Exception as exc:  # noqa: BLE001 - the cell's own numbers stand without it
        log.warning("teacher-forced comparison with %s-bf16 failed: %s: %s", pspec.backend, type(exc).__name__, exc)
        return {}
    if partners is not None and not reused:
        partners.keep(pspec, res.device, bf16)
    log.info("teacher-forced vs %s-bf16%s: %s (%.1f s)", pspec.backend, " (kept read)" if reused else "", fields,
             time.perf_counter() - t)
    return {**fields, "tf_s": time.perf_counter() - t, "tf_partner_reused": reused}


def why_this_number(spec: TrialSpec, device: str, step: Any, batches: list, record: dict[str, Any],
                    ranks: distributed.Ranks = distributed.SINGLE) -> None:
    """After timing, on the steps just timed: the energy window, then the kernel breakdown. Every rank runs the
    window (the same number of steps: the slowest rank's p50 sizes it); the step's energy is every rank's board,
    over the global batch's tokens."""
    turn = itertools.count()

    def one() -> Any:
        return step(*batches[next(turn) % len(batches)])

    p50 = record["step_ms_p50"]
    window = energy.measure(one, energy.calls_for(p50), device)
    record.update(window.fields(spec.tokens, distributed.gathered(window.drawn(), ranks)))
    record.update(kernels.breakdown_fields(spec.profile, one, device, p50, compiled=step.compiled_graphs))
