"""What a cell runs, from the values a sweep file wrote for it: one rule for every way a sweep makes cells.

The grid (orchestrator/sweep.py) and a crossover search (orchestrator/crossover.py) both build cells from
written values; both go through :func:`cell_values`, so a search's probe is the very cell (and cell id) a grid
would have made, and its records serve both.
"""

from __future__ import annotations

from typing import Any

from trials.spec import SCOPES, applies, defaults_for, field_default, only_fields

# fields that mean something only in a scope (trials/spec.py's ``only``): a cell outside it drops them
SCOPED_FIELDS = only_fields(*SCOPES)


def cell_values(written: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The values a cell runs, from those written for it (fixed and grid), and the fields it drops as meaning
    nothing for it. torchao without FP8 is the torch twin (torchao converts Linears to FP8); a field that means
    something only in a scope (trials/spec.py's ``only``: fp8 cells, te cells, compiling stacks...) is dropped
    outside it, so the cell runs its default and is never run twice under two names. Every way a sweep makes a
    cell (its grid, a crossover search) applies this one rule."""
    values = dict(written)
    if values.get("backend") == "torchao" and values.get("precision", field_default("precision")) != "fp8":
        values["backend"] = "torch"  # torchao converts Linears to FP8; without FP8 it is the twin
    cell = {**defaults_for(values), **values}
    dropped = {name: values.pop(name) for name in SCOPED_FIELDS if name in values and not applies(name, cell)}
    return values, dropped
