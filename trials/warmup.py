"""A trial process's one-time costs, paid before its first trial: the first cell's first steps, untimed.

A process pays once what its first training step meets for the first time: Transformer Engine compiles its
fused element-wise functions with torch.compile (TE's ``jit_fuser``: 10.9 s of the seed example's first step
on an H200), a ``compile: true`` cell compiles its graphs, cuBLAS and cuDNN load and pick their kernels. A
trial server the sweep's driver starts while Ray starts (``orchestrator/launchers/prestart.py``) has that
time to spare: told the cell it will most likely run first, it runs :data:`WARM_UP_STEPS` training steps of
it here and frees everything, so those compiles sit in the process's caches when the trial arrives.

The trial then runs as a later trial of a warm process does: its own seeded model, optimizer and data; what
the warm-up leaves behind is what an earlier trial leaves (compiled code, loaded kernels), never memory or
FP8 state (the same release as :func:`trials.trial.run_trial`'s). Its record says so
(``process_warm_up_s``). Single-rank training cells on a GPU only: on a CPU eager cells have nothing to
compile and the steps would take the cores Ray's start is using; serving cells train in BF16 first and
their one-time costs are their decode's.
"""

from __future__ import annotations

import logging
import time

import torch

from . import memory, te_compat
from .capability import probe, resolve, wants_torchao
from .data import ArithmeticSequences
from .models.common import output_vocab
from .spec import TrialSpec
from .train import build_train_step, train

log = logging.getLogger(__name__)

WARM_UP_STEPS = 2  # the first step compiles; the second meets what the first step's optimizer state changed


def applies(spec: TrialSpec) -> bool:
    """Whether a warm-up at ``spec`` can save its trial anything (see the module's docstring)."""
    return (spec.workload == "train" and spec.world_size == 1 and spec.parallel == "none"
            and spec.device != "cpu" and torch.cuda.is_available())


def warm_up(spec: TrialSpec) -> float | None:
    """Run ``spec``'s first :data:`WARM_UP_STEPS` training steps untimed and release what they used; the seconds
    taken, or None where it does not apply or failed (a failure is logged; the trial will meet and record it)."""
    if not applies(spec):
        return None
    t0 = time.perf_counter()
    try:
        res = resolve(spec, probe(spec.device, want_te=spec.backend in ("te", "auto"),
                                  want_torchao=wants_torchao(spec)))
        if res.unsupported or res.device != "cuda":
            return None
        step = build_train_step(spec, res.backend, res.precision, res.device)
        data = ArithmeticSequences(spec.vocab or output_vocab(step.model, res.device), spec.seq_len, res.device,
                                   spec.seed)
        train(step, data, WARM_UP_STEPS, spec.batch_size)
        del step, data
    except Exception as exc:  # noqa: BLE001 - a saving, never a failure of its own
        log.warning("warm-up failed (%s: %s); the trial runs cold", type(exc).__name__, (str(exc).splitlines() or [""])[0])
        return None
    finally:
        te_compat.reset_te_state()
        memory.release("cuda")
    seconds = time.perf_counter() - t0
    log.info("warmed up in %.1f s", seconds)
    return seconds
