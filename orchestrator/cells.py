"""What a cell runs, from the values a sweep file wrote for it: one rule for every way a sweep makes cells.

The grid (orchestrator/sweep.py) and a crossover search (orchestrator/crossover.py) both build cells from
written values; both go through :func:`cell_values`, so a search's probe is the very cell (and cell id) a grid
would have made, and its records serve both.
"""

from __future__ import annotations

import re
from typing import Any

from trials.spec import SCOPES, SpecError, TrialSpec, applies, check_model, defaults_for, field_default, only_fields

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


def blame(exc: SpecError, written: list[tuple[tuple, dict[str, Any]]], values: dict[str, Any]) -> tuple | None:
    """The key path the file wrote that a cell's error comes from. ``written``: where the file gives the cell's
    values, each (key path, values), the place that wins a field first; ``values``: what the cell runs
    (:func:`cell_values`). The refused field where it is written, else a written field the cell keeps without
    which the error goes (prompt_len, never written, is refused for seq_len 4: seq_len is to blame), those the
    error names first. None where no one field is to blame."""
    for place, given in written:
        if exc.field in given:
            return place + (exc.field,)
    keys = [(place, key) for place, given in written for key in given if key in values]
    named = [w for w in keys if re.search(rf"\b{w[1]}\b", str(exc))]
    for place, key in named + [w for w in keys if w not in named]:
        try:
            check_model(TrialSpec.from_dict({k: v for k, v in values.items() if k != key}))
        except SpecError as again:
            if again.field == exc.field:
                continue
        return place + (key,)
    return None
