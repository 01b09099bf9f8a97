"""Dry-run plan: every cell with its size, a memory estimate, and what already has a record."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from trials.model import ModelConfig, param_count
from trials.spec import TrialSpec

from .store import Store, trial_key
from .sweep import Sweep


def estimate_memory_bytes(spec: TrialSpec) -> int:
    """Rough device-memory need of a training step (an estimate for planning, not a promise).

    Weights, gradients and the two AdamW moments in the parameter dtype (fp32 for fp32 cells, bf16
    otherwise), activations kept for backward of about 34 * tokens * d_model bytes per layer in 16-bit
    (Korthikanti et al.; flash attention keeps no seq x seq scores), and the fp32 logits with their
    gradient.
    """
    n = param_count(ModelConfig.from_spec(spec))
    width = 4 if spec.precision == "fp32" else 2
    tokens = spec.tokens_per_step
    activations = 34 * tokens * spec.d_model * spec.n_layers * width // 2
    logits = 3 * tokens * spec.vocab * 4
    return 4 * n * width + activations + logits


def plan_rows(sweep: Sweep, store: Store) -> list[dict[str, Any]]:
    statuses = store.statuses()
    rows = []
    for cell in sweep.cells:
        have = [statuses.get(trial_key(cell.cell_id, s)) for s in range(sweep.samples)]
        rows.append({
            "label": cell.label, "cell_id": cell.cell_id,
            "params": param_count(ModelConfig.from_spec(cell.spec)),
            "est_mem_bytes": estimate_memory_bytes(cell.spec),
            "records": [s for s in have if s], "samples": sweep.samples,
        })
    return rows


def plan_table(sweep: Sweep, store: Store) -> Table:
    table = Table(title=f"sweep {sweep.name}: {len(sweep.cells)} cells x {sweep.samples} sample(s)")
    for col in ("cell", "id", "params", "est. memory", "records"):
        table.add_column(col)
    for row in plan_rows(sweep, store):
        rec = ", ".join(row["records"]) if row["records"] else "-"
        table.add_row(row["label"], row["cell_id"], f"{row['params'] / 1e6:.1f}M",
                      f"{row['est_mem_bytes'] / 2**30:.2f} GiB", f"{len(row['records'])}/{row['samples']} ({rec})")
    return table
