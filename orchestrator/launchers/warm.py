"""``launcher: warm``: one long-lived trial process per GPU runs trial after trial.

Imports, CUDA initialisation and TE's fuser compiles (once per shape) are paid once per process
instead of once per trial. Between trials the process frees memory, clears cuBLAS workspaces and
TE's FP8 global state, and starts every memory counter afresh (:mod:`trials.server`), so each
record's figures are its own. The process is replaced after a trial that ends in oom, error,
diverged or timeout, after a TorchDynamo recompile-limit hit, and after ``warm_max_trials`` trials.
"""

from __future__ import annotations

from .base import Launcher, LaunchSettings


class WarmLauncher(Launcher):
    name = "warm"

    @staticmethod
    def process_trials(settings: LaunchSettings) -> int:
        return settings.warm_max_trials
