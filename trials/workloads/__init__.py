"""Workloads: what a trial measures once its device and backend are resolved.

Each is a module with one ``run(spec, resolution, model_config, record, t0)`` that fills the record in
place (raising is fine: ``run_trial`` turns exceptions into ``error``/``oom`` records) and may return
a callable whose record fields ``run_trial`` adds once the cell's memory peaks are recorded (training's
teacher-forced comparison, which trains a second model):

    train   build, train briefly, time forward+backward+optimizer steps, check generation
    infer   train briefly in BF16, build the inference model (BF16 or FP8 weights), time prefill and
            KV-cached decode, compare FP8 tokens with BF16's

and what they share: ``train_step`` (the step and the short training run), ``unit_graphs`` (a model's units
CUDA-graphed for training), ``graph_capture`` (a failed capture leaves the process sound), ``loss`` (the trial's loss), ``data`` (the seeded synthetic sequences),
``teacher_forced`` (the FP8 cell against its BF16 partner), ``generation`` (the stride check), ``decode`` and
``serving/`` (prefill and KV-cached decode, one module per way a model keeps its cache).
May import every other part of ``trials/`` (a workload is where they meet); ``trials.measure`` may read
``data``, ``loss`` and ``teacher_forced``'s held batch, which is why importing this package imports no workload.
Never Ray or ``orchestrator``.
"""

from __future__ import annotations

import importlib
from typing import Callable

WORKLOADS = {"train": "training", "infer": "inference"}  # workload field value -> its module here


def runner(workload: str) -> Callable:
    """The workload's ``run``, its module imported on first use: importing this package (as the modules that
    share its data and teacher-forced helpers do) imports no workload, so none of them forms a cycle through it."""
    return importlib.import_module(f"{__name__}.{WORKLOADS[workload]}").run
