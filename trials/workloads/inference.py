"""The inference workload: does FP8 pay off for serving this model size?

1. Train the model briefly in BF16 (fp32 on fp32 cells), on the same data and schedule as a training
   trial, so that generation means something.
2. The BF16 reference: a fresh inference model loaded with the trained weights generates greedily
   from ``batch_size`` prompts (KV cache); its tokens are what FP8 is compared with.
3. The measured model: the reference itself (bf16 cells), the reference under FP8 autocast (fp8
   compute, BF16 weights), a model built under TE's ``quantized_model_init`` whose weights exist
   only in FP8 (``weights: fp8``), or (``backend: torchao``) a fresh copy with its Linears
   quantized by torchao's ``quantize_``: FP8 weights, activations cast to FP8 per tensor or per row
   (the layer that makes the logits stays BF16). Delayed scaling needs scales that describe the trained model's
   tensors first: a few forward passes in TE's calibration mode record amaxes, one FP8 forward turns
   them into scales, and the FP8-weight model loads that state (``backends.te.load_fp8_weights``).
4. ``bench_steps`` timed generations after one untimed: prefill of ``prompt_len`` tokens, then
   ``gen_len - 1`` single-token decode steps (CUDA-graphed with ``cuda_graphs``).
5. After timing, for fp8 cells, the teacher-forced numerics (trials/workloads/teacher_forced.py): the measured model's
   next-token distributions against the BF16 reference's, on every prefill position and on decode steps
   fed the reference's own tokens (read from the reference before step 3), so one early greedy divergence
   cannot ruin them; ``gen_match_rate`` (greedy tokens equal) stays as the secondary field.

How a model is loaded and generated from is its source's serving module (trials/workloads/serving: MiniGPT's
Generator, or transformers' own cache for hf: models and py: factories that are transformers models);
this module never asks which model it runs.

FP8 GEMMs need a minimum row count (TE asserts 8; cuBLASLt's row-scaled FP8 GEMM, which torchao's
rowwise calls, refuses 8 rows on the H200 and takes 16): FP8 cells decode ``batch_size`` rounded up
to their stack's ``fp8_rows`` and count only ``batch_size`` of them in every throughput, as a
deployment serving that batch would have to. ``decode_rows`` records it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from types import ModuleType
from typing import Any

import torch

from ..measure import disturbance, energy, kernels, memory
from . import serving, teacher_forced
from ..backends import te_compat
from ..backends import STACKS
from ..backends import te as te_backend
from ..backends import torchao as torchao_backend
from ..backends.capability import Resolution
from .data import ArithmeticSequences
from .decode import Generation
from .generation import stride_accuracy
from ..measure.metrics import step_stats
from ..models.common import output_vocab
from ..spec import TrialSpec, field_default
from .train_step import build_train_step, train

log = logging.getLogger(__name__)

TRAIN_BATCH = field_default("batch_size")  # the training trial's batch
CALIBRATION_BATCHES = 4  # forward passes in TE's calibration mode before FP8 scales are made
PROFILED_GENERATIONS = 1  # a generation is gen_len - 1 decode steps already
# record fields of a stack's build that inference leaves null (TE's build counts a training step's FLOPs, and the
# share of them in FP8: of a model it built in BF16 here, the FP8 settings waiting for the inference model)
TRAINING_ONLY = ("flops_per_step", "flops_method", "fp8_flop_share")


def run(spec: TrialSpec, res: Resolution, cfg: Any, record: dict[str, Any], t0: float, ranks: Any = None) -> None:
    """Train, build the inference model, time prefill and decode; fills ``record`` in place."""
    t_setup = time.perf_counter()
    server = serving.of(spec)  # how this model source's models are loaded and generated from
    high = "fp32" if res.precision == "fp32" else "bf16"
    step = build_train_step(spec, res.backend, high, res.device)  # the spec's fp8 settings wait for step 3
    te = step.te
    # a training step's counted FLOPs (TE counts a converted model's as it builds it) describe no inference step
    record.update({k: v for k, v in step.built.info.items() if k not in TRAINING_ONLY})
    if why := server.refusal(step.model):
        record.update(status="unsupported", error=why)
        return
    if record["vocab"] is None:  # a factory's model that could not say its vocabulary before it existed
        record["vocab"] = output_vocab(step.model, res.device)
    vocab = record["vocab"]
    recipe = None  # TE's recipe object (te fp8 cells)
    fp8 = res.precision == "fp8"
    if fp8 and res.backend == "te":
        recipe = te_backend.fp8_recipe(spec)
        record["fp8_recipe_repr"] = repr(recipe)
    data = ArithmeticSequences(vocab, spec.seq_len, res.device, spec.seed)
    record["setup_s"] = time.perf_counter() - t_setup

    t_train = time.perf_counter()
    record["startup_s"] = t_train - t0
    trained = train(step, data, spec.train_steps, TRAIN_BATCH)
    record.update(train_s=time.perf_counter() - t_train, first_step_s=trained.first_step_s,
                  loss_first=trained.losses[0], loss_final=trained.losses[-1], loss_curve=trained.losses)
    if not all(math.isfinite(v) for v in trained.losses):
        record.update(status="diverged", error="non-finite training loss")
        return
    state = {k: v.detach().clone() for k, v in step.model.state_dict().items()}
    dtype = next(step.model.parameters()).dtype
    del step, trained
    memory.release(res.device)

    pad = STACKS[res.backend].fp8_rows
    rows = math.ceil(spec.batch_size / pad) * pad if fp8 else spec.batch_size
    prompts, stride = ArithmeticSequences(vocab, spec.seq_len, res.device, spec.seed + 1).sequences(
        rows, spec.prompt_len)  # (rows, prompt_len)
    max_len = spec.prompt_len + spec.gen_len
    t_bench = time.perf_counter()
    model, weight_bytes = _build(server, spec, dtype, res.device, te, state)
    ref_generator = server.generator(model, rows, max_len, te)
    reference = ref_generator.generate(prompts, spec.gen_len)
    record["ref_stride_accuracy"] = _stride_accuracy(prompts, reference.tokens, stride, vocab, spec.batch_size)
    forced = keep = ref_log_probs = None
    if fp8:  # the reference's teacher-forced distributions, read while it exists (untimed)
        forced = reference.tokens[:, :-1]  # the decode steps' inputs: the reference's own greedy tokens
        keep = teacher_forced.served_rows(spec.batch_size, spec.prompt_len + spec.gen_len - 1)
        ref_log_probs = _guarded(lambda: ref_generator.forced(prompts, forced, keep))
    ref_generator = None  # frees the reference model (held by the closure too) before the served one is built
    if recipe is not None:
        _calibrate(model, te, recipe, data)
        if spec.weights == "fp8":
            state = model.state_dict()
            del model
            memory.release(res.device)
            model, weight_bytes = _build(server, spec, dtype, res.device, te, state, recipe)
    elif fp8:  # torchao: a fresh copy, quantized as it is built, so weight_bytes counts FP8 weights only
        del model
        memory.release(res.device)
        model, weight_bytes = _build(server, spec, dtype, res.device, te, state, serve_recipe=spec.recipe,
                                     record=record)

    generator = server.generator(model, rows, max_len, te, recipe, graphs=spec.cuda_graphs)
    generator.generate(prompts, spec.gen_len)  # warm-up: kernels chosen, caches filled
    if res.device == "cuda":
        torch.cuda.synchronize()
    # decode_mem: the timed generations' own peak, the trial's (training, the reference) kept whole beside it;
    # seen: what else ran on the host and the GPU meanwhile
    with memory.phase(res.device, record) as decode_mem, disturbance.watch(res.device) as seen:
        runs: list[Generation] = [generator.generate(prompts, spec.gen_len) for _ in range(spec.bench_steps)]
    record["bench_s"] = time.perf_counter() - t_bench

    tokens = runs[-1].tokens
    prefill = [g.prefill_ms for g in runs]
    decode = [ms for g in runs for ms in g.decode_ms]
    record.update(_timing(prefill, decode, spec))
    record.update(decode_rows=rows, weight_bytes=weight_bytes, kv_cache_bytes=generator.cache_bytes,
                  **seen.fields(), peak_decode_mem_bytes=decode_mem.allocated,
                  timer="cuda_event" if res.device == "cuda" else "perf_counter",
                  gen_tokens=torch.cat([prompts[0], tokens[0]]).tolist(),
                  gen_stride_accuracy=_stride_accuracy(prompts, tokens, stride, vocab, spec.batch_size))
    if fp8:
        real = slice(0, spec.batch_size)
        record["gen_match_rate"] = float((tokens[real] == reference.tokens[real]).float().mean().item())
    why_this_number(spec, res.device, generator, prompts, runs, record)
    if ref_log_probs is not None:  # after every timed and profiled call: the numerics cost no timing
        t_tf = time.perf_counter()
        measured = _guarded(lambda: generator.forced(prompts, forced, keep))
        if measured is not None:
            record.update(teacher_forced.compare(measured, ref_log_probs), tf_s=time.perf_counter() - t_tf)
    record.update(status="ok", error=None)


def _guarded(read: Any) -> torch.Tensor | None:
    """A teacher-forced read, or None where it fails (an OOM of its logits): the cell's own numbers stand."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001
        log.warning("teacher-forced read failed: %s: %s", type(exc).__name__, exc)
        return None


def why_this_number(spec: TrialSpec, device: str, generator: Any, prompts: torch.Tensor,
                    runs: list[Generation], record: dict[str, Any]) -> None:
    """After timing: the energy of whole generations (what a server pays per request, prefill included),
    and the kernels of one decode step: a profiled generation less a profiled prefill, per decode step."""
    def whole() -> Any:
        return generator.generate(prompts, spec.gen_len)

    def prefill() -> Any:
        return generator.generate(prompts, 1)

    per_call = statistics.fmean(g.prefill_ms + sum(g.decode_ms) for g in runs)
    record.update(energy.measure(whole, energy.calls_for(per_call), device).fields(spec.batch_size * spec.gen_len))
    record.update(kernels.breakdown_fields(spec.profile, whole, device, record["decode_ms_per_token_p50"],
                                           baseline=prefill, per=spec.gen_len - 1, steps=PROFILED_GENERATIONS))


def _build(server: ModuleType, spec: TrialSpec, dtype: torch.dtype, device: str, te: Any, state: dict,
           fp8_recipe: Any = None, serve_recipe: str | None = None,
           record: dict[str, Any] | None = None) -> tuple[Any, int]:
    """A fresh inference model holding ``state`` (its source's ``server.load``); with ``fp8_recipe``, its TE
    weights exist only in FP8; with ``serve_recipe``, its Linears are quantized by torchao (their fields go
    into ``record``).

    Returns the model and the bytes its weights take on the device (what building it allocated:
    FP8 data and scales included), or their storage size on CPU.
    """
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    with torch.no_grad():  # no grad: TE keeps no transposed copy of FP8 weights (only backward needs it)
        model = server.load(spec, state, dtype, device, te, fp8_recipe)
        if serve_recipe is not None:
            record.update(torchao_backend.quantize_for_serving(  # type: ignore[union-attr]
                model, serve_recipe, server.logits_layer(model)))
    if device == "cuda":
        torch.cuda.synchronize()
        return model, int(torch.cuda.memory_allocated() - before)
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def _calibrate(model: Any, te: Any, recipe: Any, data: ArithmeticSequences) -> None:
    """Delayed scaling: amaxes from TE's calibration mode, then one FP8 forward turns them into scales
    (TE updates delayed scales when an FP8 region that recorded gradients ends). Other recipes compute
    their scales from each tensor as it is cast; the passes cost them nothing but time."""
    for _ in range(CALIBRATION_BATCHES):
        x, _ = data.batch(TRAIN_BATCH)
        with te_compat.calibration(te, recipe):
            model(x)
    x, _ = data.batch(TRAIN_BATCH)
    with te_compat.autocast(te, recipe):
        model(x)


def _timing(prefill: list[float], decode: list[float], spec: TrialSpec) -> dict[str, Any]:
    pre, dec = step_stats(prefill), step_stats(decode)
    return {
        "prefill_times_ms": prefill, "decode_times_ms": decode,
        "prefill_ms_p50": pre["step_ms_p50"], "prefill_ms_p90": pre["step_ms_p90"],
        "decode_ms_per_token_p50": dec["step_ms_p50"], "decode_ms_per_token_p90": dec["step_ms_p90"],
        "prefill_tokens_per_s": spec.batch_size * spec.prompt_len / (pre["step_ms_mean"] / 1000.0),
        "decode_tokens_per_s": spec.batch_size / (dec["step_ms_mean"] / 1000.0),
    }


def _stride_accuracy(prompts: torch.Tensor, tokens: torch.Tensor, stride: torch.Tensor, vocab: int,
                     rows: int) -> float:
    """Share of generated tokens that continue their prompt's stride (real rows only)."""
    return stride_accuracy(torch.cat([prompts[:rows, -1:], tokens[:rows]], dim=1), stride[:rows], vocab)
