"""``trackers: [{tensorboard: {}}]``: TensorBoard event files in each trial's Tune directory.

Only where the sweep names this tracker: Tune would write them for every sweep (tensorboardX is a
``ray[tune]`` dependency), but its logger imports torch into the driver (~2 s of CPU a sweep), so the
runner turns Tune's automatic loggers off and names its CSV and JSON ones (orchestrator/runner.py).
"""

from __future__ import annotations

from typing import Any

from ray.tune.logger import TBXLoggerCallback


def build(options: dict[str, Any], run_tags: dict[str, str]) -> TBXLoggerCallback:
    return TBXLoggerCallback()
