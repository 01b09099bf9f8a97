"""The trial record: one flat dict per trial, every field typed and documented here.

The orchestrator derives its Parquet schema from :data:`FIELDS`, and the README's field table is
checked against it by the tests, so a field cannot be added without a type and a description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1

# Final statuses: a rerun does not repeat these. "error" and "timeout" are retried on resume.
FINAL_STATUSES = ("ok", "oom", "unsupported", "diverged")
STATUSES = FINAL_STATUSES + ("error", "timeout")


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # int | float | str | bool | list[float] | list[int]
    doc: str


def _f(name: str, type_: str, doc: str) -> Field:
    return Field(name, type_, doc)


FIELDS: list[Field] = [
    _f("schema_version", "int", "Version of this record layout."),
    _f("status", "str", "ok, oom, unsupported, diverged, error or timeout."),
    _f("error", "str", "Why the status is not ok: the unsupported reason, OOM message or exception."),
    _f("error_type", "str", "Exception class name for error/oom records."),
    # -- the spec as requested
    _f("vocab", "int", "Vocabulary size."),
    _f("d_model", "int", "Hidden size."),
    _f("n_layers", "int", "Transformer blocks."),
    _f("n_heads", "int", "Attention heads (default d_model/64)."),
    _f("ffn", "int", "MLP hidden size (default 4*d_model)."),
    _f("seq_len", "int", "Tokens per sequence."),
    _f("batch_size", "int", "Sequences per step."),
    _f("backend", "str", "Requested backend: auto, te or torch."),
    _f("precision", "str", "Requested precision: fp32, bf16 or fp8."),
    _f("recipe", "str", "Requested FP8 recipe (delayed, current, block); meaningful for fp8 only."),
    _f("fp8_format", "str", "FP8 format: hybrid (E4M3 fwd / E5M2 bwd) or e4m3."),
    _f("amax_history_len", "int", "Delayed scaling: amax history length."),
    _f("amax_compute_algo", "str", "Delayed scaling: max or most_recent."),
    _f("cuda_graphs", "bool", "Forward+backward captured as CUDA graphs."),
    _f("train_steps", "int", "Training steps before the benchmark."),
    _f("lr", "float", "AdamW learning rate."),
    _f("warmup_steps", "int", "Untimed steps before the timed blocks."),
    _f("bench_steps", "int", "Timed steps per repeat."),
    _f("repeats", "int", "Timed blocks of bench_steps steps."),
    _f("gen_len", "int", "Tokens decoded greedily in the generation check."),
    _f("prompt_len", "int", "Prompt tokens for the generation check."),
    _f("seed", "int", "Seed of weights and data."),
    _f("device", "str", "Requested device: auto, cuda or cpu."),
    # -- what actually ran
    _f("effective_device", "str", "Device the trial ran on."),
    _f("effective_backend", "str", "Backend that ran (te or torch); empty when unsupported."),
    _f("effective_precision", "str", "Precision that ran; empty when unsupported."),
    _f("effective_recipe", "str", "FP8 recipe that ran; empty for non-fp8 cells."),
    _f("fp8_recipe_repr", "str", "TE's repr of the recipe object used."),
    _f("te_torch_compile", "bool", "TE's torch.compile'd element-wise fusers on (NVTE_TORCH_COMPILE, TE's default: on)."),
    # -- model size and work
    _f("n_params", "int", "All parameters (embeddings included)."),
    _f("n_matmul_params", "int", "Weights in matrix products (blocks + LM head), N in the FLOP formula."),
    _f("tokens_per_step", "int", "batch_size * seq_len."),
    _f("flops_per_step", "float", "6*N_matmul*tokens + 6*n_layers*seq_len*d_model*tokens."),
    # -- training
    _f("loss_first", "float", "Loss of the first training step."),
    _f("loss_final", "float", "Loss of the last training step."),
    _f("loss_curve", "list[float]", "Loss at every training step."),
    _f("bench_loss_final", "float", "Loss of the last timed step (the model keeps training)."),
    # -- timing
    _f("timer", "str", "cuda_event (GPU) or perf_counter (CPU)."),
    _f("step_ms_p50", "float", "Median step time over all timed steps, ms."),
    _f("step_ms_p90", "float", "90th percentile step time, ms."),
    _f("step_ms_p99", "float", "99th percentile step time, ms."),
    _f("step_ms_mean", "float", "Mean step time, ms."),
    _f("step_ms_std", "float", "Standard deviation of step times, ms."),
    _f("step_ms_min", "float", "Fastest step, ms."),
    _f("step_times_ms", "list[float]", "Every timed step, repeat after repeat, ms."),
    _f("repeat_medians_ms", "list[float]", "Median step time of each repeat, ms."),
    _f("tokens_per_s", "float", "tokens_per_step / mean step time."),
    _f("model_tflops", "float", "flops_per_step / mean step time, TFLOP/s."),
    _f("peak_tflops_bf16", "float", "Dense BF16 datasheet peak of this GPU (null if unknown)."),
    _f("peak_tflops_precision", "float", "Dense datasheet peak of the precision used (null if unknown)."),
    _f("mfu_bf16_peak", "float", "model_tflops / peak_tflops_bf16."),
    _f("mfu_precision_peak", "float", "model_tflops / peak_tflops_precision."),
    _f("host_ms_per_step", "float", "Host time to issue one step from an idle GPU, ms."),
    _f("launch_bound", "bool", "GPU waits on the host: host_ms_per_step >= 0.8 * step_ms_p50 (null on CPU)."),
    # -- memory
    _f("peak_mem_allocated_bytes", "int", "torch.cuda.max_memory_allocated over the trial."),
    _f("peak_mem_reserved_bytes", "int", "torch.cuda.max_memory_reserved over the trial."),
    _f("nvml_process_mem_bytes", "int", "Device memory NVML charges to the trial process (null where NVML can't tell)."),
    _f("num_ooms", "int", "Allocator OOMs (torch.cuda.memory_stats)."),
    _f("num_alloc_retries", "int", "Allocator retries after freeing cache (memory pressure)."),
    _f("mem_at_start_bytes", "int", "Device memory still allocated when the trial started (0 in a fresh process; "
       "what an earlier trial in the same process left)."),
    _f("peak_rss_bytes", "int", "Peak resident host memory of the trial process during the trial (Linux VmHWM, "
       "reset at trial start; null where it cannot be reset)."),
    # -- numerics
    _f("fp8_state", "str", "JSON: scale, newest and max amax of block 0's FP8 tensors (delayed scaling)."),
    _f("gen_tokens", "list[int]", "First prompt and its greedy continuation."),
    _f("gen_stride_accuracy", "float", "Share of generated steps that keep the prompt's stride (8 prompts)."),
    # -- fingerprint
    _f("gpu_name", "str", "torch's device name."),
    _f("compute_capability", "str", "e.g. 9.0."),
    _f("sm_count", "int", "Streaming multiprocessors."),
    _f("gpu_total_memory_bytes", "int", "Device memory."),
    _f("driver_version", "str", "NVIDIA driver (NVML)."),
    _f("cuda_version", "str", "CUDA version torch was built with."),
    _f("torch_version", "str", "torch.__version__."),
    _f("te_version", "str", "Transformer Engine version, if installed."),
    _f("python_version", "str", "Python version."),
    _f("juicytalk_version", "str", "This package's version."),
    _f("git_sha", "str", "Commit of the juicytalk source, where it is a git checkout; -dirty: tracked files were edited."),
    _f("hostname", "str", "Host the trial ran on."),
    _f("pid", "int", "Process that ran the trial."),
    _f("process_trial_index", "int", "Trials this process ran before this one (0: a fresh process)."),
    _f("dynamo_recompile_limit_hit", "bool", "TorchDynamo hit its recompile limit during the trial (a TE fuser may "
       "have run uncompiled); the process is replaced after it. Null when the process did not watch."),
    _f("compile_cache_dir", "str", "TORCHINDUCTOR_CACHE_DIR in effect (null: torch's default); Triton's cache sits "
       "beside it."),
    # -- time
    _f("started_at", "str", "UTC ISO-8601 start."),
    _f("finished_at", "str", "UTC ISO-8601 end."),
    _f("duration_s", "float", "Whole trial, s."),
    _f("setup_s", "float", "Capability probe, model and optimizer build, graph capture, s."),
    _f("startup_s", "float", "Trial start to the first training step issued, s."),
    _f("first_step_s", "float", "The first training step alone, synced: TE's fuser compiles and cuDNN plans, s."),
    _f("train_s", "float", "Training steps, s."),
    _f("bench_s", "float", "Warmup, host probe and timed blocks, s."),
    _f("gen_s", "float", "Generation check, s."),
]

FIELD_NAMES = [f.name for f in FIELDS]


def empty_record() -> dict[str, Any]:
    """Every field present (None where not measured), so all records share one shape."""
    record: dict[str, Any] = {name: None for name in FIELD_NAMES}
    record["schema_version"] = SCHEMA_VERSION
    return record
