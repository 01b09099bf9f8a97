"""Python's garbage collector during the timed steps: how often it ran and how long the step's host waited on it.

A step's host time is the Python that issues its kernels; a launch-bound step (the GPU idle while the host issues)
takes as long as that Python. CPython's cyclic collector runs whenever allocations pass its thresholds, and a
full (generation 2) pass walks every tracked object of the process: ~144 ms for the 380k objects a process
holds once torch, transformers and a 32-layer Llama are loaded (measured on this repository's CPU host). TE's
FP8 modules allocate many Python objects per step, so such a pass lands inside some steps and not others.
:class:`GcPauses` counts the collections per generation and their time over a block (``gc.callbacks``); it
changes nothing about when they run. Training frameworks that turn the automatic collector off and collect
every N steps (torchtitan's ``gc_freq``, Megatron-LM's ``--manual-gc``) do so for this reason.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Context manager: the collections of each generation that ran inside it, and the seconds they took."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation 0, 1, 2
        self.seconds = 0.0
        self._t = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def fields(self, steps: int) -> dict[str, Any]:
        """The record's ``timing_gc_*`` fields over ``steps`` timed steps."""
        return {"timing_gc_ms_per_step": self.seconds * 1e3 / max(steps, 1),
                "timing_gc_full_collections": self.collections[2]}

    def __str__(self) -> str:
        return f"{self.collections} collections (gen 0/1/2), {self.seconds * 1e3:.1f} ms"
