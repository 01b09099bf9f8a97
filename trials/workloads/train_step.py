"""The training step (optionally CUDA-graphed) and the short training run.

One step = forward (inside FP8 autocast for fp8 cells), fp32 cross-entropy, backward, AdamW (or the
optimizer a stack brings: TE's FP8 primary weights train with FusedAdam's fp32 masters).
A step returns its loss as a device tensor and never syncs with the host: losses are collected on
the device and read once at the end, so the loop runs as fast as the GPU allows.

With ``grad_accum`` > 1 a step is one optimizer step over the rows it is given, in ``grad_accum`` micro-batches:
each one's forward and backward, its loss divided by ``grad_accum`` so the gradients sum to the whole batch's
mean (micro-batches are equal, so the update is the unsplit one up to rounding); ranks reduce gradients on the
last only (trials/parallel/ranks.py ``held_gradients``); TE casts its FP8 weights on the first only
(trials/backends/te_microbatch.py). The step's loss is the micro-batches' mean.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import backends, models
from ..parallel import checkpointing, ranks as distributed
from ..backends import te_compat
from ..backends import Built
from ..backends.te_microbatch import FirstMicroBatch
from ..measure import memory
from .data import ArithmeticSequences
from .loss import next_token_loss
from .graph_capture import sound_after_failure
from .unit_graphs import ROOT_EAGER, GraphFacts, UnitGraphs, record_calls, refusal, torch_graphed
from ..models.minigpt_net import MiniGPT
from ..spec import TrialSpec

log = logging.getLogger(__name__)


WEIGHT_DECAY = 0.01  # AdamW's decoupled weight decay (torch's default), for every stack's optimizer
WHOLE_EAGER = "the whole forward graphed; the loss and the optimizer step run eager"  # cuda_graphs_why, capture(whole)


def make_optimizer(model: nn.Module, lr: float, device: str) -> torch.optim.Optimizer:
    """AdamW; the fused CUDA kernel on GPUs (one launch for all parameters), foreach elsewhere."""
    if device == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=True)


class _GraphRoot(nn.Module):
    """Thin wrapper that is graphed instead of MiniGPT itself.

    A graphed module's ``forward`` is replaced (torch's and TE's), so the model's own stays eager for its other
    callers (another batch shape replaying the graph would copy broadcast inputs); ``te.make_graphed_callables`` also
    patches the ``__call__`` of the graphed module's *class*: a fresh subclass per capture keeps that patch away
    from every other MiniGPT in the process.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


class TrainStep:
    """Callable ``step(x, y) -> loss`` (a 0-d device tensor) for a stack's built model."""

    def __init__(self, built: Built, lr: float, device: str, amax_group: Any = None,
                 checkpointed: checkpointing.Checkpointed | None = None, compiled: bool = False,
                 grad_accum: int = 1, parallel: str = "none", wrapped: nn.Module | None = None):
        self.built = built
        self.grad_accum = grad_accum  # micro-batches per optimizer step
        self.parallel = parallel
        self.wrapped = wrapped  # what ranks.wrap returned (DDP, or the FSDP2-sharded model): it holds gradients
        self.compiled = compiled  # torch.compile'd (units or the whole model): no measuring hooks in its steps
        self.checkpointed = checkpointed or checkpointing.Checkpointed()  # the units recomputed in backward
        self.amax_group = amax_group  # where TE's delayed scaling reduces amaxes (multi-rank trials)
        self.model: MiniGPT = built.model  # or any model mapping ids (b, t) -> logits (b, t, vocab) (trials/models)
        self.te = built.te
        self.recipe = built.recipe
        self.optimizer = (make_optimizer(self.model, lr, device) if built.make_optimizer is None
                          else built.make_optimizer(self.model, lr))
        self.forward: Callable[..., torch.Tensor] = self.model if built.forward is None else built.forward
        self.graphed = False
        # TE under accumulation: FP8 weights cast on a step's first micro-batch, reused after
        self.first_microbatch = FirstMicroBatch(self.model) if self.te is not None and grad_accum > 1 else None
        self.graph_kwargs: Callable[[bool], dict[str, Any]] = lambda first: {}  # what a graphed forward is told
        self.kept_grads: list[nn.Parameter] = []  # graphed under accumulation: gradients kept allocated (capture)
        self.unit_graphs: UnitGraphs | None = None  # each unit graphed, the root eager (capture, whole=False)

    @property
    def compiled_graphs(self) -> int | None:
        """The compiled graphs one step runs, at least (None where nothing is compiled): one per unit, each
        compiled with its checkpoint inside, or one for a model compiled whole. None too where the compiled code is
        graphed: a replay runs its kernels, not the compiled region the profiler counts."""
        return (len(self.built.units) or 1) if self.compiled and not self.graphed else None

    def capture(self, sample: torch.Tensor, whole: bool = True) -> GraphFacts:
        """Capture forward and backward of one micro-batch (``sample``'s shape) as CUDA graphs; the loss and the
        optimizer step stay eager (trials/workloads/unit_graphs.py says why the optimizer does). ``whole``: the
        model's forward as one graph (MiniGPT's, which runs no host code); else each unit's as its own, the root
        eager between them (trials/workloads/unit_graphs.py), or, where the units cannot be graphed, nothing, the
        returned facts saying why; a unit whose capture fails raises ``Unsupported``. Under accumulation the graphs
        replay once per micro-batch: TE's cast the FP8 weights where told ``is_first_microbatch``. Graphs hand back
        gradients in their static buffers, which autograd may keep as ``.grad`` on a step's first micro-batch
        (torch's graphs, and TE's, told not to clone them: te_compat.make_graphed_callables) for the next replay to
        overwrite, so under accumulation every step starts with the gradients allocated (zeroed between steps, not
        freed; made again where a read between steps cleared them) and each micro-batch's is added."""
        cache = self.grad_accum > 1 and self.recipe is not None
        t0, units = time.perf_counter(), self.built.units
        if not whole:
            why = refusal(self.model, units)
            units, calls, why = record_calls(self.model, units, sample) if not why else ((), [], why)
            if why:
                log.warning("cuda_graphs: %s; the step runs eager", why)
                return GraphFacts(0, why=f"{why}; the step ran eager")
        pools = memory.graph_pools()
        with sound_after_failure():  # either capture, where it raises, leaves the process as it found it
            if not whole:
                try:
                    self.unit_graphs = UnitGraphs.capture(self.model, units, calls, self.te, self.recipe, cache)
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # host code in a unit (a sync, data-dependent control flow), torch's words
                    raise distributed.Unsupported(f"cuda_graphs: the units could not be captured: "
                                                  f"{type(exc).__name__}: {exc}") from exc
                graphs, eager = 2 * len(units), f"{len(units)} units graphed; {ROOT_EAGER}"
            else:  # MiniGPT's forward, whole, through a root of its own: the model's forward stays its own
                root = type("GraphedMiniGPT", (_GraphRoot,), {})(self.model)
                if self.te is not None:
                    self.forward = te_compat.make_graphed_callables(self.te, root, (sample,), self.recipe, cache)
                    if cache:
                        self.graph_kwargs = lambda first: {"is_first_microbatch": first}
                else:
                    self.forward = torch_graphed(root, (sample,))
                graphs, eager = 2, WHOLE_EAGER
        self.graphed = True
        if self.grad_accum > 1:
            self.kept_grads = [p for p in self.model.parameters() if p.requires_grad]
        torch.cuda.synchronize()
        after = memory.graph_pools()
        held, free = (None, None) if after is None or pools is None else (after[0] - pools[0], after[1] - pools[1])
        return GraphFacts(graphs * self.grad_accum, time.perf_counter() - t0, held, free, eager)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on ``x``, ``y`` (rows, seq): ``grad_accum`` micro-batches of rows / grad_accum."""
        for p in self.kept_grads:  # first step, or a read cleared them: each one cleared, not only where the first is
            if p.grad is None:  # (autograd may keep a graph's own gradient buffer as .grad: capture's docstring)
                p.grad = torch.zeros_like(p)
        if self.grad_accum == 1:
            loss = self._forward_backward(x, y, None)
        else:
            xs, ys = x.chunk(self.grad_accum), y.chunk(self.grad_accum)
            losses = []
            for i in range(self.grad_accum):
                if i == self.grad_accum - 1:  # the last: its backward reduces the ranks' summed gradients
                    losses.append(self._forward_backward(xs[i], ys[i], i == 0))
                    continue
                with distributed.held_gradients(self.wrapped, self.parallel):
                    losses.append(self._forward_backward(xs[i], ys[i], i == 0))
                if i == 0 and self.checkpointed.tally is not None:
                    self.checkpointed.tally.stop()  # the bytes one micro-batch holds: the first's
            loss = torch.stack(losses).mean()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.kept_grads)  # graphed under accumulation: kept (capture)
        if self.built.after_step is not None:
            self.built.after_step()
        return loss

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, first: bool | None) -> torch.Tensor:
        """One micro-batch's forward and backward, its loss scaled by 1 / grad_accum; ``first``: whether it is its
        step's first (None: the step is not split). Returns the unscaled loss, detached."""
        cast_once = (self.first_microbatch.micro_batch(first) if self.first_microbatch is not None and not self.graphed
                     else contextlib.nullcontext())
        kwargs = self.graph_kwargs(first) if first is not None else {}
        replay = self.unit_graphs.replaying(first) if self.unit_graphs is not None else contextlib.nullcontext()
        with te_compat.autocast(self.te, self.recipe, self.amax_group), cast_once, replay:
            logits = self.forward(x, **kwargs)
        loss = next_token_loss(logits, y)  # shifted: y is x's next token
        (loss if first is None else loss / self.grad_accum).backward()
        return loss.detach()


def build_train_step(spec: TrialSpec, backend: str, precision: str, device: str,
                     ranks: distributed.Ranks = distributed.SINGLE) -> TrainStep:
    """Seeded model, optimizer and step for one cell, built by its stack (``trials/backends``); its units
    checkpointed (``activation_checkpointing``), then compiled (``compile``: each unit, or the whole model where
    it has none), then with ``parallel`` the model wrapped (DDP) or sharded (FSDP2), as torchtitan orders them,
    before the optimizer sees its parameters. Every rank builds the same seeded model, so DDP and FSDP start from the one-process weights."""
    torch.manual_seed(spec.seed)
    built = backends.build(spec, backend, precision, device)
    models.require_units(spec, built.units)
    checkpointed = checkpointing.apply(built.model, built.units, spec.activation_checkpointing, spec.ac_every,
                                       built.te)
    if spec.compile and built.units:  # one compiled region per unit, inside its checkpoint wrapper (torchtitan)
        distributed.compile_units(built.model, built.units)
    if spec.parallel != "none":
        try:
            target = distributed.wrap(built.model, spec.parallel, device, ranks, built.units)
        except Exception as exc:  # TE's modules under FSDP2: where this TE cannot, the record says TE's reason
            if built.te is None:
                raise
            raise distributed.Unsupported(f"TE under {spec.parallel}: {type(exc).__name__}: {exc}") from exc
        built.forward = torch.compile(target) if spec.compile and not built.units else target
    else:
        target = built.model
    return TrainStep(built, spec.lr, device, distributed.amax_group(ranks), checkpointed, compiled=spec.compile,
                     grad_accum=spec.grad_accum, parallel=spec.parallel, wrapped=target)


@dataclass
class TrainResult:
    losses: list[float]
    first_step_s: float  # the first step alone, synced: where TE's fusers and cuDNN plans compile
    saved_bytes: int | None = 0  # held for backward by the first step's forward (checkpointing.SavedBytes); None: compiled


def train(step: TrainStep, data: ArithmeticSequences, steps: int, batch: int,
          after_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run ``steps`` steps on fresh batches of ``batch`` rows each (a rank's whole step: ``TrialSpec.step_rows``,
    which the step splits into its micro-batches); the loss curve is read from the device once, at the end.

    The first step is timed apart (one sync after it): it holds the one-off compiles, and a process
    that runs many trials pays them once per shape instead of once per trial. It is also the step whose
    saved tensors are counted (its first micro-batch's; untimed by the benchmark, so the hooks disturb no step time), except in a compiled
    model, whose units Dynamo would trace the hooks into (graph breaks, recompiles): ``saved_bytes`` is then None.
    ``after_step(i)``:
    called after step ``i`` (and after the first step's timing), for reads between steps (trials/measure/fp8_layers.py's
    outlier samples), which must leave training as it was.
    """
    device = data.device
    losses = torch.empty(steps, device=device, dtype=torch.float32)
    first_step_s = 0.0
    saved_bytes = None
    for i in range(steps):
        x, y = data.batch(batch)
        if i == 0:
            t0 = time.perf_counter()
            # no hooks in what Dynamo traces: the bytes a compiled step holds go unsaid
            with contextlib.nullcontext() if step.compiled else \
                    checkpointing.SavedBytes(step.model, step.checkpointed) as saved:
                losses[i] = step(x, y)
            _sync(device)
            first_step_s = time.perf_counter() - t0
            saved_bytes = None if saved is None else saved.bytes
        else:
            losses[i] = step(x, y)
        if after_step is not None:
            after_step(i)
    return TrainResult(losses.tolist(), first_step_s, saved_bytes)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fp8_state(model: nn.Module, entries: int = 4, modules: int = 4) -> str | None:
    """Delayed-scaling state (scale and newest amax per FP8 tensor) of MiniGPT's first block, or, in a model TE
    converted (no ``blocks``), of the first ``modules`` modules TE scales, as JSON."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and not blocks:
        return None
    root, prefix, limit = (blocks[0], "blocks.0", None) if blocks is not None else (model, "", modules)
    out = []
    scaled = set()  # the modules with state so far
    for name, module in root.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        if limit is not None and len(scaled) == limit:
            break
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            if state is None or not hasattr(state, "scale") or not hasattr(state, "amax_history"):
                continue
            out.append({
                "module": ".".join(p for p in (prefix, name) if p),
                "tensor_set": key,
                "scale": [float(v) for v in state.scale.flatten()[:entries].tolist()],
                # TE accumulates the running step's amax in row 0 and zeroes it after each scale
                # update, having rolled the finished row to the end: the newest complete amax is row -1.
                "amax_latest": [float(v) for v in state.amax_history[-1, :entries].tolist()],
                "amax_max": [float(v) for v in state.amax_history.amax(dim=0)[:entries].tolist()],
                "amax_history_len": int(state.amax_history.shape[0]),
            })
            scaled.add(name)
    return json.dumps(out) if out else None
