"""The memory plan: what one rank of a training cell needs, derived from the module the model source builds.

The module is built and run once under torch's FakeTensorMode (shapes, dtypes and storages, no memory, no
arithmetic: an 8B model at seq 4096 takes about half a second), at the cell's own batch and sequence, with
the trial's own counter (trials/parallel/checkpointing.py's ``SavedBytes``: the unique storages autograd keeps for
backward, parameters excluded: they are the weights). A forward hook on each unit (the model source's units,
the ones the trial checkpoints and FSDP2 shards: trials/models ``units``) says which unit saved what, so
each activation-checkpointing setting follows from the same one pass, the units recomputed chosen by the
trial's rule (trials/parallel/checkpointing.py ``chosen``):

    none       every unit's saved bytes
    full       every unit keeps only what it is handed (its input; a transformers layer's position tensors
               too); one unit's saved bytes come back while it is recomputed
    selective  every ``ac_every``-th unit (1-based, as torchtitan counts) as under full, the rest as none

The parts of one rank, in the cell's weight dtype (fp32 for fp32 cells, bf16 otherwise, trials/models):

    weights      parameters; FSDP2 keeps 1/world_size of them, plus two units gathered whole (the one
                 running and the one prefetched), plus the parameters outside every unit gathered whole
                 (embeddings, final norm, LM head: trials/parallel/ranks.py shards the root too, and FSDP2
                 does not reshard the root after forward, so they stay whole through backward); FP8 cells of a stack that keeps FP8 copies of its GEMM
                 weights between steps add them (``fp8_weight_cache_bytes`` in the stack table: TE's weight
                 and its transpose)
    grads        one per parameter, the parameter's dtype (FSDP2: sharded; DDP adds its buckets' copy)
    optimizer    AdamW's two moments, in the parameter's dtype (torch's AdamW keeps its state like the
                 parameter); where a stack keeps FP8 weights only (``fp8_all_gather_masters``: TE), an
                 fp32 master weight and two fp32 moments per parameter (FusedAdam)
    activations  the saved bytes above, held once the forward is done, for the checkpointing setting, the
                 trial's loss's included (trials/workloads/loss.py, run after the forward as the trial runs it,
                 outside every unit: its fp32 log-softmax and the targets); what the record's
                 ``est_activation_bytes`` is, beside the measured ``saved_activation_bytes``
    recomputed   under checkpointing, the largest recomputed unit's saved bytes, back during its backward
    logits       (batch, seq, vocab): the logits in the weight dtype (alive through the step), and in the
                 loss's backward the fp32 gradient of its log-softmax and of its input
    graph pool   ``cuda_graphs`` cells: what the captured graphs keep in their private memory pool between steps
                 (:func:`graph_parts`; the record's ``est_graph_pool_bytes``, beside the measured
                 ``graph_pool_bytes``): each graph's static inputs and outputs, what the graphed forwards save for
                 backward and the graphed parameters' gradients, all at once (the allocator reuses little of
                 the saves a backward's capture frees for the gradients it makes: :func:`graph_parts`). What
                 is graphed is then no longer in activations, logits or grads: those are the eager root's

The peak is weights + optimizer + graph pool + max(activations + recomputed + logits, grads): at the start of
backward every activation and the logits' gradients are held; by its end the activations are freed and every
gradient exists. Activations and logits are one micro-batch's (``batch_size`` rows); under gradient accumulation
(``grad_accum`` > 1) a later micro-batch's backward runs with the gradients held, so the peak is their sum, and
FSDP2 accumulates whole (unsharded) gradients until the step's last micro-batch reduces them. The plan is of
the module the source builds (the torch twin): an FP8 stack's own saved casts are not in it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..spec import axis_fields, field_default

log = logging.getLogger(__name__)

LOGITS_BYTES = 8  # per logit beyond the weight dtype's: the loss's backward, fp32 grads of its log-softmax and input
FP8_MASTER_STATE_BYTES = 12  # per parameter: an fp32 master weight and two fp32 moments
# a graphed unit's buffers beside the tensors it is handed (its static inputs), each of its hidden state's size: its
# static output, the gradient of that output, and the gradient of its input
GRAPH_IO_COPIES = 3
GATHERED_UNITS = 2  # FSDP2: the unit running and the one prefetched are whole at once


@dataclass(frozen=True)
class Activations:
    """The storages one forward and the trial's loss save for backward at the cell's batch and seq, each a mapping
    storage -> bytes, told apart by unit. The trial's counter takes a storage once, wherever it is held, and so
    does :meth:`held`: a unit's input that the unit before it saves too, or the position ids and RoPE's cos and sin
    that a transformers model hands every layer, count once."""

    outside: dict[int, int]  # saved outside every unit (embeddings, final norm, the head's input, the loss)
    units: tuple[dict[int, int], ...]  # saved inside each unit
    unit_inputs: tuple[dict[int, int], ...]  # handed to each unit (args and kwargs): what a checkpointed unit keeps

    def checkpointed(self, setting: str, every: int | None = None) -> tuple[bool, ...]:
        """Which units ``setting`` recomputes (``every``: selective's ``ac_every``, default the spec's): the
        trial's rule (trials/parallel/checkpointing.py)."""
        from ..parallel.checkpointing import chosen

        every = field_default("ac_every") if every is None else every
        picked = set(chosen(tuple(range(len(self.units))), setting, every))
        return tuple(i in picked for i in range(len(self.units)))

    def held(self, setting: str = "none", every: int | None = None) -> int:
        """Bytes held for backward once the forward is done (``every``: selective's ``ac_every``, default the
        spec's)."""
        kept = dict(self.outside)
        for saved, handed, again in zip(self.units, self.unit_inputs, self.checkpointed(setting, every)):
            kept.update(handed if again else saved)
        return sum(kept.values())

    def peak(self, setting: str = "none", every: int | None = None) -> int:
        """Held bytes plus, under checkpointing, the largest recomputed unit's saved bytes during its backward."""
        again = [sum(u.values()) for u, c in zip(self.units, self.checkpointed(setting, every)) if c]
        return self.held(setting, every) + (max(again) if again else 0)


@dataclass(frozen=True)
class Probe:
    """What one fake-tensor forward of a cell's module tells: its size, units, saved bytes and GEMM FLOPs."""

    n_params: int
    weight_bytes: int  # the parameters in the cell's weight dtype
    largest_unit_params: int  # 0 where the model has no units
    activations: Activations
    forward_flops: float  # the weights' GEMMs, counted by FlopCounterMode (attention not: trials/measure/metrics.py)
    gemm_params: int = 0  # weights of the Linears a stack may run in FP8 (the logits layer stays high precision)
    outside_weight_bytes: int = 0  # parameters outside every unit (embeddings, final norm, head), weight dtype


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's bytes for a training step of a cell; ``guess``: the module could not be run under fake
    tensors, so weights come from the parameter count only (activations unknown but the loss's). ``activations``: held
    for backward once the forward is done; ``recomputed``: what comes back on top while the largest
    checkpointed unit is recomputed (in the total only); ``graph_pool``: a ``cuda_graphs`` cell's graphs' memory
    pool (0: eager, or a guess), whose contents activations, logits and grads then leave out."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    checkpointing: str
    ac_every: int  # selective: every ac_every-th unit recomputed
    parallel: str
    world_size: int
    batch_size: int  # rows per rank, one micro-batch
    guess: bool = False
    recomputed: int = 0
    grad_accum: int = 1  # micro-batches per optimizer step
    graph_pool: int = 0

    @property
    def total(self) -> int:
        held = self.activations + self.recomputed + self.logits
        if self.grad_accum > 1:  # a later micro-batch's backward: the earlier ones' gradients are held
            return self.weights + self.optimizer + self.graph_pool + held + self.grads
        return self.weights + self.optimizer + self.graph_pool + max(held, self.grads)

    def setting(self) -> str:
        """The knobs this plan is for, as sweep fields."""
        where = (f"parallel {self.parallel}, world_size {self.world_size}, batch_size {self.batch_size} per rank"
                 if self.parallel != "none" else "1 GPU")
        every = f", ac_every {self.ac_every}" if self.checkpointing == "selective" else ""
        accum = f", grad_accum {self.grad_accum}" if self.grad_accum > 1 else ""
        graphs = ", cuda_graphs" if self.graph_pool else ""
        return f"activation_checkpointing {self.checkpointing}{every}, {where}{accum}{graphs}"


@dataclass(frozen=True)
class _Key:
    """A spec reduced to what shapes its module (the shape fields and the weight dtype): cells that differ
    only in stack, recipe or schedule share one probe."""

    key: tuple[Any, ...]
    batch: int
    spec: Any = field(compare=False, hash=False)


def _key(spec: Any, batch: int) -> _Key:
    shape = tuple((name, getattr(spec, name)) for name in axis_fields("shape")
                  if name not in ("batch_size", "tokens_per_step", "grad_accum"))  # the probe runs one micro-batch
    return _Key((*shape, spec.precision == "fp32"), batch, spec)


def probe(spec: Any, batch_size: int | None = None) -> Probe | None:
    """The cell's module run once under fake tensors at ``batch_size`` rows (default the spec's); None where it
    cannot be run so (then the plan is a guess: :func:`unplanned` says why)."""
    got = _probe(_key(spec, batch_size or spec.batch_size))
    return got if isinstance(got, Probe) else None


def unplanned(spec: Any, batch_size: int | None = None) -> str | None:
    """Why the cell's module cannot run under fake tensors (its plan is then a guess), in one line; None where it
    can."""
    got = _probe(_key(spec, batch_size or spec.batch_size))
    return got if isinstance(got, str) else None


@functools.lru_cache(maxsize=64)
def _probe(key: _Key) -> Probe | str:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import models
    from ..parallel.checkpointing import SavedBytes
    from ..workloads.loss import next_token_loss
    from .metrics import weight_gemm_counter

    spec = key.spec
    precision = "fp32" if spec.precision == "fp32" else "bf16"
    try:
        with torch.random.fork_rng(devices=[]):  # the build seeds torch's RNG: leave the trial's as it was
            built = models.build(spec, precision, "meta")  # no memory, no init
        model = built.model
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, _grouped_gemm_shapes(), _unpacked_positions(), \
                _quiet_fake_tensor_log():
            _to_fake(model, mode)
            ids = torch.zeros(key.batch, spec.seq_len, dtype=torch.long)
            with SavedBytes(model, units=built.units) as saved:
                with weight_gemm_counter() as counter:
                    logits = model(ids)
                next_token_loss(logits, torch.zeros_like(ids))  # the targets: a storage of their own, as the trial's
        params = list(model.parameters())
        n_params = sum(p.numel() for p in params)
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        largest = max((sum(p.numel() for p in model.get_submodule(u).parameters()) for u in built.units),
                      default=0)
        inside = {id(p) for u in built.units for p in model.get_submodule(u).parameters()}
        outside = sum(p.numel() * p.element_size() for p in params if id(p) not in inside)
        head = model.get_submodule(built.logits_layer) if built.logits_layer else None
        gemm = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    except Exception as exc:  # noqa: BLE001 - a module fake tensors cannot run (data-dependent code, ...)
        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        log.info("%s: not planned from the module (%s); the memory plan is a guess", spec.model, why)
        return why
    acts = Activations(saved.outside, tuple(saved.per_unit), tuple(saved.unit_inputs))
    return Probe(n_params, weight_bytes, largest, acts, float(counter.get_total_flops()), gemm, outside)


def _grouped_gemm_shapes() -> Any:
    """A dispatch mode for the probe: torch's meta kernel for ``aten._grouped_mm`` takes BF16 only (the CUDA
    kernel's rule), while the CPU kernel takes fp32 too, so an fp32 MoE model (transformers' grouped experts) trained
    on CPU but failed the probe, whose plan was then a guess. Under it an fp32 grouped GEMM takes its output's shape
    from the BF16 meta kernel; what it saves for backward is the real run's (autograd saves above any dispatch mode)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class GroupedGemmShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
                a, b, *rest = args
                return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(torch.float32)
            return func(*args, **kwargs)

    return GroupedGemmShapes()


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs a whole traceback at ERROR when an op's meta kernel raises under fake tensors, before the
    exception reaches the probe, which turns it into one line (:func:`unplanned`)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """transformers looks for packed sequences by reading the position ids' values, which fake tensors do not
    have; it then builds an explicit (b, 1, t, t) mask, which SDPA saves in every layer, where the real run
    (contiguous positions, as in every trial) finds none and takes SDPA's is_causal path with no mask. Tell
    it, for the probe, what the real run finds."""
    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


def _to_fake(model: Any, mode: Any) -> None:
    """Swap a meta-device module's parameters and buffers for fake CPU tensors of the same shape and dtype, in
    place, tied ones staying tied (the CPU kernels' choices, e.g. SDPA's, are then the ones a CPU run makes;
    ``Module.to`` under fake tensors cannot move tied weights)."""
    import torch
    import torch.nn as nn

    fakes: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if id(t) not in fakes:
            empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            fakes[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return fakes[id(t)]

    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None:
                        table[name] = fake(t)


def loss_saved_bytes(rows: int, seq: int, vocab: int, width: int) -> int:
    """What the trial's loss keeps for backward on (rows, seq, vocab) logits of ``width`` bytes each, counted as the
    probe counts it, under fake tensors: a guessed plan's only activations (its module does not run so)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..parallel.checkpointing import SavedBytes
    from ..workloads.loss import next_token_loss

    if not vocab:
        return 0
    with FakeTensorMode():
        logits = torch.empty(rows, seq, vocab, dtype=torch.float32 if width == 4 else torch.bfloat16,
                             requires_grad=True)
        with SavedBytes(torch.nn.Module()) as saved:
            next_token_loss(logits, torch.zeros(rows, seq, dtype=torch.long))
    return saved.bytes


def plan(spec: Any, checkpointing: str | None = None, parallel: str | None = None,
         world_size: int | None = None, batch_size: int | None = None) -> MemoryPlan:
    """One rank's memory for a training step of ``spec`` (or of it with the given settings changed;
    ``batch_size``: rows per rank; selective recomputes every ``spec.ac_every``-th unit)."""
    from .. import models
    from ..backends import STACKS, recipe_owner

    setting = checkpointing or spec.activation_checkpointing
    parallel = parallel or spec.parallel
    world = world_size or spec.world_size
    width = 4 if spec.precision == "fp32" else 2
    batch = batch_size or spec.batch_size
    vocab = models.describe(spec).shape.get("vocab") or spec.vocab or 0
    got = probe(spec, batch)
    if got is None:  # a unit's size unknown: the parameters over the layers; nothing known outside them but the loss
        facts = models.describe(spec)
        n = facts.n_params or 0
        layers = facts.shape.get("n_layers") or spec.n_layers
        weights, largest, outside, again, guess = n * width, n // layers if layers else 0, 0, 0, True
        acts = loss_saved_bytes(batch, spec.seq_len, vocab, width)
    else:
        n, weights, largest, guess = got.n_params, got.weight_bytes, got.largest_unit_params, False
        outside = got.outside_weight_bytes
        acts = got.activations.held(setting, spec.ac_every)
        again = got.activations.peak(setting, spec.ac_every) - acts
    stack = STACKS.get(recipe_owner(spec.recipe) or "")
    masters = spec.precision == "fp8" and spec.fp8_all_gather and stack is not None and stack.fp8_all_gather_masters
    grads = weights
    optimizer = n * FP8_MASTER_STATE_BYTES if masters else 2 * weights
    if spec.precision == "fp8" and stack is not None and not masters and got is not None:
        weights += got.gemm_params * stack.fp8_weight_cache_bytes  # TE's FP8 weight copies, kept between steps
    if parallel == "fsdp":
        # every parameter sharded; the root's own (outside the units) whole besides, from its forward to the
        # end of backward; two units whole at a time
        weights = weights // world + outside + GATHERED_UNITS * largest * width
        # set_requires_gradient_sync(False) until a step's last micro-batch: whole gradients besides the shards
        grads, optimizer = grads // world + (grads if spec.grad_accum > 1 else 0), optimizer // world
    elif parallel == "ddp":
        grads = 2 * grads  # DDP's buckets hold a copy of the gradients (gradient_as_bucket_view is off)
    logits = batch * spec.seq_len * vocab * (width + LOGITS_BYTES)
    pool = 0
    if spec.cuda_graphs and got is not None and setting == "none" and parallel == "none":  # (graphs refuse both)
        pool, acts, logits, grads = graph_parts(spec, got, width, batch, vocab, grads)
    return MemoryPlan(weights, grads, optimizer, acts, logits, setting, spec.ac_every, parallel, world, batch,
                      guess, again, spec.grad_accum, pool)


def graph_parts(spec: Any, got: Probe, width: int, batch: int, vocab: int, grads: int) -> tuple[int, int, int, int]:
    """(graph pool, eager activations, eager logits, gradients outside the pool) of a ``cuda_graphs`` training cell,
    from the probe, as trials/workloads/train_step.py graphs it (``grads``: every parameter's gradient bytes).

    MiniGPT (its source's ``graphs_whole``): one graph of the whole forward, whose static output is the logits (and
    their gradient); only the loss runs eager. Any other model: each unit its own graph, its static inputs the
    tensors it is handed (a copy each: the hidden states, RoPE's cos and sin, ...) and, of its hidden state's size,
    the :data:`GRAPH_IO_COPIES`; what a unit saves of its own input is that static input; the root (embeddings,
    final norm, head, the loss) and the logits eager as before. The graphed parameters' gradients are static
    buffers of the pool, which autograd keeps as ``.grad`` (torch's graphs and TE's, as trials/backends/te_compat.py
    asks); under accumulation the gradients are kept allocated outside the graphs, every one besides the pool.
    The pool holds the saved bytes and the gradients together, not the larger of them: every forward graph is
    captured, its saves held, before the first backward graph, and a backward's gradient buffers (a 4096 x 14336
    weight's: 112 MiB) rarely fit the blocks the saves it frees leave (56 MiB at most there), so the allocator
    reuses little of them (docs/guide/memory.md, "CUDA graphs": measured 0.62-1.03 of this sum on an H100)."""
    acts = got.activations
    logits = batch * spec.seq_len * vocab
    outside_kept = spec.grad_accum > 1
    if spec.source.graphs_whole:
        loss = loss_saved_bytes(batch, spec.seq_len, vocab, width)
        static = 2 * logits * width + batch * spec.seq_len * 8  # the logits and their gradient; the int64 ids
        pool = static + acts.held() - loss + grads
        return pool, loss, logits * LOGITS_BYTES, grads if outside_kept else 0
    static = saved = 0
    for own, handed in zip(acts.units, acts.unit_inputs):
        static += sum(handed.values()) + GRAPH_IO_COPIES * max(handed.values(), default=0)
        saved += sum(size for key, size in own.items() if key not in handed)
    pool = static + saved + grads - got.outside_weight_bytes
    return (pool, sum(acts.outside.values()), logits * (width + LOGITS_BYTES),
            grads if outside_kept else got.outside_weight_bytes)


def host_kept_bytes(spec: Any) -> int:
    """What one rank of a cell on a GPU keeps in host memory (its model, data and activations are on the GPU): an
    FP8 cell's teacher-forced log-probabilities, its own and its BF16 partner's, fp32 over at most ``HELD_LEN``
    positions each (trials/workloads/teacher_forced.py). On CPU a rank keeps its whole :func:`plan` there."""
    from .. import models
    from ..workloads.teacher_forced import HELD_LEN

    if spec.precision != "fp8":
        return 0
    vocab = models.describe(spec).shape.get("vocab") or spec.vocab or 0
    return 2 * HELD_LEN * vocab * 4


def record_fields(spec: Any) -> dict[str, int | None]:
    """The record's estimate (beside the measured peak); nothing where planning itself fails: an estimate
    never fails a trial."""
    try:
        got = plan(spec)
    except Exception as exc:  # noqa: BLE001
        log.warning("memory plan failed: %s: %s", type(exc).__name__, exc)
        return {}
    return {"est_peak_mem_bytes": got.total, "est_activation_bytes": None if got.guess else got.activations,
            "est_graph_pool_bytes": got.graph_pool if spec.cuda_graphs and not got.guess else None}


# Settings tried, cheapest first, for a cell that does not fit: recompute before more GPUs
FIT_CHECKPOINTING = ("none", "selective", "full")
FIT_RANKS = (1, 2, 4, 8)


def cheapest_fit(spec: Any, limit_bytes: int) -> MemoryPlan | None:
    """The first plan, in the order above (checkpointing on the cell's ranks, then FSDP2 over more, the global
    batch kept: fewer rows per rank), under ``limit_bytes``; None where nothing up to 8 ranks fits."""
    rows = spec.batch_size * spec.world_size  # the global batch
    for world in (w for w in FIT_RANKS if w >= spec.world_size and rows % w == 0):
        parallel = spec.parallel if world == spec.world_size else "fsdp"
        for setting in FIT_CHECKPOINTING:
            got = plan(spec, setting, parallel, world, rows // world)
            if got.total <= limit_bytes:
                return got
    return None
