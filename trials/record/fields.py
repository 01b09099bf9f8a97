"""The record: one flat dict per trial, every field declared here once, with its type, its meaning
and the layer that sets it (the trial itself, the Ray worker that ran it, or the sweep's driver).

The store's Parquet schema and :func:`validate` are derived from :data:`ALL_FIELDS`, and the guide's
field table (docs/guide/record-fields.md) is generated from it (``juicytalk fields``; a test checks it matches), so
a field cannot be added without a type and a description, nor written without being declared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..measure.kernels import CLASSES
from ..typecheck import matches

SCHEMA_VERSION = 1

# Final statuses: a rerun does not repeat these. "error" and "timeout" are retried on resume.
FINAL_STATUSES = ("ok", "oom", "unsupported", "diverged")
STATUSES = FINAL_STATUSES + ("error", "timeout")


LAYERS = ("trial", "worker", "driver")


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # int | float | str | bool | list[float] | list[int]
    doc: str
    layer: str = "trial"  # who sets it: the trial, the Ray worker that ran it, or the sweep's driver


def _f(name: str, type_: str, doc: str, layer: str = "trial") -> Field:
    return Field(name, type_, doc, layer)


FIELDS: list[Field] = [
    _f("schema_version", "int", "Version of this record layout."),
    _f("status", "str", "ok, oom, unsupported, diverged, error or timeout."),
    _f("error", "str", "Why the status is not ok: the unsupported reason, OOM message or exception."),
    _f("error_type", "str", "Exception class name for error/oom records."),
    # -- the spec as requested
    _f("model", "str", "The model: minigpt (JuicyTalk's MiniGPT), hf:<model_type or config path> (a transformers causal "
       "LM from its config) or py:<module>:<callable> (your factory); trials/models."),
    _f("vocab", "int", "Vocabulary size (hf and py models: the model's, where the spec left it unset)."),
    _f("d_model", "int", "Hidden size (hf: hidden_size; the config's where the spec left it unset)."),
    _f("n_layers", "int", "Transformer blocks (hf: num_hidden_layers)."),
    _f("n_heads", "int", "Attention heads (MiniGPT default d_model/64; hf: num_attention_heads)."),
    _f("ffn", "int", "MLP hidden size (MiniGPT default 4*d_model; hf: the type's own name for it, intermediate_size, "
       "ffn_dim, n_inner, ...; MoE types: every expert's and the shared expert's too), read back from the model."),
    _f("seq_len", "int", "Tokens per sequence."),
    _f("batch_size", "int", "Sequences per micro-batch, per rank (one step is grad_accum micro-batches on each rank)."),
    _f("grad_accum", "int", "Micro-batches per optimizer step (gradient accumulation; default 1): each rank runs "
       "grad_accum forward+backward passes of batch_size rows, the loss of each divided by grad_accum, then one "
       "optimizer step; DDP (no_sync) and FSDP2 (set_requires_gradient_sync(False)) reduce gradients on the last "
       "micro-batch only; TE casts its FP8 weights on the first (is_first_microbatch). A step, its time and its "
       "tokens are the optimizer step's."),
    _f("arch", "str", "Architecture: gpt (the tutorial's MiniGPT) or llama (RMSNorm, SwiGLU, GQA, RoPE, no biases)."),
    _f("n_kv_heads", "int", "Key/value heads (grouped-query attention, llama; hf: num_key_value_heads); null: n_heads."),
    _f("backend", "str", "Requested backend: auto, te, torch or torchao (trials/backends)."),
    _f("precision", "str", "Requested precision: fp32, bf16 or fp8."),
    _f("recipe", "str", "Requested FP8 recipe: te delayed, current, block, mxfp8, nvfp4; torchao tensorwise, rowwise, "
       "rowwise_with_gw_hp; meaningful for fp8 only."),
    _f("fp8_format", "str", "FP8 format: hybrid (E4M3 fwd / E5M2 bwd) or e4m3."),
    _f("amax_history_len", "int", "Delayed scaling: amax history length."),
    _f("amax_compute_algo", "str", "Delayed scaling: max or most_recent."),
    _f("te_layer", "str", "How TE takes the model. MiniGPT: transformer_layer (one fused te.TransformerLayer per "
       "block, the default) or modules (te.LayerNormLinear, te.DotProductAttention, te.Linear, te.LayerNormMLP). "
       "hf and py models, converted (trials/backends/te_convert.py): swap (nn.Linear, nn.LayerNorm and RMSNorm "
       "modules -> te.Linear, te.LayerNorm, te.RMSNorm; the default) or transformer_layer (each transformers "
       "llama/mistral/qwen2 decoder layer -> one te.TransformerLayer with its weights)."),
    _f("weights", "str", "Inference weights: bf16 (high precision) or fp8 (TE's quantized_model_init, torchao's quantize_; fp8 "
       "cells only)."),
    _f("cuda_graphs", "bool", "Forward+backward captured as CUDA graphs and replayed (train: MiniGPT's whole forward, "
       "any other model each unit, its root eager: trials/workloads/unit_graphs.py; infer: the decode step)."),
    _f("cuda_graphs_why", "str", "train, cuda_graphs cells: what runs outside the graphs, or, where nothing was "
       "graphed (graphs_per_step 0: a model without units, a unit holding MoE experts, a unit called more than once "
       "per forward), why, and that the step ran eager."),
    _f("graphs_per_step", "int", "train, cuda_graphs cells: CUDA graphs replayed per optimizer step (a forward and a "
       "backward graph per unit, or of the whole forward, once per micro-batch); 0 where nothing was graphed."),
    _f("graph_capture_s", "float", "train, cuda_graphs cells: seconds to capture the graphs (part of setup_s): their "
       "warm-up passes, and for unit graphs the forward that records how each unit is called (compile: true cells: "
       "their compiling too, which eager compiled cells hold in first_step_s)."),
    _f("graph_pool_bytes", "int", "train, cuda_graphs cells: bytes the allocator holds in CUDA graphs' private memory "
       "pools once the capture is done (what the graphs keep between replays; est_graph_pool_bytes plans it)."),
    _f("graph_pool_free_bytes", "int", "train, cuda_graphs cells: of graph_pool_bytes, those free to the allocator "
       "(freed during the capture: what the graphed forwards save for backward, temporaries), which every replay "
       "writes and no other tensor may use; peak_mem_allocated_bytes never counts them, so a graphed cell holds "
       "its peak plus these."),
    _f("compile", "bool", "The model ran torch.compile'd (torch and torchao backends): each unit (decoder layer) "
       "where the model has units, as torchtitan compiles, else the whole model; compiling is in first_step_s."),
    _f("world_size", "int", "Ranks (GPUs; CPU: processes) the trial spans; batch_size is per rank."),
    _f("parallel", "str", "How the ranks split the model: none, ddp (DistributedDataParallel) or fsdp (FSDP2, one "
       "unit per decoder layer, as the model source names them, and the root)."),
    _f("fp8_all_gather", "bool", "FSDP2 all-gathers the FP8 weights (torchao tensorwise: "
       "enable_fsdp_float8_all_gather; te: FP8 primary weights from quantized_model_init, trained by FusedAdam's "
       "fp32 masters)."),
    _f("activation_checkpointing", "str", "none, full (every unit recomputed in backward) or selective (every "
       "ac_every-th unit); units: the model's decoder layers, FSDP2's units (trials/parallel/checkpointing.py)."),
    _f("ac_every", "int", "Selective activation checkpointing: every ac_every-th unit is recomputed (default 2)."),
    _f("model_units", "int", "Units the model splits into (its decoder layers, as its source names them): FSDP2 "
       "shards each, activation checkpointing recomputes them; null where the trial needed none."),
    _f("checkpointed_units", "int", "Units recomputed in backward (activation_checkpointing)."),
    _f("saved_activation_bytes", "int", "Bytes held for backward by one micro-batch's forward (this rank): distinct "
       "storages packed by torch.autograd.graph.saved_tensors_hooks during the first (untimed) step, parameters "
       "excluded, checkpointed units' inputs included; null for compiled cells (hooks in Dynamo's regions break "
       "them)."),
    _f("optimizer", "str", "The optimizer when not torch's AdamW (te with fp8_all_gather: FusedAdam, fp32 masters)."),
    _f("workload", "str", "train (training steps) or infer (prefill + KV-cached decode)."),
    _f("train_steps", "int", "Training steps before the benchmark."),
    _f("lr", "float", "AdamW learning rate."),
    _f("warmup_steps", "int", "Untimed steps before the timed blocks."),
    _f("bench_steps", "int", "Timed steps per repeat."),
    _f("repeats", "int", "Timed blocks of bench_steps steps."),
    _f("gen_len", "int", "Tokens decoded greedily in the generation check (infer: tokens generated per request)."),
    _f("prompt_len", "int", "Prompt tokens for the generation check (infer: the prefill length)."),
    _f("seed", "int", "Seed of weights and data."),
    _f("profile", "bool", "A few steps profiled after timing for the kernel breakdown (kernel_ms_* fields)."),
    _f("fp8_reads", "bool", "fp8 training cells: the per-layer FP8 reads (sqnr_*, cast_*, outlier_* and fp8_layers "
       "fields; trials/measure/fp8_layers.py) run; false: none of them. The timed steps and losses are the same either way."),
    _f("device", "str", "Requested device: auto, cuda or cpu."),
    # -- what actually ran
    _f("effective_device", "str", "Device the trial ran on."),
    _f("effective_backend", "str", "Backend that ran (te or torch); empty when unsupported."),
    _f("effective_precision", "str", "Precision that ran; empty when unsupported. An fp8 cell whose stack converted "
       "no module, or ran under trials.measure.metrics.FP8_MIN_SHARE (5%) of its step's FLOPs in FP8 GEMMs "
       "(fp8_flop_share), ran bf16 (fp32 cells never ask for FP8): it is not an FP8 result and the report never pairs "
       "it as one (trials.measure.metrics.fp8_ran)."),
    _f("effective_recipe", "str", "FP8 recipe that ran; empty for non-fp8 cells."),
    _f("fp8_recipe_repr", "str", "TE's repr of the recipe object used."),
    _f("te_torch_compile", "bool", "TE's torch.compile'd element-wise fusers on (NVTE_TORCH_COMPILE, TE's default: on)."),
    _f("torchao_version", "str", "torchao version (torchao backend)."),
    _f("fp8_converted_modules", "int", "Modules a stack converted: torchao fp8, the Linears now Float8Linear; te on "
       "hf and py models (every precision), the modules TE now runs (te_layer swap: Linears and norms; "
       "transformer_layer: decoder layers)."),
    _f("fp8_filter", "str", "torchao fp8: which Linears convert: dims (all but the logits layer and dims not multiples "
       "of 16) or auto (torchao's own small-layer filter for the recipe, the logits layer kept too)."),
    _f("fp8_converted_names", "str", "JSON list of the modules in fp8_converted_modules (qualified names)."),
    _f("fp8_skipped_modules", "str", "JSON list of the modules a conversion kept as they were, in BF16 (FP32 on fp32 "
       "cells): the layer that makes the logits, dims not multiples of 16, weights tied to another module "
       "(te), decoder layers transformer_layer cannot map (te); torchao: every other module holding GEMM weights "
       "too (MoE experts, GPT-2's Conv1D, MoE routers), see fp8_skipped_why."),
    _f("fp8_skipped_why", "str", "torchao fp8: JSON object, each module of fp8_skipped_modules -> why it stayed in "
       "high precision."),
    _f("fp8_flop_share", "float", "Share of flops_per_step that ran in FP8 GEMMs (training cells); attention's term "
       "never counts; 0 on bf16/fp32 cells. torch and torchao on hf and py models: counted with it, a GEMM with FP8 "
       "operands counts. te on hf and py models: counted on the model before TE converts it, the GEMMs of the "
       "Linears TE then runs in FP8 (swap: the converted Linears; transformer_layer: the q/k/v/o and gate/up/down "
       "projections of each converted decoder layer; the logits layer stays BF16), forward and backward, each "
       "charged to the Linear whose forward made it (a weight read without calling its Linear stays BF16: TE's "
       "module there never runs). te on MiniGPT: its formula's share of the blocks (every block GEMM; the LM head "
       "BF16). torchao on MiniGPT: its formula's share of the Linears torchao converted (fp8_converted_names). "
       "Decides effective_precision."),
    # -- model size and work
    _f("model_class", "str", "The model's class (MiniGPT, LlamaForCausalLM, your factory's module)."),
    _f("model_config", "str", "JSON: the model's resolved config (transformers' to_json_string for hf models, the "
       "shape fields everywhere else), the values the trial built."),
    _f("head_dim", "int", "The model's attention head width (hf: the config's head_dim where its type has one, "
       "which follows d_model / n_heads when the spec sets either; multi-head latent attention's query width, "
       "qk_nope_head_dim + qk_rope_head_dim; else d_model / n_heads)."),
    _f("config_defaults", "str", "JSON {config name: value}: the model's size values that came from transformers' "
       "config defaults, neither the sweep nor the config file (a bare hf:llama's intermediate_size 11008, a "
       "config.json without vocab_size's 32000); {} when none did; null for MiniGPT and py: factories."),
    _f("attn_implementation", "str", "hf: the attention transformers built the model with: sdpa, or eager for a type "
       "without an SDPA path (gemma2, bloom); null for MiniGPT and py: factories."),
    _f("n_params", "int", "All parameters (embeddings included; tied ones once)."),
    _f("n_matmul_params", "int", "Weights in matrix products (blocks + LM head), N in the FLOP formula (MiniGPT)."),
    _f("tokens_per_step", "int", "batch_size * seq_len * grad_accum * world_size (the global batch of one optimizer "
       "step). As a spec field (requested), it sizes the per-rank micro-batch: batch_size = tokens_per_step / "
       "(seq_len * grad_accum)."),
    _f("flops_per_step", "float", "6*N_matmul*tokens + 6*n_layers*seq_len*d_model*tokens (causal attention; "
       "N_matmul follows the arch: GQA's narrower K/V, SwiGLU's third GEMM, the LM head at the full vocabulary); "
       "hf and py models: counted, see flops_method (te on them: counted on the model before TE converts it). "
       "The model's work, not the schedule's: the forward activation checkpointing re-runs is not in it."),
    _f("flops_method", "str", "How flops_per_step was obtained: analytic (MiniGPT's formula) or counted "
       "(torch.utils.flop_counter.FlopCounterMode over one eager forward+backward before training: the GEMMs with "
       "a weight operand; attention kernels and GEMMs between two activations, eager attention's, left out; a "
       "checkpointed unit's recompute left out; plus causal attention 6*n_layers*seq_len*heads*head_dim*tokens as "
       "in the formula, whichever attention implementation ran) or counted-gemms-only (a py: model whose layers "
       "and width are unknown: no attention term)."),
    # -- training
    _f("loss_first", "float", "Loss of the first training step."),
    _f("loss_final", "float", "Loss of the last training step."),
    _f("loss_curve", "list[float]", "Loss at every training step (grad_accum > 1: the mean of its micro-batches')."),
    _f("bench_loss_final", "float", "Loss of the last timed step (the model keeps training); several ranks: "
       "the global batch's, the mean of the ranks' losses (as loss_curve)."),
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
    _f("tokens_per_s", "float", "tokens_per_step / mean step time (all ranks)."),
    _f("tokens_per_s_per_gpu", "float", "tokens_per_s / world_size."),
    _f("rank_peak_mem_min_bytes", "int", "Multi-rank: the smallest rank's torch.cuda.max_memory_allocated."),
    _f("rank_peak_mem_max_bytes", "int", "Multi-rank: the largest rank's torch.cuda.max_memory_allocated."),
    _f("nccl_version", "str", "Multi-rank on GPUs: NCCL version torch uses."),
    _f("interconnect", "str", "Multi-rank: where the ranks ran (same host, or how many hosts)."),
    _f("model_tflops", "float", "flops_per_step / mean step time, TFLOP/s."),
    _f("peak_tflops_bf16", "float", "Dense BF16 datasheet peak of this GPU (null if unknown)."),
    _f("peak_tflops_precision", "float", "Dense datasheet peak of the precision that ran, effective_precision (an "
       "fp8 cell that ran BF16: BF16's; null if unknown)."),
    _f("mfu_bf16_peak", "float", "model_tflops / (peak_tflops_bf16 * world_size)."),
    _f("mfu_precision_peak", "float", "model_tflops / (peak_tflops_precision * world_size)."),
    _f("host_ms_per_step", "float", "Host time to issue one step from an idle GPU, ms (null on CPU); a large step's "
       "includes back-pressure (the launch queue full, the host waiting on the GPU), so it can near step_ms_p50 while "
       "the GPU is busy: launch_bound reads it only without a profile."),
    _f("launch_bound", "bool", "The GPU idled >= 20% of the step waiting on the host: kernel_gap_ms >= 0.2 * "
       "step_ms_p50 where the kernel breakdown ran, else host_ms_per_step >= 0.8 * step_ms_p50 (launch_bound_by "
       "says which; trials/measure/bench.py; null on CPU)."),
    _f("launch_bound_by", "str", "The rule that decided launch_bound: kernel_gap (the profiler's gap) or host_issue "
       "(no profile: profile: false, or the profiler failed); null on CPU."),
    # -- what else ran while the steps were timed (trials/measure/disturbance.py): null where /proc or NVML cannot tell
    _f("timing_wait_share", "float", "Over the timed steps: the share of the time the trial process's threads "
       "wanted a CPU that they waited for one on a run queue (Linux schedstat; 0: never waited). Several ranks: the "
       "largest rank's."),
    _f("timing_foreign_cpu_share", "float", "Over the timed steps: other processes' CPU time as a share of the "
       "host's core-seconds (/proc/stat's busy time less the trial's own: its process tree's and, multi-rank, its "
       "other ranks' on this host with theirs; null under 0.2 core-seconds, where 10 ms jiffies are too coarse). "
       "Several ranks: the largest rank's."),
    _f("timing_load_1m", "float", "The host's 1-minute load average at the end of the timed steps (several "
       "ranks: the largest rank's)."),
    _f("timing_foreign_gpu_processes", "str", "GPU trials: JSON list of the other compute processes (pid, "
       "used_bytes) NVML saw on the trial's GPU at the start or end of the timed steps ([]: none; null: a CPU "
       "trial, or NVML could not tell, e.g. it listed no process at all, not even the trial's own). Several ranks: "
       "every rank's GPU, each entry with its rank; null where none was seen and a rank could not tell."),
    _f("timing_disturbed", "bool", "Something else took the trial's CPU or GPU while its steps were timed: its "
       "threads waited for a CPU >= 20% of the time (timing_wait_share), or another compute process shared its GPU. "
       "Several ranks: any rank's (null where none was and a rank could not tell)."),
    _f("timing_disturbed_why", "str", "What disturbed the timed steps, in words (null: nothing seen); several "
       "ranks: each rank's, as 'rank N: ...'."),
    _f("timing_gc_ms_per_step", "float", "Training: ms per timed step the trial's host spent in Python's garbage "
       "collector (its own pauses, not another process's; a launch-bound step waits on them in full). Several "
       "ranks: the largest rank's."),
    _f("timing_gc_full_collections", "int", "Training: full (generation 2) garbage collections during the timed "
       "steps; each walks every Python object of the process (~0.1 s with torch and transformers loaded). Several "
       "ranks: the largest rank's."),
    # -- energy, power and clocks (trials/measure/energy.py): a window of its own right after timing
    _f("energy_window_s", "float", "Length of the energy window: the timed step (infer: a whole generation) repeated "
       "for at least 1 s, edges on ticks of NVML's energy counter, s."),
    _f("energy_window_calls", "int", "Steps (infer: generations) in the energy window."),
    _f("energy_j_per_step", "float", "Board energy per step, every GPU of the step: each rank's board over the "
       "same window, summed (infer: per generation, prefill included), J."),
    _f("tokens_per_j", "float", "Tokens per joule: tokens_per_step (the global batch; infer: batch_size * gen_len "
       "generated tokens) / energy_j_per_step."),
    _f("power_mean_w", "float", "Mean board power over the energy window (energy / window length), W. This and the "
       "power and clock fields below are one board's: rank 0's where several ranks ran."),
    _f("power_max_w", "float", "Highest sampled power draw in the window, W."),
    _f("sm_clock_mean_mhz", "float", "SM clock over the window, sampled every 20 ms, mean, MHz."),
    _f("sm_clock_min_mhz", "int", "Lowest sampled SM clock in the window, MHz."),
    _f("sm_clock_max_mhz", "int", "The GPU's maximum SM clock, MHz."),
    _f("power_limit_w", "float", "Power limit in force (NVML's enforced limit), W."),
    _f("clock_limits", "str", "Clock-event reasons seen in the window, group:name comma-separated (power:sw_power_cap, "
       "thermal:hw_thermal, other:...; empty: none; GPU idle is not listed)."),
    _f("energy_gpu_shared", "bool", "Another process used the GPU at the end of the window (energy is board-wide)."),
    _f("energy_why", "str", "Why the energy fields are null (CPU trial, NVML or its counter missing, on this rank "
       "or, for energy_j_per_step and tokens_per_j, another)."),
    # -- where the step goes (trials/measure/kernels.py): a few steps profiled after timing (infer: per decode step)
    *[_f(f"kernel_ms_{c}", "float", f"Kernel time per step in class {c}: {doc}, ms (CPU: aten operators' self time "
         "scaled to the timed step by the profiled step's wall clock).")
      for c, doc in CLASSES.items()],
    _f("kernel_ms_total", "float", "All kernel time per step (the classes' sum), ms; more than the GPU's busy time "
       "where streams overlap (a multi-rank cell's collectives beside its compute)."),
    _f("kernel_gap_ms", "float", "step_ms_p50 (infer: decode_ms_per_token_p50) less the time per step at least one "
       "kernel ran (on GPUs the union of the kernels' intervals over all streams, so a collective overlapping the "
       "compute counts once; kernel_ms_total where nothing overlaps): on GPUs the GPU idle within a step (waiting "
       "on the host), negative within the profiler's noise; on CPU host time outside aten operators (Python, the "
       "optimizer's loop)."),
    _f("profile_steps", "int", "Steps profiled (infer: generations, and as many prefills)."),
    _f("profile_s", "float", "Wall time of the profiled steps, profiler start-up included, s."),
    _f("kernel_table", "str", "JSON list of the step's largest kernels: name, class, ms per step, calls per step."),
    _f("breakdown_why", "str", "Why the kernel breakdown is null (profile: false, a failure of the profiler)."),
    _f("compiled_calls_per_step", "float", "compile: true cells: compiled graphs run per profiled step (Dynamo's "
       "'Torch-Compiled Region' profiler events): one per compiled unit, more where graphs broke; null where the "
       "cell is not compiled or not profiled."),
    _f("compiled_eager_why", "str", "Why a compile: true cell's step time is not a compiled one: its profiled steps "
       "ran fewer compiled graphs than units (code Dynamo gave up on runs eager, unflagged by the step time); null "
       "where they all ran."),
    # -- inference (workload infer)
    _f("prefill_times_ms", "list[float]", "infer: every timed prefill (prompt_len tokens x batch), ms."),
    _f("decode_times_ms", "list[float]", "infer: every timed decode step (one token per row), ms."),
    _f("prefill_ms_p50", "float", "infer: median prefill time, ms."),
    _f("prefill_ms_p90", "float", "infer: 90th percentile prefill time, ms."),
    _f("decode_ms_per_token_p50", "float", "infer: median decode step, ms per generated token (per row)."),
    _f("decode_ms_per_token_p90", "float", "infer: 90th percentile decode step, ms."),
    _f("prefill_tokens_per_s", "float", "infer: batch_size * prompt_len / mean prefill time."),
    _f("decode_tokens_per_s", "float", "infer: batch_size / mean decode step time."),
    _f("decode_rows", "int", "infer: rows decoded (batch_size; FP8 cells round it up to their stack's fp8_rows: te 8, torchao 16)."),
    _f("weight_bytes", "int", "infer: device memory the inference model's weights take (FP8 data and scales "
       "included; storage size on CPU)."),
    _f("kv_cache_bytes", "int", "infer: the KV cache's memory (rows x positions x layers x K and V): MiniGPT's "
       "preallocated buffers; a transformers model's DynamicCache after a generation (prompt_len + gen_len - 1), "
       "its preallocated StaticCache with cuda_graphs (prompt_len + gen_len)."),
    _f("peak_decode_mem_bytes", "int", "infer: peak allocated device memory over the timed generations."),
    _f("gen_match_rate", "float", "infer, fp8 cells: share of greedy tokens equal to the BF16 model's (the same "
       "trained weights, the same prompts). Secondary: one early divergence ruins it (see tf_top1_agreement)."),
    _f("ref_stride_accuracy", "float", "infer: stride accuracy of the BF16 reference generation."),
    # -- memory
    _f("peak_mem_allocated_bytes", "int", "torch.cuda.max_memory_allocated over the trial (infer: the BF16 "
       "training, the reference and the served model included; peak_decode_mem_bytes is the timed generations' "
       "own)."),
    _f("peak_mem_reserved_bytes", "int", "torch.cuda.max_memory_reserved over the trial (infer: as "
       "peak_mem_allocated_bytes)."),
    _f("nvml_process_mem_bytes", "int", "Device memory NVML charges to the trial process (null where NVML can't tell)."),
    _f("num_ooms", "int", "Allocator OOMs during the trial (torch.cuda.memory_stats, reset at its start: an earlier "
       "trial of a warm process is not counted)."),
    _f("num_alloc_retries", "int", "Allocator retries after freeing cache during the trial (memory pressure; reset "
       "at its start)."),
    _f("mem_at_start_bytes", "int", "Device memory still allocated when the trial started (0 in a fresh process; "
       "what an earlier trial in the same process left)."),
    _f("peak_rss_bytes", "int", "Peak resident host memory of the trial process during the trial (Linux VmHWM, "
       "reset at trial start; null where it cannot be reset)."),
    _f("est_peak_mem_bytes", "int", "train: the memory plan's peak for one rank (trials/measure/memory_plan.py: weights, grads, "
       "optimizer state, activations under the cell's checkpointing, logits and loss, FSDP2 sharding), from the module "
       "run once under fake tensors; beside peak_mem_allocated_bytes (the report shows their ratio)."),
    _f("est_activation_bytes", "int", "train: the memory plan's activations: bytes saved for backward at the cell's "
       "batch (one micro-batch) and seq (null where the module cannot run under fake tensors and the plan is a guess); "
       "cuda_graphs cells: what the eager part saves (the graphs' saved bytes are in est_graph_pool_bytes)."),
    _f("est_graph_pool_bytes", "int", "train, cuda_graphs cells: the memory plan's graph pool (in est_peak_mem_bytes): "
       "the graphs' static inputs and outputs, what the graphed forwards save and the graphed parameters' gradients, "
       "all held at once; beside the measured graph_pool_bytes (null where the plan is a guess)."),
    # -- numerics
    _f("fp8_state", "str", "JSON: scale, newest and max amax of block 0's FP8 tensors (delayed scaling; a model TE "
       "converted: of its first four modules TE scales)."),
    _f("gen_tokens", "list[int]", "First prompt and its greedy continuation."),
    _f("gen_stride_accuracy", "float", "Share of generated steps that keep the prompt's stride (8 prompts)."),
    _f("tf_top1_agreement", "float", "train, fp8 cells: teacher-forced, on one held sequence, every position, the share "
       "where the FP8 model's next-token argmax equals its BF16 partner's (the bf16_partner stack, same seeded init, "
       "same batches and steps; trials/workloads/teacher_forced.py). Meaningful only where BF16 is decided "
       "(tf_decided_share): on a nearly flat distribution argmax is noise. infer, fp8 cells: the served model against "
       "its BF16 reference (the same trained weights) through the KV cache, on every prefill position and on decode "
       "steps fed the reference's greedy tokens; the other tf fields are over those positions too."),
    _f("tf_kl_mean", "float", "train, those fp8 cells: mean over the held sequence's positions of KL(FP8 || BF16) "
       "of the next-token distributions, nats (0: identical)."),
    _f("tf_bf16_top1_prob", "float", "train, those fp8 cells: the BF16 partner's own confidence, the mean over the "
       "held positions of the probability of its argmax (1/vocab: a flat distribution)."),
    _f("tf_decided_share", "float", "train, those fp8 cells: share of held positions where BF16 is decided, its top-1 "
       "log-probability at least trials.workloads.teacher_forced.DECIDED_MARGIN nats above the runner-up's."),
    _f("tf_top1_agreement_decided", "float", "train, those fp8 cells: tf_top1_agreement over the positions where BF16 "
       "is decided only (null where it is decided nowhere)."),
    _f("tf_s", "float", "Training the BF16 partner and comparing (infer: the served model's teacher-forced read), "
       "s (after the cell's own timing and memory)."),
    _f("tf_partner_reused", "bool", "train, those fp8 cells: the BF16 partner was not trained again: an earlier FP8 "
       "cell in the same trial process trained the same partner (same model, seed and schedule; delayed and current "
       "scaling share one) and its read was taken (trials/teacher_forced.Partners)."),
    # -- per-layer FP8 numerics (trials/measure/fp8_layers.py, docs/guide/numerics.md): fp8 training cells with fp8_reads
    *[_f(f"sqnr_{d}_{stat}", typ, f"fp8 train: {what} of every FP8 module read (fp8_layers_read) against the same "
         f"module in BF16 on the same input and upstream gradient (one held batch, after the timed steps): {sdoc}.")
      for d, what in (("fwd", "SQNR of the output"), ("dgrad", "SQNR of the input gradient"),
                      ("wgrad", "SQNR of the weight gradient"))
      for stat, typ, sdoc in (("min_db", "float", "the lowest over modules, dB (-inf: a module whose FP8 result "
                                           "held a NaN or inf)"),
                              ("median_db", "float", "the median over modules, dB"),
                              ("worst", "str", "the module with the lowest"))],
    *[_f(f"cast_{kind}_{cls}{tail}", typ, f"fp8 train: {cdoc}, cast to FP8 under the scale the recipe casts them with "
         f"(TE delayed scaling: the scales the last training step left): {kdoc}{tdoc}.")
      for cls, cdoc in (("act", "GEMM inputs (activations)"), ("weight", "GEMM weights"),
                        ("grad", "output gradients"))
      for kind, kdoc in (("underflow", "the largest share, over FP8 modules, of elements flushed to zero "
                                       "(nonzero, cast to 0)"),
                         ("saturation", "the largest share, over FP8 modules, of elements saturated (|x * scale| "
                                        "above the format's maximum)"))
      for tail, typ, tdoc in (("", "float", ""), ("_worst", "str", "; the module with it"))],
    _f("outlier_ratio_max", "float", "fp8 train: the largest max|x| / rms over the FP8 modules' inputs at the last "
       "outlier sample (the held batch, after the last training step)."),
    _f("outlier_ratio_worst", "str", "fp8 train: the module whose input has outlier_ratio_max."),
    _f("outlier_kurtosis_max", "float", "fp8 train: the largest kurtosis (E[(x-mean)^4]/var^2, 3 for a Gaussian) over "
       "the FP8 modules' inputs at the last outlier sample."),
    _f("fp8_layers", "str", "fp8 train: JSON of every per-layer value: modules, sqnr per direction, cast shares per "
       "operand class, outlier samples (steps, ratio and kurtosis per module), the SQNR floors; the report draws it."),
    _f("fp8_layers_read", "int", "fp8 train: the FP8 modules the per-layer read read (sqnr_*, cast_* and fp8_layers "
       "are of these only); under fp8_layers_total where a module saw no forward or no gradient on the held batch, "
       "or ran twice in one forward (a shared module); 0 where the read failed."),
    _f("fp8_layers_total", "int", "fp8 train: the FP8 modules the model runs (the stack's numerics seam finds them), "
       "of which fp8_layers_read were read."),
    _f("fp8_layers_s", "float", "fp8 train: the per-layer SQNR and cast-health read, after the timed steps, s."),
    _f("outliers_s", "float", "fp8 train: the outlier samples between training steps, s (inside train_s, never inside "
       "the timed steps)."),
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
    _f("git_sha", "str", "Commit of the juicytalk source when it runs from its own git checkout (-dirty: tracked files "
       "were edited); else its version and a hash of its sources, e.g. 0.3.0+src.1a2b3c4d5e6f."),
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
    _f("first_step_s", "float", "The first training step alone, synced: TE's fuser compiles, cuDNN plans and "
       "torch.compile (compile: true), s."),
    _f("train_s", "float", "Training steps, s."),
    _f("bench_s", "float", "Warmup, host probe and timed blocks, s (infer: inference models, generations)."),
    _f("gen_s", "float", "Generation check, s."),
]

# Fields the orchestrator adds to each trial record (on the worker, or decided by the driver).
ORCHESTRATOR_FIELDS: list[Field] = [
    _f("sweep_name", "str", "Sweep the trial belongs to.", "driver"),
    _f("cell_id", "str", "Stable id of the cell (hash of its full spec).", "driver"),
    _f("cell_label", "str", "Readable cell name, e.g. d768-L4-te-fp8-delayed.", "driver"),
    _f("sample", "int", "Sample index within the cell (0..samples-1).", "driver"),
    _f("trial_id", "str", "Ray Tune trial id.", "worker"),
    _f("node_id", "str", "Ray node the trial ran on.", "worker"),
    _f("node_ip", "str", "IP address of that node.", "worker"),
    _f("worker_pid", "int", "Ray worker process that supervised the trial.", "worker"),
    _f("cuda_visible_devices", "str", "GPUs Ray gave the trial.", "worker"),
    _f("gpu_mem_in_use_at_start_bytes", "int", "Device memory already in use on the trial's GPU when it started "
       "(a warm trial process's own context and cache included).", "worker"),
    _f("foreign_gpu_processes", "str", "JSON list of other processes on the trial's GPU at start (pid, bytes); the "
       "sweep's own trial process is not listed.", "worker"),
    _f("ray_version", "str", "Ray version of the worker.", "worker"),
    _f("trial_wall_s", "float", "The worker's view of the trial: spec handed over (or trial process spawned, when "
       "none was ready) to record back, s.", "worker"),
    _f("launcher", "str", "How the trial ran: process (a fresh process) or warm (a process that runs many "
       "trials).", "worker"),
    _f("recorded_at", "str", "UTC time the record was written.", "worker"),
    _f("run_id", "str", "The `juicytalk sweep` invocation that produced the record (a resumed sweep is a new run).",
       "driver"),
    _f("run_started_at", "str", "UTC start of that run.", "driver"),
    _f("run_gpus", "int", "GPUs in the Ray cluster that run used (0: no GPU, CPU fallback).", "driver"),
]

ALL_FIELDS: list[Field] = FIELDS + ORCHESTRATOR_FIELDS
FIELD_NAMES = [f.name for f in FIELDS]  # what run_trial returns
_BY_NAME = {f.name: f for f in ALL_FIELDS}


class RecordError(ValueError):
    """A record holds an undeclared field or a value of the wrong type; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"record field {field_name}: {message}")
        self.field = field_name


def validate(record: Mapping[str, Any]) -> None:
    """Every key declared, every value of its declared type (or None); raises :class:`RecordError`."""
    for name, value in record.items():
        field = _BY_NAME.get(name)
        if field is None:
            raise RecordError(name, "not a declared record field (declare it in trials/record/fields.py)")
        if value is not None and not matches(value, field.type):
            raise RecordError(name, f"must be {field.type}, got {type(value).__name__} {str(value)[:60]!r}")


def field_table() -> str:
    """The field table of docs/guide/record-fields.md, generated from the declaration."""
    rows = ["| field | type | set by | meaning |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.type} | {f.layer} | {f.doc} |" for f in ALL_FIELDS]
    return "\n".join(rows) + "\n"


def empty_record() -> dict[str, Any]:
    """Every field present (None where not measured), so all records share one shape."""
    record: dict[str, Any] = {name: None for name in FIELD_NAMES}
    record["schema_version"] = SCHEMA_VERSION
    return record
