"""The training step (optionally CUDA-graphed) and the short training run.

One step = forward (inside FP8 autocast for fp8 cells), fp32 cross-entropy, backward, AdamW (or the
optimizer a stack brings: TE's FP8 primary weights train with FusedAdam's fp32 masters).
A step returns its loss as a device tensor and never syncs with the host: losses are collected on
the device and read once at the end, so the loop runs as fast as the GPU allows.
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
import torch.nn.functional as F

from .. import backends, models
from ..parallel import checkpointing, ranks as distributed
from ..backends import te_compat
from ..backends import Built
from .data import ArithmeticSequences
from ..models.minigpt_net import MiniGPT
from ..spec import TrialSpec

log = logging.getLogger(__name__)


WEIGHT_DECAY = 0.01  # AdamW's decoupled weight decay (torch's default), for every stack's optimizer


def make_optimizer(model: nn.Module, lr: float, device: str) -> torch.optim.Optimizer:
    """AdamW; the fused CUDA kernel on GPUs (one launch for all parameters), foreach elsewhere."""
    if device == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=True)


class _GraphRoot(nn.Module):
    """Thin wrapper that is graphed instead of MiniGPT itself.

    ``te.make_graphed_callables`` patches the ``__call__`` of the graphed module's *class*; a fresh
    subclass per capture keeps that patch away from every other MiniGPT in the process.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


class TrainStep:
    """Callable ``step(x, y) -> loss`` (a 0-d device tensor) for a stack's built model."""

    def __init__(self, built: Built, lr: float, device: str, amax_group: Any = None,
                 checkpointed: checkpointing.Checkpointed | None = None, compiled: bool = False):
        self.built = built
        self.compiled = compiled  # torch.compile'd (units or the whole model): no measuring hooks in its steps
        self.checkpointed = checkpointed or checkpointing.Checkpointed()  # the units recomputed in backward
        self.amax_group = amax_group  # where TE's delayed scaling reduces amaxes (multi-rank trials)
        self.model: MiniGPT = built.model  # or any model mapping ids (b, t) -> logits (b, t, vocab) (trials/models)
        self.te = built.te
        self.recipe = built.recipe
        self.optimizer = (make_optimizer(self.model, lr, device) if built.make_optimizer is None
                          else built.make_optimizer(self.model, lr))
        self.forward: Callable[[torch.Tensor], torch.Tensor] = self.model if built.forward is None else built.forward
        self.graphed = False

    @property
    def compiled_graphs(self) -> int | None:
        """The compiled graphs one step runs, at least (None where nothing is compiled): one per unit, each
        compiled with its checkpoint inside, or one for a model compiled whole."""
        return (len(self.built.units) or 1) if self.compiled else None

    def capture(self, sample: torch.Tensor) -> None:
        """Capture forward and backward as CUDA graphs (the optimizer step stays eager)."""
        if self.te is not None:
            root_cls = type("GraphedMiniGPT", (_GraphRoot,), {})
            root = root_cls(self.model)
            self.forward = te_compat.make_graphed_callables(self.te, root, (sample,), self.recipe)
        else:
            self.forward = torch.cuda.make_graphed_callables(self.model, (sample,))
        self.graphed = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with te_compat.autocast(self.te, self.recipe, self.amax_group):
            logits = self.forward(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))  # shifted: y is x's next token
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.built.after_step is not None:
            self.built.after_step()
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
    return TrainStep(built, spec.lr, device, distributed.amax_group(ranks), checkpointed, compiled=spec.compile)


@dataclass
class TrainResult:
    losses: list[float]
    first_step_s: float  # the first step alone, synced: where TE's fusers and cuDNN plans compile
    saved_bytes: int | None = 0  # held for backward by the first step's forward (checkpointing.SavedBytes); None: compiled


def train(step: TrainStep, data: ArithmeticSequences, steps: int, batch: int,
          after_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run ``steps`` steps on fresh batches; the loss curve is read from the device once, at the end.

    The first step is timed apart (one sync after it): it holds the one-off compiles, and a process
    that runs many trials pays them once per shape instead of once per trial. It is also the step whose
    saved tensors are counted (untimed by the benchmark, so the hooks disturb no step time), except in a compiled
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
