"""Trackers: where a sweep's trials show up besides the Parquet store (MLflow, W&B, TensorBoard).

Each is a module built on Ray Tune's own callbacks; the sweep file names them under ``trackers``.
Every tracker sees each trial's config (the flattened spec, ``sample``, ``cell_id``) and its results
(every numeric record field, ``status``, and the tags below), and tags each run with the sweep name,
the run id, the cell id, the sample, the git revision and the GPU name.
"""

from __future__ import annotations

from .base import TRACKERS, Tracker, TrackerError, build_callbacks, check_trackers

__all__ = ["TRACKERS", "Tracker", "TrackerError", "build_callbacks", "check_trackers"]
