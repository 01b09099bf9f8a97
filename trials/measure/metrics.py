"""Model FLOPs, GPU peak rates and step-time statistics.

FLOPs per training step (forward + backward, the usual 3x of forward):

    6 * N_matmul * tokens  +  6 * n_layers * seq_len * d_model * tokens

N_matmul counts the weights used in matrix products (QKV, proj, FC1, FC2 of every block and the LM
head; embedding lookups do no multiply-adds). The second term is causal self-attention: QK^T and
AV cost 4 * seq * d FLOPs per token and layer in the forward pass, halved by the causal mask, times
3 for forward + backward. MFU divides achieved model FLOP/s by a dense datasheet peak.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..models.minigpt_net import ModelConfig, matmul_param_count

# Dense (non-sparse) datasheet peaks in TFLOP/s, keyed by the words of torch's device name that name the model
# (matched as whole words, the longest key winning: :func:`peak_tflops`).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H200 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1671.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    ("H20", {"bf16": 148.0, "fp8": 296.0, "fp32": 44.0}),
    ("GB200", {"bf16": 2500.0, "fp8": 5000.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "fp32": 80.0}),
    ("B100", {"bf16": 1750.0, "fp8": 3500.0, "fp32": 60.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A10G", {"bf16": 70.0, "fp32": 31.2}),
    ("L40S", {"bf16": 362.05, "fp8": 733.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.05, "fp8": 362.05, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp8": 242.5, "fp32": 30.3}),
]
PEAK_ENV = "JUICYTALK_PEAK_TFLOPS"  # e.g. "bf16=989,fp8=1979,fp32=67"


def peak_tflops(gpu_name: str | None, precision: str) -> float | None:
    """Dense peak for ``precision`` on ``gpu_name``; the environment override wins; None if unknown."""
    override = os.environ.get(PEAK_ENV, "").strip()
    if override:
        table = {}
        for item in override.split(","):
            key, _, value = item.partition("=")
            table[key.strip()] = float(value)
        if precision in table:
            return table[precision]
    peaks = _gpu_peaks(gpu_name) if gpu_name else None
    return peaks.get(precision) if peaks else None


def _words(name: str) -> tuple[str, ...]:
    return tuple(re.findall(r"[a-z0-9]+", name.lower()))


def _gpu_peaks(gpu_name: str) -> dict[str, float] | None:
    """The table's entry for ``gpu_name``: the key whose words run, whole, in the name's words, the longest such key
    (``NVIDIA H100 PCIe``: "H100 PCIe" over "H100"), whatever the table's order. Whole words, not a substring:
    "NVIDIA L40" took "L4"'s peak (121 TFLOP/s BF16 against its own 181); ``A100-SXM4-80GB`` is the words
    a100, sxm4, 80gb."""
    words = _words(gpu_name)

    def runs_in(key: tuple[str, ...]) -> bool:
        return any(words[i:i + len(key)] == key for i in range(len(words) - len(key) + 1))

    keys = [(_words(key), peaks) for key, peaks in PEAK_TFLOPS]
    return max(((k, p) for k, p in keys if runs_in(k)), key=lambda kp: len(kp[0]), default=(None, None))[1]


def flops_per_step(cfg: ModelConfig, tokens: int) -> float:
    attention = 6.0 * cfg.n_layers * cfg.seq_len * cfg.d_model * tokens
    return 6.0 * matmul_param_count(cfg) * tokens + attention


ATTENTION_OPS = ("attention",)  # FlopCounterMode's names for SDPA kernels (aten._scaled_dot_product_*_attention*)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` (shapes): MoE experts' GEMMs, one group of rows per expert.

    (t, k) x (g, k, n) -> (t, n): each of the t rows meets one expert's k x n weight, 2*t*k*n (transformers 5's
    MoE forward, the backward's dgrad); (k, t) x (t, n) -> (g, k, n): each group contracts its own rows of t
    (the backward's wgrad), 2*k*t*n, not g times that; 3D x 3D and 3D x 2D: 2 * output elements * k."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


def _is_fp8(value: Any) -> bool:
    """A GEMM operand in FP8: a float8 tensor, or a tensor subclass carrying one (torchao's Float8TrainingTensor
    holds its float8 ``_data`` and scale behind a BF16 face; ``__tensor_flatten__`` names its inner tensors)."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.dtype in FP8_DTYPES:
        return True
    flatten = getattr(type(value), "__tensor_flatten__", None)
    return flatten is not None and any(_is_fp8(getattr(value, n, None)) for n in value.__tensor_flatten__()[0])


@dataclass
class Tally:
    """FLOPs of the GEMMs a counter saw run in FP8 (what :func:`gemm_flop_counter` adds to): those with an FP8
    operand, and, with ``modules``, those of the named modules of the counted model whatever their operands.

    ``modules``: qualified names (``model.layers.0.self_attn.q_proj``) of the modules a stack will run in FP8 after
    the count, where the counter cannot see its GEMMs: Transformer Engine's, counted on the model before TE converts
    it (trials/backends/te.py). Their GEMMs are found by :class:`ModuleScope`, not by FlopCounterMode's per-module
    counts (``get_flop_counts()``, keyed by the root's class name and the module's path): those charge a backward
    GEMM to every module whose backward has begun and not ended, which for modules sharing an input (q/k/v_proj,
    gate/up_proj) is all of them until the last is done (on a tiny hf:llama k_proj was charged 2.3x its FLOPs)."""

    fp8: int = 0
    modules: tuple[str, ...] = ()
    scope: "ModuleScope | None" = field(default=None, repr=False, compare=False)

    def runs_fp8(self, args: Sequence[Any]) -> bool:
        """Whether the GEMM now dispatched with ``args`` runs in FP8."""
        return any(_is_fp8(a) for a in args) or (self.scope is not None and self.scope.inside())


class GraphRegion:
    """Which ops run inside a region of the forward, and, in the backward, inside the autograd nodes that region
    made: ``depth`` > 0 while the region's forward runs; :meth:`collect` takes the nodes between a region's outputs
    and its inputs as it returns (walking the graph from its outputs back to its inputs); in the backward, an op runs
    inside one of them when it is the node autograd executes now (``torch._C._current_autograd_node``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.nodes: set[Any] = set()

    def inside(self) -> bool:
        if self.depth:
            return True
        node = torch._C._current_autograd_node() if self.nodes else None
        return node is not None and node in self.nodes

    def clear(self) -> None:
        self.nodes.clear()  # the step's graph: freed with it
        self.depth = 0

    def collect(self, out: Any, inputs: Any) -> None:
        """The autograd nodes between the region's outputs and its arguments. A region reading a tensor with a graph
        behind it other than through its arguments would take that graph too; the regions here read their
        arguments (a Linear's forward, a GEMM's operands)."""
        from torch.utils._pytree import tree_leaves

        stop = {t.grad_fn for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in self.nodes:
                continue
            self.nodes.add(node)
            todo.extend(f for f, _ in node.next_functions)


class ModuleScope(GraphRegion):
    """Which GEMMs belong to a set of modules, forward and backward, exactly (a :class:`GraphRegion` of their calls):
    a GEMM is theirs in the forward while one of their ``forward`` methods runs (each wrapped on the instance, so
    that a call by any route counts: ``m(x)``, or a model calling ``m.forward(x)`` past the module hooks), and in the
    backward while autograd executes a node their forward made (found as each forward returns). A weight a model
    reads without calling its module (PyTorch's MultiheadAttention reads ``out_proj.weight`` in its functional
    forward) is not theirs: TE's module in its place would not run either, the weight going to aten's GEMM as it
    is, in BF16."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str]):
        super().__init__()
        self.modules = list({id(m): m for m in map(model.get_submodule, names)}.values())  # one a module
        self.own: list[tuple[torch.nn.Module, Any]] = []  # each module's own ``forward`` attribute, if it had one

    def __enter__(self) -> "ModuleScope":
        for m in self.modules:
            self.own.append((m, m.__dict__.get("forward")))  # accelerate's hooks, for one, set it
            m.forward = self._wrap(m.forward)  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc: Any) -> None:
        for m, own in self.own:
            if own is None:
                del m.forward  # the class's method again
            else:
                m.forward = own
        self.own.clear()
        self.clear()

    def _wrap(self, forward: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            try:
                out = forward(*args, **kwargs)
            finally:
                self.depth -= 1
            self.collect(out, (args, kwargs))
            return out
        return counted


# torch's GEMM calls as Python code makes them (aten's forms of each are what the counter counts), and SDPA, whose
# math fallback (the meta device's, CUDA's for inputs its fused kernels refuse) runs aten's bmm under the call
GEMM_CALLS = frozenset((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                        torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
                        torch.baddbmm, torch.Tensor.baddbmm, torch.addbmm, torch.Tensor.addbmm, torch.einsum,
                        torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention))
# autograd nodes that only move, select or cast data: a parameter seen through them is still a weight
MOVES = frozenset(("View", "UnsafeView", "ReshapeAlias", "Alias", "AsStrided", "T", "Transpose", "Permute", "Expand",
                   "Unsqueeze", "Squeeze", "Slice", "Select", "Index", "IndexSelect", "Split", "SplitWithSizes",
                   "Unbind", "ToCopy", "Clone"))


def _is_weight(value: Any) -> bool:
    """A GEMM operand that is a weight: a parameter, or one seen through views, indexing and casts alone (a Linear's
    ``weight.t()``, the expert weights transformers' batched_mm MoE gathers per token, ``gate_up_proj[ids]``), or an
    FP8 operand (torchao's converted Linears cast both). Not an activation made from a weight by arithmetic
    (a query after its RMSNorm multiplied it by the norm's weight), nor a token embedding (a lookup, not a move)."""
    if not isinstance(value, torch.Tensor):
        return False
    if isinstance(value, torch.nn.Parameter) or isinstance(value._base, torch.nn.Parameter) or _is_fp8(value):
        return True
    node = value.grad_fn
    while node is not None:
        kind = re.sub(r"Backward\d*$", "", type(node).__name__)
        if kind == "AccumulateGrad":
            return isinstance(node.variable, torch.nn.Parameter)
        inputs = [f for f, _ in node.next_functions if f is not None]
        if kind not in MOVES or len(inputs) != 1:
            return False
        node = inputs[0]
    return False


class ActivationGemms(TorchFunctionMode):
    """The GEMMs between two activations, forward and backward, for :func:`counted_flops_per_step` to leave out: a
    GEMM call (:data:`GEMM_CALLS`) none of whose operands is a weight (:func:`_is_weight`), in the forward; its
    forward and backward GEMMs are then ``region``'s. Eager attention's QK^T and AV are such GEMMs (transformers'
    ``eager_attention_forward`` via ``torch.matmul``, BLOOM's ``baddbmm`` and ``bmm``, a factory's own matmul), as are
    an SSM's scans, and SDPA's math fallback (its fused kernels are left out by name too, :data:`ATTENTION_OPS`:
    on the meta device hf:llama 8B counted twice the formula's term more through it). The counter counts the weights'
    GEMMs only, and the formula's causal term stands for attention whichever implementation ran it (an eager model
    had counted its full, non-causal attention on top of the term: hf:bloom and hf:gemma2 2x the term more).
    Calls made while autograd runs a backward node (a stack's own backward, a checkpoint's recompute) are not
    classified: they are the backward of a forward call, which decided."""

    def __init__(self) -> None:
        super().__init__()
        self.region = GraphRegion()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func not in GEMM_CALLS or torch._C._current_autograd_node() is not None
                or any(_is_weight(t) for t in tree_leaves((args, kwargs)))):
            return func(*args, **kwargs)
        self.region.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.region.depth -= 1
        self.region.collect(out, (args, kwargs))
        return out

    def __exit__(self, *exc: Any) -> Any:
        self.region.clear()
        return super().__exit__(*exc)


def recomputing() -> bool:
    """Whether the op dispatched now is an activation checkpoint's recompute: a forward op run inside the backward.
    Autograd runs a backward node with grad mode off (the graph task's ``create_graph``, never set by the count, on
    CUDA's device threads too); ``torch.utils.checkpoint`` turns it on to re-run a unit's forward, whose ops are
    then dispatched while the node that needs the unit's saved tensors executes. The schedule's work, not the model's:
    a checkpointed step counted it too (an hf:llama 8B at seq 4096 with every layer checkpointed, 2.394e14 FLOPs
    counted against the formula's 1.976e14: model_tflops and MFU 21% high)."""
    return torch.is_grad_enabled() and torch._C._current_autograd_node() is not None


def gemm_flop_counter(tally: Tally | None = None, skip: Callable[[], bool] | None = None) -> Any:
    """``FlopCounterMode`` that counts attention kernels as 0 FLOPs (the formula adds attention instead),
    counts grouped GEMMs (``aten._grouped_mm``, MoE experts; torch's registry has no formula for them) and, with
    ``tally``, adds the FLOPs of every GEMM that runs in FP8 to ``tally.fp8`` (:meth:`Tally.runs_fp8`: its
    operands are FP8, or it runs in one of ``tally.modules``, whose :class:`ModuleScope` the caller opens).
    An op counts 0 in an activation checkpoint's recompute (:func:`recomputing`) and where ``skip()`` says so
    (:class:`ActivationGemms`' region).

    Not only a filter afterwards: torch 2.11's SDPA formulas assert that q, k and v have the same number of
    heads, so a grouped-query model's CUDA attention (flash, efficient, cuDNN; the CPU kernel is not
    registered) failed the count, and with it the trial (on the H200: every hf:llama cell at 32 / 8 heads,
    ``AssertionError: sdpa_flop_count: query/key/value shapes are incompatible``)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

    def none(*args: Any, **kwargs: Any) -> int:
        return 0

    mapping: dict[Any, Any] = {op: none for op in flop_registry if any(a in str(op) for a in ATTENTION_OPS)}
    grouped = {getattr(torch.ops.aten, n): _grouped_mm_flops
               for n in ("_grouped_mm", "_scaled_grouped_mm") if hasattr(torch.ops.aten, n)}
    formulas = {op: f for op, f in flop_registry.items() if op not in mapping}
    formulas.update({op: shape_wrapper(f) for op, f in grouped.items()})
    for op, formula in formulas.items():
        def raw(*args: Any, _formula: Any = formula, **kwargs: Any) -> int:
            if recomputing() or (skip is not None and skip()):
                return 0
            n = _formula(*args, **kwargs)
            if tally is not None and tally.runs_fp8(args):
                tally.fp8 += n
            return n

        raw._get_raw = True  # type: ignore[attr-defined] - FlopCounterMode hands such a formula the tensors
        mapping[op] = raw
    return FlopCounterMode(display=False, custom_mapping=mapping)


@contextlib.contextmanager
def weight_gemm_counter(tally: Tally | None = None) -> Any:
    """:func:`gemm_flop_counter` over the weights' GEMMs only: the GEMMs between two activations
    (:class:`ActivationGemms`: eager attention's, an SSM's scans) left out, as every count here wants them (the
    trial's, :func:`counted_flops_per_step`, and the dry run's probe, trials/measure/memory_plan.py)."""
    between = ActivationGemms()
    with gemm_flop_counter(tally, between.region.inside) as counter, between:
        yield counter


def counted_flops_per_step(model: Any, ids: Any, n_layers: int, attn_width: int, world: int = 1,
                           tally: Tally | None = None) -> float:
    """One eager forward+backward of ``model`` on ``ids`` (b, t) under ``FlopCounterMode``: the GEMMs it counts
    (2*m*n*k each, forward and backward) plus causal attention by the formula above, for the global batch
    (``world`` ranks of b rows); ``tally.fp8`` gets those of the GEMMs that ran in FP8 (global too): with FP8
    operands, or in ``tally.modules``.

    The counter's attention figure depends on the kernel (CPU's SDPA is not counted at all; GPU flash
    attention is counted without the causal half; eager attention's matmuls in full), so attention is left out of
    the count, its SDPA kernels and every GEMM between two activations (:class:`ActivationGemms`), and added as
    6 * n_layers * seq * attn_width per token (attn_width = heads * head_dim), the formula's term; the weights'
    GEMMs are counted as they run (every Linear, Conv1D, MoE experts' grouped GEMMs and the logits layer).
    The model's work, not the schedule's: the forward a checkpointed unit re-runs in the backward is not counted
    (:func:`recomputing`), so a cell counts the same FLOPs with and without activation checkpointing.
    Gradients the pass leaves are dropped; the weights and the optimizer are untouched.
    """
    scope = ModuleScope(model, tally.modules if tally is not None else ())
    if tally is not None:
        tally.scope = scope
    # eager also where units are compiled: a count under the counter's mode and module hooks would compile them
    # for it, and the training steps would then recompile (trials/measure/fp8_layers.quiet says what that costs)
    try:
        with weight_gemm_counter(tally) as counter, torch.compiler.set_stance("force_eager"), scope:
            logits = model(ids)
            logits.float().sum().backward()
    finally:
        if tally is not None:
            tally.scope = None
    model.zero_grad(set_to_none=True)
    gemms = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                if not any(a in str(op) for a in ATTENTION_OPS))
    if tally is not None:
        tally.fp8 *= world
    b, t = ids.shape
    return float(gemms * world + 6.0 * n_layers * t * attn_width * b * t * world)


def count_flops(spec: Any, model: Any, vocab: int, device: str, world: int,
                fp8_modules: Sequence[str] = ()) -> dict[str, Any]:
    """A step's FLOPs for a model without a closed form: counted once, before training and timing, on a batch of
    its own (the training data's generator is not drawn from), the model eager (:func:`counted_flops_per_step`),
    and the share of them that ran in FP8 GEMMs (``fp8_flop_share``, of the model as it will train: torchao's
    converted one, whose GEMMs see FP8 operands). A stack whose GEMMs the counter cannot see, TE's, counts the
    model before converting it and names the modules it will run in FP8 (``fp8_modules``, qualified names in
    ``model``): their GEMMs, forward and backward, are the FP8 ones. Where the model's layers and attention width
    are unknown (a factory's, shape fields not given), attention is left out and ``flops_method`` says so."""
    from ..workloads.data import ArithmeticSequences
    from ..models import describe

    facts = describe(spec)
    ids, _ = ArithmeticSequences(vocab, spec.seq_len, device, spec.seed + 2).batch(spec.batch_size)
    known = bool(facts.n_layers and facts.attn_width)
    tally = Tally(modules=tuple(fp8_modules))
    # one micro-batch counted, a step's every micro-batch on every rank charged (TrialSpec.tokens' rule)
    flops = counted_flops_per_step(model, ids, facts.n_layers or 0, facts.attn_width or 0, world * spec.grad_accum,
                                   tally)
    return {"flops_per_step": flops, "flops_method": "counted" if known else "counted-gemms-only",
            "fp8_flop_share": tally.fp8 / flops if flops else None}


def named_fp8_share(cfg: ModelConfig, model: Any, names: Iterable[str]) -> float:
    """The share of MiniGPT's analytic ``flops_per_step`` in the GEMMs of its Linears ``names`` (qualified names in
    ``model``): each one's forward and backward, 6 * weights per token, as the formula counts them. torchao's
    MiniGPT, whose converted Linears (``fp8_converted_names``) are its FP8 GEMMs: its auto filter keeps small ones
    and the LM head BF16 (tests/test_flop_share.py holds it equal to a count of the converted model). A Linear
    whose recipe keeps some of its three GEMMs in high precision (torchao's ``rowwise_with_gw_hp``: the weight
    gradient) counts the share of them that run FP8 (:func:`fp8_gemm_share`): it had counted all three, 0.91 for
    0.60 at d_model 64."""
    return _formula_share(cfg, sum(model.get_submodule(name).weight.numel() * fp8_gemm_share(model.get_submodule(name))
                                   for name in names))


# A converted Linear's three GEMMs, each by the two operand casts torchao's Float8LinearConfig names for it
FP8_GEMM_CASTS = (("cast_config_input", "cast_config_weight"),  # forward: y = x w^T
                  ("cast_config_grad_output", "cast_config_weight_for_grad_input"),  # dgrad: dx = dy w
                  ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight"))  # wgrad: dw


def fp8_gemm_share(module: Any) -> float:
    """The share of a converted Linear's three equal GEMMs (forward, dgrad, wgrad) that run in FP8: those whose
    operand casts its torchao config does not disable; 1.0 for a module without such a config."""
    config = getattr(module, "config", None)
    if config is None or not all(hasattr(config, c) for pair in FP8_GEMM_CASTS for c in pair):
        return 1.0
    on = [all(getattr(config, c).scaling_type.name != "DISABLED" for c in pair) for pair in FP8_GEMM_CASTS]
    return sum(on) / len(on)


def blocks_fp8_share(cfg: ModelConfig) -> float:
    """The share of MiniGPT's analytic ``flops_per_step`` in its blocks' GEMMs (QKV, proj, fc1, fc2 of every block):
    a TE MiniGPT's FP8 share, its blocks being TE's (``te.TransformerLayer`` or TE's modules, every GEMM of them FP8
    under ``te.autocast``) and its LM head an ``nn.Linear`` (BF16). The same figure as a count of the torch twin
    with those Linears named FP8 (tests/test_flop_share.py): each of the twin's Linears ``blocks.<i>.qkv``,
    ``.proj``, ``.fc1``, ``.fc2`` is one GEMM of TE's block (trials/models/minigpt_net.py, ``_TE_TO_TWIN``), whose
    forward and backward the formula's 6 * weights * tokens counts; attention stays in the total, in BF16."""
    return _formula_share(cfg, matmul_param_count(cfg) - cfg.vocab * cfg.d_model)  # all but the LM head


def _formula_share(cfg: ModelConfig, weights: int) -> float:
    """The share of MiniGPT's ``flops_per_step`` in GEMMs over ``weights`` matmul weights: 6 * weights per token
    (forward and backward), over the formula's FLOPs per token (the share does not depend on the token count)."""
    return 6.0 * weights / flops_per_step(cfg, 1)


# A cell asked for FP8 is an FP8 result when at least this share of its step's FLOPs ran in FP8 GEMMs.
FP8_MIN_SHARE = 0.05


def fp8_ran(share: float | None, converted: int | None) -> bool:
    """Whether an FP8 cell ran in FP8, for its ``effective_precision`` (and so the report's pairing).

    Not when its stack converted no module (``fp8_converted_modules`` 0: hf:gpt2's Conv1D on torchao, a model
    whose Linears are not multiples of 16), nor when less than :data:`FP8_MIN_SHARE` (5%) of the step's counted
    FLOPs ran in FP8 GEMMs (``fp8_flop_share``): with FP8 GEMMs at best twice as fast, a 5% share caps the whole
    step's gain at 1/(1 - 0.05/2) = 1.026x, below what a step time resolves between runs, so such a cell times
    the casts and the BF16 model, not FP8. Above it the cell is FP8 and its share is shown beside its speedup
    (a 2-layer slice of a large-vocabulary model runs under half of its FLOPs in FP8, the BF16 LM head being
    the rest, and is still the FP8 answer for that slice). Unknown (None) share or count: FP8, as asked (MiniGPT's
    share is its formula's: TE's blocks, :func:`blocks_fp8_share`, torchao's converted Linears,
    :func:`named_fp8_share`)."""
    if converted is not None and converted == 0:
        return False
    return share is None or share >= FP8_MIN_SHARE


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def step_stats(step_ms: Iterable[float]) -> dict[str, float]:
    values = sorted(step_ms)
    n = len(values)
    mean = sum(values) / n if n else math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {
        "step_ms_p50": percentile(values, 50),
        "step_ms_p90": percentile(values, 90),
        "step_ms_p99": percentile(values, 99),
        "step_ms_mean": mean,
        "step_ms_std": math.sqrt(var),
        "step_ms_min": values[0] if values else math.nan,
    }


def throughput(flops: float, tokens: int, step_ms_mean: float, gpu_name: str | None,
               precision: str, gpus: int = 1) -> dict[str, float | None]:
    """tokens/s, model TFLOP/s and MFU (vs the BF16 peak and vs the peak of the precision used, of all
    ``gpus`` the step ran on); ``flops``: the step's model FLOPs, ``tokens``: the global batch's."""
    seconds = step_ms_mean / 1000.0
    tflops = flops / seconds / 1e12
    bf16_peak = peak_tflops(gpu_name, "bf16")
    own_peak = peak_tflops(gpu_name, precision)
    bf16_peak, own_peak = (p * gpus if p else p for p in (bf16_peak, own_peak))
    return {
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_gpu": tokens / seconds / gpus,
        "model_tflops": tflops,
        "peak_tflops_bf16": bf16_peak / gpus if bf16_peak else None,
        "peak_tflops_precision": own_peak / gpus if own_peak else None,
        "mfu_bf16_peak": tflops / bf16_peak if bf16_peak else None,
        "mfu_precision_peak": tflops / own_peak if own_peak else None,
    }
