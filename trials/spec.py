"""TrialSpec: one cell of a sweep, validated when it is built.

Every bad value raises :class:`SpecError` naming the field and what is allowed, so the CLI and the
sweep loader can turn it into one clear line and exit status 2 before any trial starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from .backends import BACKENDS, RECIPES, STACKS, fp8_stacks, layer_refusal, recipe_owner
from .models import DEFAULT_MODEL, SOURCES, ModelError, Source
from .models import parse as parse_model
from .typecheck import WANTED, matches

PRECISIONS = ("fp32", "bf16", "fp8")
FP8_FORMATS = ("hybrid", "e4m3")
AMAX_ALGOS = ("max", "most_recent")
DEVICES = ("auto", "cuda", "cpu")
ARCHS = ("gpt", "llama")  # gpt: the tutorial's MiniGPT; llama: RMSNorm, SwiGLU, GQA, RoPE, no biases
# How TE takes the model, per source (trials/models): MiniGPT's blocks as one fused te.TransformerLayer or TE's
# modules composed; any other model converted (te_convert: swap its Linears and norms, or transformer_layer)
TE_LAYERS = tuple(dict.fromkeys(layer for source in SOURCES.values() for layer in source.te_layers))
WORKLOADS = ("train", "infer")  # what a trial measures: training steps, or prefill + KV-cached decode
WEIGHTS = ("bf16", "fp8")  # how an inference model stores its weights (fp8: TE's quantized_model_init, torchao's quantize_)
PARALLEL = ("none", "ddp", "fsdp")  # how a trial's ranks split the model: not at all, DDP, FSDP2 (trials/parallel/ranks.py)
# torchtitan's names: full recomputes every unit (decoder layer) in backward, selective every ac_every-th
# (trials/parallel/checkpointing.py); the units are FSDP2's (the model source says what they are, trials/models)
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
# a rank that stops makes the others' collectives fail after this, not hang (trials/parallel/ranks.py); here, not
# there, so that a multi-rank trial's launcher reads it without importing torch
COLLECTIVE_TIMEOUT_S = 300
HEAD_DIM_MULTIPLE = 8  # fused attention kernels (and TE) need head dims in multiples of 8
FP8_FILTERS = ("dims", "auto")  # torchao: which Linears go FP8 (dims: all but the logits layer and dims not /16;
                                # auto: torchao's own small-layer filter for the recipe)
# MiniGPT's shape defaults; other model sources take their config's (hf) or their factory's (py) values
OWN_SHAPE_DEFAULTS = {"vocab": 96, "d_model": 768, "n_layers": 4}
# Fields whose default is the model source's (trials/models' table): name -> that default
SOURCE_DEFAULTS: dict[str, Callable[[Source], Any]] = {"te_layer": lambda source: source.te_layers[0]}
HEAD_DIM_TARGET = 64  # a default head is at least this wide (as GPT-2's)...
HEAD_DIM_MAX = 256  # ...and at most this: the widest head TE's fused attention and SDPA's flash kernel take


class SpecError(ValueError):
    """A spec value is not allowed; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        # one line, whatever the message quotes (transformers' config errors carry newlines)
        super().__init__(" ".join(f"{field_name}: {message}".split()))
        self.field = field_name


# Every field belongs to one axis. What a report compares (the *variant*) and what it pairs on and
# plots along (the *shape*, the run *schedule*, the *execution* mode) are read from here, once:
#   shape      the model and the batch: the x-axis and part of the pairing key
#   schedule   how long and how it trains: part of the pairing key (cells must agree to be compared)
#   execution  how the step is issued (CUDA graphs): part of the pairing key, drawn dashed
#   variant    what a speedup compares; ``label`` formats a non-default value in names ("hist{}")
#   run        seeds and devices: never a reason to keep two cells apart in a report
# ``only`` marks a field that means something only for fp8 cells ("fp8"), TE cells ("te"), TE's FP8 cells
# ("te-fp8"), TE's delayed-scaling cells ("te-delayed": the amax history, which current scaling, block and MX
# never read), stacks that compile ("compiles"), stacks with their own FP8 layer filter ("fp8-filter") or
# JuicyTalk's own MiniGPT ("minigpt": a model source with ``own`` shape, trials/models) or selective activation
# checkpointing ("selective-ac") or training ("train": workload train); elsewhere the sweep
# collapses it to its default and variant names leave it out.
AXES = ("shape", "schedule", "execution", "variant", "run")
# ``only``'s
SCOPES = ("fp8", "te", "te-fp8", "te-delayed", "compiles", "fp8-filter", "minigpt", "selective-ac", "train")


def _on(axis: str, default: Any, label: str | None = None, only: str | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"axis": axis, "label": label, "only": only})


@dataclass(frozen=True)
class TrialSpec:
    """What one trial runs: model size, numerics, schedule and device."""

    vocab: int | None = _on("shape", None)  # MiniGPT: OWN_SHAPE_DEFAULTS; hf: the config's; py: the factory's
    d_model: int | None = _on("shape", None)
    n_layers: int | None = _on("shape", None)
    n_heads: int | None = _on("shape", None)  # default: default_n_heads(d_model)
    ffn: int | None = _on("shape", None)  # default 4 * d_model (gpt), SwiGLU's ~8/3 * d_model (llama)
    seq_len: int = _on("shape", 256)
    batch_size: int = _on("shape", 32)  # one micro-batch, per rank
    # micro-batches of batch_size rows per optimizer step (gradient accumulation): a step's batch is their sum
    grad_accum: int = _on("shape", 1, only="train")
    arch: str = _on("shape", "gpt", only="minigpt")
    n_kv_heads: int | None = _on("shape", None)  # GQA key/value heads (llama); default n_heads
    # sizes the batch: batch_size = tokens_per_step / (seq_len * grad_accum), a rank's tokens per optimizer step
    tokens_per_step: int | None = _on("shape", None)
    model: str = _on("shape", DEFAULT_MODEL)  # minigpt | hf:<model_type or config path> | py:<module>:<callable>
    backend: str = _on("variant", "auto")
    precision: str = _on("variant", "bf16")
    recipe: str = _on("variant", "delayed", only="fp8")
    fp8_format: str = _on("variant", "hybrid", "{}", only="te-fp8")
    amax_history_len: int = _on("variant", 16, "hist{}", only="te-delayed")  # delayed scaling's history only
    amax_compute_algo: str = _on("variant", "max", "amax-{}", only="te-delayed")
    te_layer: str | None = _on("variant", None, "{}", only="te")  # default: the model source's first te_layers
    weights: str = _on("variant", "bf16", "{}-weights", only="fp8")
    fp8_filter: str = _on("variant", "dims", "filter-{}", only="fp8-filter")
    # train: forward and backward graphed (MiniGPT's whole forward, other models each unit); infer: the decode step
    cuda_graphs: bool = _on("execution", False)
    compile: bool = _on("execution", False, only="compiles")  # torch.compile of the model (torch, torchao)
    world_size: int = _on("execution", 1)  # GPUs (CPU: processes) one trial spans; batch_size is per rank
    parallel: str = _on("execution", "none")  # none | ddp | fsdp (FSDP2: one unit per block, then the root)
    fp8_all_gather: bool = _on("variant", False, "fp8-all-gather", only="fp8")  # FSDP2 all-gathers FP8 weights
    activation_checkpointing: str = _on("execution", "none")  # none | full | selective (recompute units in backward)
    ac_every: int = _on("execution", 2, only="selective-ac")  # selective: every ac_every-th unit (torchtitan's 2)
    profile: bool = _on("run", True)  # a few steps under torch.profiler after timing: the kernel breakdown
    # fp8 training cells: per-layer SQNR, cast health and outlier samples (trials/measure/fp8_layers.py); false: none of them
    fp8_reads: bool = _on("run", True, only="fp8")
    workload: str = _on("schedule", "train")
    train_steps: int = _on("schedule", 60)
    lr: float = _on("schedule", 3e-4)
    warmup_steps: int = _on("schedule", 10)
    bench_steps: int = _on("schedule", 30)
    repeats: int = _on("schedule", 1)
    gen_len: int = _on("schedule", 24)
    prompt_len: int = _on("schedule", 8)
    seed: int = _on("run", 1234)
    device: str = _on("run", "auto")

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
            object.__setattr__(self, f.name, normalised(f.name, getattr(self, f.name)))
        heads_given = self.n_heads is not None
        for name, default in SOURCE_DEFAULTS.items():  # a field whose default is the model source's (te_layer)
            if getattr(self, name) is None:
                object.__setattr__(self, name, default(self.source))
        if self.source.own:  # MiniGPT's shape defaults; elsewhere a field not given is the model's own
            for name, default in OWN_SHAPE_DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
            if self.n_heads is None:
                object.__setattr__(self, "n_heads", default_n_heads(self.d_model))
            if self.ffn is None:
                object.__setattr__(self, "ffn", swiglu_hidden(self.d_model) if self.arch == "llama" else 4 * self.d_model)
        if self.grad_accum < 1:
            raise SpecError("grad_accum", f"must be a positive integer (micro-batches per optimizer step), got "
                            f"{self.grad_accum}")
        if self.tokens_per_step is not None:
            per_micro = self.seq_len * self.grad_accum
            if self.batch_size != field_default("batch_size") and self.batch_size * per_micro != self.tokens_per_step:
                raise _batch_conflict(self.batch_size, self.seq_len)
            if self.tokens_per_step < 1 or self.tokens_per_step % per_micro:
                what = f"seq_len={self.seq_len}" + (f" x grad_accum={self.grad_accum}" if self.grad_accum > 1 else "")
                raise SpecError("tokens_per_step", f"must be a positive multiple of {what}, got {self.tokens_per_step}")
            object.__setattr__(self, "batch_size", self.tokens_per_step // per_micro)
        self._validate()
        # after _validate: an fp8 cell's d_model error comes first
        if self.d_model is not None and self.n_heads is not None and self.head_dim % HEAD_DIM_MULTIPLE:
            raise SpecError("n_heads" if heads_given else "d_model",
                            f"d_model / n_heads (the head dim) must be a multiple of {HEAD_DIM_MULTIPLE}, "
                            f"got {self.d_model} / {self.n_heads} = {self.head_dim}")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrialSpec":
        """Build from a mapping; unknown names are an error, not silently ignored."""
        known = set(cls.field_names())
        for key in values:
            if key not in known:
                raise SpecError(str(key), f"unknown trial field; allowed: {', '.join(sorted(known))}")
        spec = cls(**dict(values))
        # a batch_size given is given even at its default, which __post_init__ cannot tell from one left out: where
        # tokens_per_step sizes the batch otherwise, the two disagree (batch_size: 32 ran batch 4 without a word)
        if values.get("batch_size") is not None and spec.tokens_per_step is not None \
                and values["batch_size"] != spec.batch_size:
            raise _batch_conflict(values["batch_size"], spec.seq_len)
        return spec

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    def replace(self, **changes: Any) -> "TrialSpec":
        base = self.to_dict()
        if "d_model" in changes or "arch" in changes:  # derived defaults follow unless given too
            base["n_heads"] = changes.get("n_heads")
            base["ffn"] = changes.get("ffn")
        if "model" in changes:  # so do the source's defaults
            for name in SOURCE_DEFAULTS:
                base[name] = changes.get(name)
        base.update(changes)
        if base["tokens_per_step"] is not None and "batch_size" not in changes:  # so does the batch it sizes
            del base["batch_size"]  # (grad_accum 4 at tokens_per_step 4096, seq 256: batch 4)
        return TrialSpec.from_dict(base)

    # -- derived ------------------------------------------------------------------------------
    @property
    def source(self) -> Source:
        """Where the model comes from (trials/models): minigpt, hf or py."""
        try:
            return parse_model(self.model).source
        except ModelError as exc:
            raise SpecError("model", str(exc)) from None

    @property
    def head_dim(self) -> int:
        return self.d_model // int(self.n_heads)  # type: ignore[arg-type]

    @property
    def micro_batches(self) -> int:
        """Micro-batches of ``batch_size`` rows in one optimizer step, every rank's: grad_accum x world_size."""
        return self.grad_accum * self.world_size

    @property
    def step_rows(self) -> int:
        """Rows one rank trains on per optimizer step: its grad_accum micro-batches of batch_size."""
        return self.batch_size * self.grad_accum

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch on one rank (batch_size * seq_len): what one forward holds and FP8 GEMMs see."""
        return self.batch_size * self.seq_len

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step, the global batch: batch_size x seq_len x grad_accum x world_size. The one
        rule tokens/s, FLOPs per step, MFU and energy per token follow."""
        return self.micro_tokens * self.micro_batches

    @property
    def kv_heads(self) -> int:
        return int(self.n_heads if self.n_kv_heads is None else self.n_kv_heads)  # type: ignore[arg-type]

    # -- validation -----------------------------------------------------------------------------
    def _validate_source(self) -> None:
        """What the model source supports (trials/models' table): its stacks, workloads and multi-rank trials."""
        source, stack = self.source, STACKS.get(self.backend)
        builders = " or ".join(source.stacks)
        why = f" ({source.why_not})" if source.why_not else ""
        if stack is not None and stack.name not in source.stacks:
            raise SpecError("backend", f"model {self.model} is built by backend {builders}, not {self.backend}{why}")
        if stack is None and self.precision == "fp8" and "te" not in source.stacks:
            raise SpecError("backend", f"fp8 on model {self.model} needs backend "
                            f"{' or '.join(s for s in source.stacks if STACKS[s].recipes)} (auto means te for fp8){why}")
        if self.workload == "infer" and not source.infer:
            raise SpecError("workload", f"infer is built for model "
                            f"{', '.join(m for m, s in SOURCES.items() if s.infer)}, not {self.model}{why}")
        if self.cuda_graphs and not source.graphs_built(self.workload):
            raise SpecError("cuda_graphs", f"is built for workload {self.workload} on model "
                            f"{', '.join(m for m, s in SOURCES.items() if s.graphs_built(self.workload))}, "
                            f"not {self.model} ({source.name}: models graph workload {' or '.join(source.graphs)})")
        if self.parallel != "none" and not source.parallel:
            raise SpecError("parallel", f"multi-rank trials are built for model "
                            f"{', '.join(m for m, s in SOURCES.items() if s.parallel)}, not {self.model}")
        if self.te_layer not in source.te_layers:
            owners = ", ".join(m for m, s in SOURCES.items() if self.te_layer in s.te_layers)
            raise SpecError("te_layer", f"model {self.model} takes {' or '.join(source.te_layers)} "
                            f"(te_layer {self.te_layer} is for model {owners})")
        if self.arch != field_default("arch") and not source.own:
            raise SpecError("arch", f"is MiniGPT's architecture; model {self.model} has its own")
        if self.fp8_filter != field_default("fp8_filter"):
            if self.precision != "fp8" or stack is None or not stack.fp8_filter_auto:
                raise SpecError("fp8_filter", "applies to fp8 cells of backend "
                                f"{' or '.join(s.name for s in STACKS.values() if s.fp8_filter_auto)}")
            if self.recipe not in stack.fp8_filter_auto:
                raise SpecError("fp8_filter", f"{stack.name} has its own filter for recipe "
                                f"{' and '.join(stack.fp8_filter_auto)}, not {self.recipe}")

    def _validate(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("recipe", self.recipe, RECIPES)
        _choice("fp8_format", self.fp8_format, FP8_FORMATS)
        _choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
        _choice("device", self.device, DEVICES)
        _choice("arch", self.arch, ARCHS)
        _choice("te_layer", self.te_layer, TE_LAYERS)
        _choice("workload", self.workload, WORKLOADS)
        _choice("weights", self.weights, WEIGHTS)
        _choice("parallel", self.parallel, PARALLEL)
        _choice("fp8_filter", self.fp8_filter, FP8_FILTERS)
        _choice("activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING)
        for name in ("vocab", "d_model", "n_layers", "n_heads", "ffn", "seq_len", "batch_size", "world_size",
                     "ac_every", "amax_history_len", "train_steps", "bench_steps", "repeats", "prompt_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SpecError(name, f"must be a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "gen_len", "seed"):
            if getattr(self, name) < 0:
                raise SpecError(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise SpecError("lr", f"must be > 0, got {self.lr}")
        if self.d_model is not None and self.n_heads is not None and self.d_model % int(self.n_heads) != 0:
            raise SpecError("n_heads", f"must divide d_model={self.d_model}, got {self.n_heads}")
        if self.n_kv_heads is not None and self.n_kv_heads < 1:
            raise SpecError("n_kv_heads", f"must be a positive integer, got {self.n_kv_heads}")
        if self.n_heads is not None and self.n_heads % self.kv_heads:  # type: ignore[operator]
            raise SpecError("n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.arch == "gpt" and self.source.own and self.kv_heads != self.n_heads:
            raise SpecError("n_kv_heads", "grouped-query attention is part of arch llama; gpt has n_kv_heads = n_heads")
        if self.vocab is not None and self.vocab < 2:
            raise SpecError("vocab", "must be at least 2")
        self._validate_source()
        if self.prompt_len + 1 > self.seq_len:
            raise SpecError("prompt_len", f"must be < seq_len={self.seq_len}, got {self.prompt_len}")
        if self.prompt_len < 2:
            raise SpecError("prompt_len", "must be >= 2 so the prompt shows its stride")
        stack = STACKS.get(self.backend)  # None for auto: te where TE runs, else torch
        if self.precision == "fp8":
            fp8 = stack or STACKS["te"]
            if not fp8.recipes:
                raise SpecError("backend", f"{self.backend} has no FP8 path; fp8 needs backend "
                                f"{' or '.join(fp8_stacks())} (or auto)")
            if self.recipe not in fp8.recipes:
                raise SpecError("recipe", f"{self.recipe} is a {recipe_owner(self.recipe)} recipe; backend "
                                f"{self.backend} takes {', '.join(fp8.recipes)}")
            if self.device == "cpu" and fp8.needs_cuda:
                raise SpecError("device", f"fp8 on {fp8.name} needs a CUDA device; use precision fp32 or bf16 on "
                                "cpu (or backend torchao)")
            dims = ((("d_model", self.d_model), ("ffn", self.ffn),
                     ("n_kv_heads*head_dim", self.kv_heads * self.head_dim))
                    if self.source.own else ())  # other models: torchao keeps Linears with other dims in BF16
            for name, value in (*dims, ("batch_size*seq_len", self.micro_tokens)):
                if value % 16:  # type: ignore[operator]
                    raise SpecError(name, f"fp8 GEMMs need a multiple of 16, got {value}")
        if stack is not None and stack.needs_cuda and self.device == "cpu":
            raise SpecError("backend", f"{self.backend} needs a CUDA device; use backend torch or auto on cpu")
        if self.cuda_graphs and self.device == "cpu":
            raise SpecError("cuda_graphs", "needs a CUDA device")
        if self.compile and (stack is None or not stack.compiles):
            raise SpecError("compile", f"torch.compile applies to backend "
                            f"{' or '.join(s.name for s in STACKS.values() if s.compiles)}, not {self.backend} "
                            "(TE compiles its own fusers)")
        if self.world_size > 1 and self.parallel == "none":
            raise SpecError("parallel", f"world_size {self.world_size} needs parallel: ddp or fsdp (how the ranks "
                            "split the model)")
        if self.parallel != "none" and self.workload != "train":
            raise SpecError("parallel", "multi-rank trials are built for workload: train")
        if self.parallel != "none" and self.cuda_graphs:
            raise SpecError("cuda_graphs", "not with parallel ddp or fsdp (graphing collectives is not built)")
        if self.activation_checkpointing != "none":
            if self.workload != "train":
                raise SpecError("activation_checkpointing", "recomputes activations in backward: workload train only")
            if self.cuda_graphs:
                raise SpecError("activation_checkpointing", "not with cuda_graphs (a captured backward cannot "
                                "recompute its forward); use one of them")
        if self.grad_accum > 1 and self.workload != "train":
            raise SpecError("grad_accum", "accumulates gradients over micro-batches: workload train only")
        if self.ac_every != field_default("ac_every") and self.activation_checkpointing != "selective":
            raise SpecError("ac_every", "applies to activation_checkpointing: selective (every ac_every-th unit)")
        if self.fp8_all_gather:
            if self.parallel != "fsdp":
                raise SpecError("fp8_all_gather", "all-gathers FSDP2's weights in FP8: needs parallel: fsdp")
            owner = STACKS.get(recipe_owner(self.recipe) or "")
            if owner is None or self.recipe not in owner.fp8_all_gather:
                raise SpecError("fp8_all_gather", "is built for " + "; ".join(
                    f"backend {s.name}, recipe {' or '.join(s.fp8_all_gather)}" for s in STACKS.values()
                    if s.fp8_all_gather) + f", not recipe {self.recipe}")
            if owner.fp8_all_gather_masters and not self.source.te_own:
                raise SpecError("fp8_all_gather", f"{owner.name}'s FP8 primary weights are built for model "
                                f"{', '.join(m for m, s in SOURCES.items() if s.te_own)}, not {self.model}; use "
                                "backend torchao, recipe tensorwise")
        if self.weights == "fp8":
            if self.workload != "infer":
                raise SpecError("weights", "fp8 weights are an inference setting; use workload: infer (training keeps "
                                "high-precision master weights)")
            if self.precision != "fp8":
                raise SpecError("weights", "fp8 weights run under FP8 autocast; use precision: fp8")
        if self.workload == "infer":
            if stack is not None and not stack.infer:
                raise SpecError("workload", f"infer is built for backend "
                                f"{', '.join(s.name for s in STACKS.values() if s.infer)}, not {self.backend}")
            if self.compile:
                raise SpecError("compile", "infer runs eager or CUDA-graphed decode; use compile: false")
            fp8 = stack or STACKS["te"]
            if self.precision == "fp8" and not fp8.serves(self.recipe):
                raise SpecError("recipe", f"infer serves {fp8.name} recipes "
                                f"{', '.join(r for r in fp8.recipes if fp8.serves(r))}, not {self.recipe}")
            if self.precision == "fp8" and self.backend == "torchao" and self.weights != "fp8":
                raise SpecError("weights", "torchao serves FP8 weights (quantize_ with dynamic FP8 activations); "
                                "use weights: fp8")
            if self.prompt_len + self.gen_len > self.seq_len:
                raise SpecError("gen_len", f"prompt_len + gen_len must be <= seq_len={self.seq_len} (the KV cache and "
                                f"positions end there), got {self.prompt_len} + {self.gen_len}")
            if self.gen_len < 2:
                raise SpecError("gen_len", "infer decodes gen_len - 1 steps after the prefill's token: must be >= 2")
            if self.source.te_own and self.te_layer != "transformer_layer":
                raise SpecError("te_layer", "infer builds te.TransformerLayer blocks (their KV cache is TE's "
                                "InferenceParams); use transformer_layer")


def check_model(spec: TrialSpec) -> None:
    """SpecError when the spec's model cannot be built: transformers missing, an unknown model type, an unreadable
    config, a factory that fails its probe (trials/models). Called before Ray or any trial starts (the CLI, the
    sweep loader); the spec's own validation stays cheap and needs neither transformers nor the user's module."""
    from .models import check

    try:
        check(spec)
    except ModelError as exc:
        raise SpecError(exc.field, str(exc)) from None
    if not spec.source.own:  # the head-dim rule on the head dim the model has (a type may keep its own head_dim)
        from .models import describe

        head_dim = describe(spec).shape.get("head_dim")
        if isinstance(head_dim, int) and head_dim % HEAD_DIM_MULTIPLE:
            raise SpecError("n_heads" if spec.n_heads is not None else "d_model" if spec.d_model is not None
                            else "model", f"the model's head dim must be a multiple of {HEAD_DIM_MULTIPLE}, got "
                            f"{head_dim}")
    if why := te_layer_refusal(spec):
        raise SpecError("te_layer", why)


def te_layer_refusal(spec: TrialSpec) -> str:
    """Why the spec's ``te_layer`` cannot convert its model, in one line ('' when it can, or TE does not take
    this cell): transformer_layer takes transformers' Llama-family models only (backends.layer_refusal, asked
    with the config's model_type; a py: factory's module is not a config's). Reads the model's config (hf).
    Asks the stack table (trials/backends), not the converter: the spec imports no stack's module."""
    if spec.source.te_own or not applies("te_layer", spec.to_dict()):
        return ""
    from .models import describe

    try:
        model_type = describe(spec).model_type
    except ModelError:
        return ""  # check_model's own error says why
    return layer_refusal(spec.te_layer, model_type)


def default_n_heads(d_model: int) -> int:
    """The head count a spec without ``n_heads`` gets: the most heads whose width stays at least
    ``HEAD_DIM_TARGET`` (64), among head widths that divide ``d_model``, are multiples of
    ``HEAD_DIM_MULTIPLE`` (8) and at most ``HEAD_DIM_MAX`` (256); when no width is that wide (d_model < 64),
    the widest such head. Every multiple of 64 gets d_model // 64 heads of 64 (and any d_model below 128 one
    head) as before; d_model 224 gets 2 heads of 112 where d_model // 64 = 3 heads did not divide it. A
    d_model no multiple of 8 divides gets d_model // 64 heads, which validation then refuses in one line.
    """
    widths = [w for w in range(HEAD_DIM_MULTIPLE, min(d_model, HEAD_DIM_MAX) + 1, HEAD_DIM_MULTIPLE)
              if d_model % w == 0]
    wide = [w for w in widths if w >= HEAD_DIM_TARGET]
    if wide:
        return d_model // min(wide)
    return d_model // max(widths) if widths else max(1, d_model // HEAD_DIM_TARGET)


def close_matches(value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    """' (did you mean X?)' for a value close to allowed names, else ''."""
    near = difflib.get_close_matches(str(value), list(allowed), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(name, f"must be one of {', '.join(allowed)}; got {value!r}{close_matches(value, allowed)}")


def _batch_conflict(batch_size: Any, seq_len: int) -> SpecError:
    return SpecError("tokens_per_step", f"sizes the batch; give it or batch_size, not both (batch_size={batch_size}, "
                     f"seq_len={seq_len})")


def normalised(name: str, value: Any) -> Any:
    """A value of a spec field as its declared type holds it: an integer given for a float field (``lr: 1``) is
    that float, so ``1`` and ``1.0`` are one value (one cell id, one cell); numpy's integers are Python's."""
    type_name = _field_types().get(name)
    if type_name == "float" and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if type_name == "int" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


@functools.cache
def _field_types() -> dict[str, str]:
    return spec_field_types()


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Reject wrong types early (YAML and CLI give strings, floats and bools in odd places)."""
    text = str(annotation)
    if value is None:
        if "None" not in text:
            raise SpecError(name, "must not be empty")
        return
    type_name = text.split("|")[0].strip()
    if not matches(value, type_name):
        raise SpecError(name, f"must be {WANTED[type_name]}, got {value!r}")


def swiglu_hidden(d_model: int) -> int:
    """Llama's SwiGLU width for a hidden size: 8/3 * d_model rounded up to a multiple of 256."""
    return -(-8 * d_model // 3 // 256) * 256


def field_default(name: str) -> Any:
    """A spec field's declared default (None for a field whose default is the model source's: see default_for)."""
    return TrialSpec.__dataclass_fields__[name].default


def default_for(field_name: str, values: Mapping[str, Any]) -> Any:
    """A field's default for a cell of these values: its model source's where the source declares it (te_layer:
    transformer_layer on MiniGPT, swap elsewhere), else the declared default."""
    if field_name not in SOURCE_DEFAULTS:
        return field_default(field_name)
    try:
        source = parse_model(str(values.get("model") or DEFAULT_MODEL)).source
    except ModelError:
        source = SOURCES[DEFAULT_MODEL]
    return SOURCE_DEFAULTS[field_name](source)


def defaults_for(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every spec field's default for a cell of these values (``TrialSpec()``'s, with te_layer's its model source's)."""
    return {**_declared_defaults(), **{name: default_for(name, values) for name in SOURCE_DEFAULTS}}


@functools.cache
def _declared_defaults() -> dict[str, Any]:
    return TrialSpec().to_dict()


_ONLY = {f.name: f.metadata["only"] for f in dataclasses.fields(TrialSpec)}


def only_fields(*scopes: str) -> list[str]:
    """Fields that mean something only in these scopes (``"fp8"``, ``"te"``, ``"te-fp8"``, ``"compiles"``)."""
    return [name for name, only in _ONLY.items() if only in scopes]


def scope_words(field_name: str) -> str:
    """The cells a field means something for, in words (what :func:`applies` checks): for an error naming a
    field given where it applies to no cell."""
    only = _ONLY[field_name]
    stacks = " or ".join(s.name for s in STACKS.values() if (s.compiles if only == "compiles" else s.fp8_filter_auto))
    return {"fp8": "precision: fp8 cells", "te": "cells of backend te (or auto) off the CPU",
            "te-fp8": "precision: fp8 cells of backend te (or auto)",
            "te-delayed": "recipe: delayed cells of backend te (or auto)", "compiles": f"cells of backend {stacks}",
            "fp8-filter": f"precision: fp8 cells of backend {stacks}",
            "minigpt": f"cells of model {', '.join(m for m, s in SOURCES.items() if s.own)} (other models have their "
                       "own architecture)",
            "selective-ac": "cells of activation_checkpointing: selective",
            "train": "workload: train cells"}.get(only, "every cell")


def axis_fields(*axes: str) -> list[str]:
    """The spec fields on these axes, in declaration order."""
    return [f.name for f in dataclasses.fields(TrialSpec) if f.metadata["axis"] in axes]


def applies(field_name: str, values: Mapping[str, Any]) -> bool:
    """Whether a field means something for these values (an fp8-only field on an fp8 cell, ...)."""
    only = _ONLY[field_name]
    te = values.get("backend") in ("te", "auto") and values.get("device") != "cpu"
    fp8 = values.get("precision") == "fp8"
    stack = STACKS.get(str(values.get("backend")))
    try:
        own = parse_model(str(values.get("model") or DEFAULT_MODEL)).source.own
    except ModelError:
        own = False
    return (only is None or (only == "fp8" and fp8) or (only == "te" and te) or (only == "te-fp8" and te and fp8)
            or (only == "te-delayed" and te and fp8 and values.get("recipe", field_default("recipe")) == "delayed")
            or (only == "compiles" and stack is not None and stack.compiles)
            or (only == "fp8-filter" and fp8 and stack is not None and bool(stack.fp8_filter_auto))
            or (only == "minigpt" and own)
            or (only == "selective-ac" and values.get("activation_checkpointing") == "selective")
            or (only == "train" and values.get("workload", field_default("workload")) == "train"))


def variant_name(values: Mapping[str, Any]) -> str:
    """backend-precision[-recipe][-each non-default labelled setting], e.g. te-fp8-delayed-e4m3-hist1024-modules.

    The names that reports colour and pair by; a setting names only the variants it applies to
    (elsewhere the sweep collapses it to its default), and a default is the cell's model source's where the
    source declares one (``te_layer``: ``values["model"]``; without it, MiniGPT's).
    """
    name = f"{values.get('backend')}-{values.get('precision')}"
    if values.get("precision") == "fp8":
        name += f"-{values.get('recipe')}"
    for f in dataclasses.fields(TrialSpec):
        label = f.metadata["label"]
        value = values.get(f.name)
        if label and value is not None and value != default_for(f.name, values) and applies(f.name, values):
            name += "-" + label.format(value)
    return name


def spec_field_types() -> dict[str, str]:
    """Field name -> 'int' | 'float' | 'bool' | 'str' (for CLI flags and stores)."""
    out = {}
    for f in dataclasses.fields(TrialSpec):
        out[f.name] = str(f.type).split("|")[0].strip()
    return out
