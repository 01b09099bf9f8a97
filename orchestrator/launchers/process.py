"""``launcher: process``: every trial in a fresh process with its own CUDA context.

The strongest isolation: nothing of one trial (allocator state, compiled kernels, TE's globals) can
reach the next. What it no longer costs is the imports: a server process imports torch and TE once,
never touches CUDA, and forks a fresh trial process for each spec - only after the previous one has
exited, so two CUDA contexts never share the GPU. Each trial still pays CUDA initialisation and TE's
first-step fuser compiles (cut by the persistent compile cache). Where importing TE initialised CUDA
(fork would then be unsafe), the server runs one trial itself and is replaced.
"""

from __future__ import annotations

from .base import Launcher, LaunchSettings


class ProcessLauncher(Launcher):
    name = "process"
    fork = True

    @staticmethod
    def process_trials(settings: LaunchSettings) -> int:
        return 1
