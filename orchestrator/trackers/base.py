"""The tracker seam: a name in the sweep file -> a package check at validation -> a Tune callback."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from . import mlflow_uri

# Result fields that are strings but belong on every tracker's run (numbers are reported anyway).
RESULT_TAGS = ("status", "git_sha", "gpu_name", "cell_label", "launcher")


class TrackerError(ValueError):
    """A ``trackers`` entry cannot be used here; ``key`` names it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Tracker:
    name: str
    package: str  # importable module the tracker needs
    extra: str  # pip extra that installs it
    options: dict[str, type]  # allowed options and their types
    required: tuple[str, ...]
    module: str  # orchestrator.trackers.<module> with build(options, run_tags) -> Tune callback


TRACKERS: dict[str, Tracker] = {t.name: t for t in (
    Tracker("mlflow", "mlflow", "mlflow", {"tracking_uri": str, "experiment": str}, ("tracking_uri",),
            "mlflow_tracker"),
    Tracker("wandb", "wandb", "wandb", {"project": str, "mode": str, "entity": str, "dir": str}, ("project",),
            "wandb_tracker"),
    Tracker("tensorboard", "tensorboardX", "tune", {}, (), "tensorboard_tracker"),
)}


def check_trackers(entries: Any) -> list[tuple[str, dict[str, Any]]]:
    """Validate ``trackers`` from a sweep file: a list of one-key mappings {name: {options}}."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise TrackerError("trackers", "must be a list like [{mlflow: {tracking_uri: ...}}, {tensorboard: {}}]")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or len(entry) != 1:
            raise TrackerError(f"trackers.{i}", f"must be one mapping {{name: {{options}}}}; names: {', '.join(TRACKERS)}")
        [(name, options)] = entry.items()
        tracker = TRACKERS.get(name)
        if tracker is None:
            raise TrackerError(f"trackers.{i}", f"unknown tracker {name!r}; allowed: {', '.join(TRACKERS)}")
        if (first := next((j for j, (seen, _) in enumerate(out) if seen == name), None)) is not None:
            # each entry is a Tune callback of its own: a second would log every trial again (and MLflow's tracking
            # URI is one per process, so two mlflow entries would both log to whichever was set last)
            raise TrackerError(f"trackers.{i}.{name}", f"{name} is listed already (trackers.{first}); "
                               "each tracker at most once")
        options = {} if options is None else options  # {tensorboard: } has none; [] or 0 is no mapping of them
        if not isinstance(options, dict):
            raise TrackerError(f"trackers.{i}.{name}", f"options must be a mapping, got {options!r}")
        for key, value in options.items():
            if key not in tracker.options:
                raise TrackerError(f"trackers.{i}.{name}.{key}",
                                   f"unknown option; allowed: {', '.join(tracker.options) or 'none'}")
            if not isinstance(value, tracker.options[key]):
                raise TrackerError(f"trackers.{i}.{name}.{key}", "must be a string")
        for key in tracker.required:
            if key not in options:
                raise TrackerError(f"trackers.{i}.{name}", f"needs {key}")
        if name == "wandb" and options.get("mode", "offline") not in ("offline", "online"):
            raise TrackerError(f"trackers.{i}.{name}.mode", "must be offline or online")
        if importlib.util.find_spec(tracker.package) is None:
            raise TrackerError(f"trackers.{i}.{name}", f"needs the {tracker.package} package: "
                               f"pip install 'juicytalk[{tracker.extra}]'")
        if name == "mlflow" and (why := mlflow_uri.problem(options["tracking_uri"])):
            raise TrackerError(f"trackers.{i}.{name}.tracking_uri", why)
        out.append((name, options))
    return out


def build_callbacks(trackers: list[tuple[str, dict[str, Any]]], run_tags: dict[str, str]) -> list[Any]:
    """Tune callbacks for the validated ``trackers``; ``run_tags`` (sweep, run id) go on every run."""
    builders: list[Callable] = [importlib.import_module(f"{__package__}.{TRACKERS[name].module}").build
                                for name, _ in trackers]
    return [build(options, run_tags) for build, (_, options) in zip(builders, trackers)]


def trial_tags(trial: Any, result: dict[str, Any] | None = None) -> dict[str, str]:
    """Per-trial tags: the cell and sample from the config, the rest from the trial's result."""
    tags = {"cell_id": str(trial.config.get("cell_id")), "sample": str(trial.config.get("sample"))}
    for key in RESULT_TAGS:
        if result and result.get(key) is not None:
            tags[key] = str(result[key])
    return tags
