"""Work items: one (cell, sample) to run, made on the worker from the Tune config it was handed.

A trial's config is the flattened spec (its seed already offset by the sample) and ``sample``;
everything else a worker needs is the run's :class:`Context`, shared by every trial of one
``juicytalk sweep`` run. So a cell can come from the sweep's grid (:func:`grid_items`) or from a Tune
searcher (``orchestrator/search.py``): either way the worker rebuilds the same cell id, label and
store key from the config, and the record is the one a grid cell would have written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trials.spec import TrialSpec

from .store import trial_key
from .sweep import Cell, cell_id, cell_label

SPEC_FIELDS = TrialSpec.field_names()


@dataclass(frozen=True)
class Context:
    """What every trial of one run shares: where records go, how trials are launched and limited."""

    storage: str
    sweep_name: str
    timeout_s: float | None
    launch: dict[str, Any]  # LaunchSettings fields
    run: dict[str, Any] = field(default_factory=dict)  # run_id, run_started_at, run_gpus (record fields)
    resources: dict[str, float] = field(default_factory=dict)  # per trial; rank_cpu: per rank of a multi-rank trial

    def with_run(self, run: dict[str, Any], resources: dict[str, float]) -> "Context":
        return Context(**{**asdict(self), "run": dict(run), "resources": dict(resources)})


@dataclass(frozen=True)
class WorkItem:
    cell_id: str
    sample: int
    label: str
    spec: dict[str, Any]  # what the trial runs: the cell's spec with seed = cell seed + sample

    @property
    def key(self) -> str:
        return trial_key(self.cell_id, self.sample)

    @classmethod
    def of(cls, cell_spec: TrialSpec, sample: int, label: str | None = None) -> "WorkItem":
        """Sample ``sample`` of a cell: independent seeds, the same across the cells they pair with. ``label``:
        the sweep's (which tells its cells apart), else :func:`~orchestrator.sweep.cell_label`."""
        spec = cell_spec.to_dict()
        spec["seed"] = cell_spec.seed + sample
        return cls(cell_id(cell_spec), sample, label or cell_label(cell_spec), spec)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "WorkItem":
        """The item a Tune config describes (grid or searcher): the cell is the spec with its seed un-offset."""
        sample = int(config["sample"])
        spec = {k: config[k] for k in SPEC_FIELDS if k in config}
        return cls.of(TrialSpec.from_dict({**spec, "seed": spec["seed"] - sample}), sample, config.get("cell_label"))

    def config(self) -> dict[str, Any]:
        """What Tune (and its callbacks and trackers) sees: the flattened spec, sample, cell id and label, store
        key."""
        return {**self.spec, "sample": self.sample, "cell_id": self.cell_id, "cell_label": self.label,
                "trial": self.key}


def grid_items(cells: list[Cell], samples: int) -> list[WorkItem]:
    return [WorkItem.of(cell.spec, sample, cell.label) for cell in cells for sample in range(samples)]
