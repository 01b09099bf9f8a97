"""``trackers: [{wandb: {project: ..., mode: offline|online}}]``: one W&B run per trial.

Ray Tune's ``WandbLoggerCallback``: the config (spec, sample, cell id) as the run's config, every
numeric result and the string fields (status, git revision, GPU) as its summary; the sweep name, run
id, cell id and sample are tags, the sweep the group. ``mode: offline`` (the default) writes run
files for ``wandb sync``.
"""

from __future__ import annotations

import os
from typing import Any

from ray.air.integrations.wandb import WandbLoggerCallback, _WandbLoggingActor

from .base import trial_tags


class _LoggingActor(_WandbLoggingActor):
    """Ray's logging actor (one per trial), ending with ``wandb.teardown()``, which waits for W&B's service
    process to write everything out. Ray kills the actor as soon as ``run`` returns, and the service with it;
    W&B's own teardown, an atexit hook, never runs in a killed process. Without it a quick trial's offline run
    was left as a 7-byte file with no run record in it (the suite's tracked sweep, on a loaded 2-core host)."""

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._wandb.teardown()


class _Callback(WandbLoggerCallback):
    _logger_actor_cls = _LoggingActor

    def log_trial_start(self, trial: Any) -> None:
        """Start the trial's run with the sweep's tags plus its own cell and sample."""
        base = list(self.kwargs.get("tags", []))
        self.kwargs["tags"] = base + [f"{k}={v}" for k, v in trial_tags(trial).items()]
        try:
            super().log_trial_start(trial)
        finally:
            self.kwargs["tags"] = base


def build(options: dict[str, Any], run_tags: dict[str, str]) -> WandbLoggerCallback:
    extra = {k: options[k] for k in ("entity", "dir") if k in options}
    mode = options.get("mode", "offline")
    os.environ["WANDB_MODE"] = mode  # Ray asks for an API key unless the environment says offline
    if "dir" in options:
        os.makedirs(options["dir"], exist_ok=True)
    return _Callback(project=options["project"], mode=mode, log_config=True,
                     group=run_tags["sweep"], tags=[f"{k}={v}" for k, v in run_tags.items()], **extra)
