"""``trackers: [{tensorboard: {}}]``: TensorBoard event files in each trial's Tune directory.

Tune writes them already when tensorboardX is installed (it is a ``ray[tune]`` dependency); naming the
tracker makes that explicit and is checked at validation.
"""

from __future__ import annotations

from typing import Any

from ray.tune.logger import TBXLoggerCallback


def build(options: dict[str, Any], run_tags: dict[str, str]) -> TBXLoggerCallback:
    return TBXLoggerCallback()
