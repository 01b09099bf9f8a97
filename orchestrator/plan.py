"""Dry-run plan: every cell with its size, a memory estimate, and what already has a record."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from trials.backends import STACKS, recipe_owner
from trials import models
from trials.spec import TrialSpec

from .store import Store, trial_key
from .sweep import Sweep


MASTER_AND_MOMENTS_BYTES = 12  # per parameter: an fp32 master weight and Adam's two fp32 moments


def estimate_memory_bytes(spec: TrialSpec) -> int:
    """Rough device-memory need of a training step (an estimate for planning, not a promise).

    Weights, gradients and the two AdamW moments in the parameter dtype (fp32 for fp32 cells, bf16
    otherwise); activations kept for backward per token and layer: the block input, both norm outputs,
    Q/K/V, the attention output and the residual (7 * d_model + 2 * kv width), fc1's output and the
    activation's (fc1_out + ffn), in the activation dtype, about 34 * d_model bytes for the gpt block
    (Korthikanti et al.; flash attention keeps no seq x seq scores); and the logits in the activation
    dtype plus their fp32 copy and its gradient for the loss. Cells whose weights exist only in FP8
    (``fp8_all_gather`` on a stack with ``fp8_all_gather_masters``: TE) keep an fp32 master and two fp32
    moments per parameter instead. Other models (trials/models): their exact parameter count (built on the
    meta device) and the activations of a Llama-shaped block of their resolved shape; a factory's model of
    unknown shape counts its weights and optimizer state only.
    """
    facts = models.describe(spec)
    n = facts.n_params or 0
    cfg = facts.estimate
    width = 4 if spec.precision == "fp32" else 2
    tokens = spec.tokens
    activations = logits = 0
    if cfg is not None:
        per_token_layer = 7 * cfg.d_model + 2 * cfg.kv_dim + cfg.fc1_out + cfg.ffn
        activations = tokens * cfg.n_layers * per_token_layer * width
        logits = tokens * cfg.vocab * (width + 8)
    stack = STACKS.get(recipe_owner(spec.recipe) or "")
    masters = spec.fp8_all_gather and stack is not None and stack.fp8_all_gather_masters
    state = MASTER_AND_MOMENTS_BYTES if masters else 2 * width
    return n * (2 * width + state) + activations + logits


def unsupported_here(sweep: Sweep) -> dict[str, str]:
    """cell id -> why the cell would be recorded ``unsupported`` on this machine (what a trial here would
    resolve: the same probe and rules, ``trials.capability``). A cluster's GPU nodes may differ."""
    from trials.capability import probe, resolve

    want_te = any(cell.spec.backend in ("te", "auto") for cell in sweep.cells)
    want_torchao = any(cell.spec.backend == "torchao" for cell in sweep.cells)
    caps: dict[str, Any] = {}
    out = {}
    for cell in sweep.cells:
        if cell.spec.device not in caps:  # one probe per requested device
            caps[cell.spec.device] = probe(cell.spec.device, want_te, want_torchao)
        reason = resolve(cell.spec, caps[cell.spec.device]).unsupported
        if reason:
            out[cell.cell_id] = reason
    return out


def plan_rows(sweep: Sweep, store: Store, unsupported: dict[str, str] | None = None) -> list[dict[str, Any]]:
    statuses = store.statuses()
    unsupported = unsupported or {}
    rows = []
    for cell in sweep.cells:
        have = [statuses.get(trial_key(cell.cell_id, s)) for s in range(sweep.samples)]
        rows.append({
            "label": cell.label, "cell_id": cell.cell_id,
            "params": models.describe(cell.spec).n_params,
            "est_mem_bytes": estimate_memory_bytes(cell.spec),
            "records": [s for s in have if s], "samples": sweep.samples,
            "unsupported": unsupported.get(cell.cell_id),
        })
    return rows


def local_gpu_memory_bytes() -> int | None:
    """Memory of this machine's first GPU, or None without one (then the plan cannot say what fits)."""
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def plan_table(sweep: Sweep, rows: list[dict[str, Any]], gpu_memory_bytes: int | None = None) -> Table:
    """The dry-run table of ``plan_rows``; with a GPU memory size, cells whose estimate exceeds it say 'OOM?'."""
    gib = 2**30
    where = f" (GPU memory {gpu_memory_bytes / gib:.0f} GiB)" if gpu_memory_bytes else ""
    table = Table(title=f"sweep {sweep.name}: {len(sweep.cells)} cells x {sweep.samples} sample(s){where}")
    table.add_column("cell", no_wrap=True)  # labels stay whole (and greppable); the other columns wrap
    table.add_column("id", no_wrap=True)
    for col in ("params", "est. memory", "records", "here"):
        table.add_column(col)
    for row in rows:
        rec = ", ".join(row["records"]) if row["records"] else "-"
        memory = f"{row['est_mem_bytes'] / gib:.2f} GiB"
        if gpu_memory_bytes and row["est_mem_bytes"] > gpu_memory_bytes:
            memory += " OOM?"
        params = "?" if row["params"] is None else f"{row['params'] / 1e6:.1f}M"
        table.add_row(row["label"], row["cell_id"], params, memory,
                      f"{len(row['records'])}/{row['samples']} ({rec})",
                      "unsupported" if row["unsupported"] else "runs")
    return table


def expected_ooms(rows: list[dict[str, Any]], gpu_memory_bytes: int | None) -> list[str]:
    """One line per ``plan_rows`` cell whose estimate exceeds the GPU's memory (it still runs, and records
    oom if it does)."""
    if not gpu_memory_bytes:
        return []
    return [f"{row['label']}: estimated {row['est_mem_bytes'] / 2**30:.1f} GiB > "
            f"{gpu_memory_bytes / 2**30:.0f} GiB of GPU memory" for row in rows
            if row["est_mem_bytes"] > gpu_memory_bytes]
