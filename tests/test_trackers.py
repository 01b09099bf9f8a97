"""Results where users look, with the real packages: MLflow, W&B (offline), TensorBoard from the sweep
file; `juicytalk export` of records on disk to MLflow; bad tracker entries refused before any trial."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.trackers import TRACKERS

from .conftest import REPO, juicytalk
from .test_cluster import records, write_sweep

def _mlflow_runs(uri: str, experiment: str):
    """Read back as a user would: no environment variables (a sqlite: store needs none)."""
    import mlflow

    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment], output_format="list")


def test_sweep_reaches_mlflow_wandb_and_tensorboard(tracked_sweep):
    tmp_path, run, uri = tracked_sweep  # the sweep file: conftest.TRACKED_SWEEP
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    recs = {(r["cell_id"], r["sample"]): r for r in records(tmp_path, "trk")}
    assert len(recs) == 4  # fp8 cells are unsupported on CPU: records too, and runs too

    runs = _mlflow_runs(uri, "trk-exp")
    assert len(runs) == 4
    for mrun in runs:
        rec = recs[(mrun.data.tags["cell_id"], int(mrun.data.tags["sample"]))]
        assert mrun.data.params["d_model"] == str(rec["d_model"]) and mrun.data.params["precision"] == rec["precision"]
        assert mrun.data.tags["status"] == rec["status"] and mrun.data.tags["sweep"] == "trk"
        assert mrun.data.tags["run_id"] == rec["run_id"] and mrun.data.tags["git_sha"] == rec["git_sha"]
        if rec["status"] == "ok":
            assert mrun.data.metrics["step_ms_p50"] == pytest.approx(rec["step_ms_p50"])

    offline = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(offline) == 4 and all(list(d.glob("*.wandb")) for d in offline)
    logged = [b"".join(f.read_bytes() for f in d.glob("*.wandb")) for d in offline]  # the runs' tags, as written
    assert all(b"sweep=trk" in data for data in logged)
    assert {c for c, _ in recs} == {c for c, _ in recs if any(f"cell_id={c}".encode() in data for data in logged)}

    [experiment] = (tmp_path / "trk" / "ray").iterdir()
    trial_dirs = [d for d in experiment.iterdir() if d.is_dir()]
    assert len(trial_dirs) == 4 and all(list(d.glob("events.out.tfevents.*")) for d in trial_dirs)


def test_export_is_idempotent_with_metric_histories(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = REPO / "docs" / "results" / "h200" / "results.parquet"
    argv = ["export", str(study), "--mlflow", uri, "--experiment", "h200"]
    out = juicytalk(*argv)  # the command a user runs
    assert out.returncode == 0 and "20 MLflow runs created, 0 already there" in out.stdout, out.stdout + out.stderr[-2000:]
    # run again, the same command in this process (which reads MLflow below anyway): a second subprocess
    # importing MLflow cost ~4.5 CPU-s
    assert cli.main(argv) == 0
    again = capsys.readouterr()
    assert "0 MLflow runs created, 20 already there" in again.out, again.out + again.err[-2000:]
    from mlflow.tracking import MlflowClient

    runs = _mlflow_runs(uri, "h200")
    assert len(runs) == 20 and len({r.data.tags["juicytalk.record"] for r in runs}) == 20
    run = next(r for r in runs if r.info.run_name == "d4096-L4-te-fp8-delayed-s0")
    assert run.data.params["recipe"] == "delayed" and run.data.tags["gpu_name"] == "NVIDIA H200"
    assert run.data.metrics["step_ms_p50"] == pytest.approx(47.529, abs=1e-3)
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(20))  # the sweep's train_steps


@pytest.mark.parametrize("entry,message", [
    ("- comet: {}", "unknown tracker 'comet'"),
    ("- mlflow: {experiment: x}", "needs tracking_uri"),
    ("- wandb: {project: p, mode: sometimes}", "must be offline or online"),
    ("- mlflow: {tracking_uri: 'ftp://host/mlruns'}", "trackers.0.mlflow.tracking_uri: scheme 'ftp'"),
])
def test_bad_tracker_entries_exit_2_with_one_line(tmp_path, entry, message):
    path = write_sweep(tmp_path, "bad", f"""
        grid: {{d_model: [32]}}
        trackers:
          {entry}
    """)
    out = juicytalk("sweep", str(path), "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "line 5" in out.stderr and not (tmp_path / "bad" / "trials").exists()


def test_a_tracker_whose_package_is_missing_is_refused_before_any_trial(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TRACKERS, "wandb", replace(TRACKERS["wandb"], package="wandb_is_not_installed_here"))
    path = write_sweep(tmp_path, "nopkg", """
        grid: {d_model: [32]}
        trackers: [{wandb: {project: p}}]
    """)
    assert cli.main(["sweep", str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'juicytalk[wandb]'" in err and "trackers.0.wandb" in err
    assert not Path(tmp_path, "nopkg").exists()


def test_a_tracker_listed_twice_is_refused_before_any_trial(tmp_path, capsys):
    """Two identical mlflow entries logged two MLflow runs per trial."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    path = write_sweep(tmp_path, "twice", f"""
        grid: {{d_model: [32]}}
        trackers:
          - mlflow: {{tracking_uri: '{uri}'}}
          - mlflow: {{tracking_uri: '{uri}'}}
    """)
    assert cli.main(["sweep", str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 6: trackers.1.mlflow: mlflow is listed already (trackers.0)" in err, err
    assert not Path(tmp_path, "twice").exists()


def test_export_to_an_unsupported_tracking_uri_is_one_line(tmp_path):
    study = REPO / "docs" / "results" / "h200" / "results.parquet"
    out = juicytalk("export", str(study), "--mlflow", "postgresql://db/mlflow")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--mlflow: scheme 'postgresql'" in out.stderr and "sqlite:///" in out.stderr
