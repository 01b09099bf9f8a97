"""Workloads: what a trial measures once its device and backend are resolved.

Each is a module with one ``run(spec, resolution, model_config, record, t0)`` that fills the record in
place (raising is fine: ``run_trial`` turns exceptions into ``error``/``oom`` records) and may return
a callable whose record fields ``run_trial`` adds once the cell's memory peaks are recorded (training's
teacher-forced comparison, which trains a second model):

    train   build, train briefly, time forward+backward+optimizer steps, check generation
    infer   train briefly in BF16, build the inference model (BF16 or FP8 weights), time prefill and
            KV-cached decode, compare FP8 tokens with BF16's
"""

from __future__ import annotations

from typing import Callable

from . import inference, training

WORKLOADS: dict[str, Callable] = {"train": training.run, "infer": inference.run}
