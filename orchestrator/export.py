"""Records already on disk -> MLflow: one run per record, idempotent.

    juicytalk export docs/results/h200/results.parquet --mlflow sqlite:///mlflow.db [--experiment h200]

Each run holds the spec (and sample, cell id) as params, every numeric record field as a metric, the
training loss curve and the timed step times as metric histories, and the same tags a sweep's MLflow
tracker sets. A run is keyed by its record (sweep, cell, sample, time written): exporting the same
records again finds their runs and adds nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from trials.spec import TrialSpec

from .store import read_results
from .trackers.base import RESULT_TAGS
from .trackers import mlflow_uri

log = logging.getLogger(__name__)

RECORD_TAG = "juicytalk.record"
HISTORIES = {"loss": "loss_curve", "step_ms": "step_times_ms"}
BATCH = 1000  # MLflow's log_batch limit on metrics


@dataclass
class ExportSummary:
    experiment: str
    created: int
    already: int


def record_key(rec: dict[str, Any]) -> str:
    return f"{rec.get('sweep_name')}/{rec['cell_id']}-s{rec['sample']}@{rec.get('recorded_at')}"


def export_mlflow(path: str, tracking_uri: str, experiment: str | None = None) -> ExportSummary:
    import mlflow
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    records = read_results(path).to_pylist()
    mlflow_uri.prepare(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    name = experiment or (records[0].get("sweep_name") if records else None) or "juicytalk"
    found = client.get_experiment_by_name(name)
    exp_id = found.experiment_id if found else client.create_experiment(name)
    mlflow.set_tracking_uri(tracking_uri)
    existing = {run.data.tags.get(RECORD_TAG) for run in
                mlflow.search_runs(experiment_ids=[exp_id], output_format="list")}
    spec_fields = set(TrialSpec.field_names()) | {"sample", "cell_id"}
    created = 0
    for rec in records:
        key = record_key(rec)
        if key in existing:
            continue
        tags = {RECORD_TAG: key, "sweep": str(rec.get("sweep_name")), "run_id": str(rec.get("run_id")),
                "cell_id": str(rec["cell_id"]), "sample": str(rec["sample"]),
                **{k: str(rec[k]) for k in RESULT_TAGS if rec.get(k) is not None}}
        run = client.create_run(exp_id, run_name=f"{rec.get('cell_label')}-s{rec['sample']}", tags=tags)
        now = int(time.time() * 1000)
        params = [Param(k, str(rec[k])) for k in sorted(spec_fields) if rec.get(k) is not None]
        metrics = [Metric(k, float(v), now, 0) for k, v in rec.items()
                   if k not in spec_fields and isinstance(v, (int, float)) and not isinstance(v, bool)]
        for metric, field in HISTORIES.items():
            metrics += [Metric(metric, float(v), now, i) for i, v in enumerate(rec.get(field) or [])]
        client.log_batch(run.info.run_id, params=params, tags=[RunTag(k, v) for k, v in tags.items()])
        for i in range(0, len(metrics), BATCH):
            client.log_batch(run.info.run_id, metrics=metrics[i:i + BATCH])
        client.set_terminated(run.info.run_id, "FINISHED" if rec.get("status") == "ok" else "FAILED")
        existing.add(key)
        created += 1
    log.info("exported %d records to %s (experiment %s)", created, tracking_uri, name)
    return ExportSummary(name, created, len(records) - created)
