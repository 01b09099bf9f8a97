"""``trackers: [{mlflow: {tracking_uri: ..., experiment: ...}}]``: one MLflow run per trial.

Ray Tune's ``MLflowLoggerCallback`` logs the config as params and the results as metrics; this
subclass adds the per-trial tags (cell, sample, git revision, GPU, status).
"""

from __future__ import annotations

from typing import Any

from ray.air.integrations.mlflow import MLflowLoggerCallback

from . import mlflow_uri
from .base import trial_tags


class _Callback(MLflowLoggerCallback):
    def log_trial_result(self, iteration: int, trial: Any, result: dict[str, Any]) -> None:
        super().log_trial_result(iteration, trial, result)
        client = self.mlflow_util._mlflow.tracking.MlflowClient()
        for key, value in trial_tags(trial, result).items():
            client.set_tag(self._trial_runs[trial], key, value)


def build(options: dict[str, Any], run_tags: dict[str, str]) -> MLflowLoggerCallback:
    mlflow_uri.prepare(options["tracking_uri"])
    return _Callback(tracking_uri=options["tracking_uri"], experiment_name=options.get("experiment") or
                     run_tags["sweep"], tags=dict(run_tags), save_artifact=False)
