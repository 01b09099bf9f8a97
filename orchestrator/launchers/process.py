"""``launcher: process``: every trial in a fresh process with its own CUDA context.

The strongest isolation: nothing of one trial (allocator state, compiled kernels, TE's globals) can
reach the next. What it no longer costs is idle GPU time: the next trial process is spawned as soon
as the previous one has exited, and it imports torch and TE while Tune schedules the next trial.
Each trial still pays CUDA initialisation and TE's first-step fuser compiles (cut by the persistent
compile cache).
"""

from __future__ import annotations

from .base import Launcher


class ProcessLauncher(Launcher):
    name = "process"

    @property
    def trials_per_process(self) -> int:
        return 1
