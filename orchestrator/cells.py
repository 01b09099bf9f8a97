"""What a cell runs, from the values a sweep file wrote for it, and its id: one rule for every way a sweep makes cells.

The grid (orchestrator/sweep.py) and the searches (orchestrator/crossover.py, orchestrator/best.py) all build
cells from written values; all go through :func:`cell_values` and :func:`cell_id`, so a search's probe is the very
cell (and cell id) a grid would have made, and its records serve both.
"""

from __future__ import annotations

import hashlib
import json
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


# The spec fields of the first record layout: always hashed, so every id made since stays valid.
# A field added later enters the hash only where it differs from its default.
ID_FIELDS_V1 = ("vocab", "d_model", "n_layers", "n_heads", "ffn", "seq_len", "batch_size", "backend", "precision",
                "recipe", "fp8_format", "amax_history_len", "amax_compute_algo", "cuda_graphs", "train_steps", "lr",
                "warmup_steps", "bench_steps", "repeats", "gen_len", "prompt_len", "seed", "device")


def spec_id(values: dict[str, Any], defaults: dict[str, Any]) -> str:
    canonical = {k: v for k, v in values.items() if k in ID_FIELDS_V1 or v != defaults.get(k)}
    return hashlib.sha1(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def _id_values(spec: TrialSpec) -> dict[str, Any]:
    """The spec's values as its id hashes them: the spec holds numbers as their field's type (``lr: 1`` is 1.0), and
    MiniGPT's n_kv_heads equal to n_heads is its default (null), so either way of writing it is one id (the null
    one, which every cell without GQA always had)."""
    values = spec.to_dict()
    if spec.source.own and values["n_kv_heads"] is not None and values["n_kv_heads"] == values["n_heads"]:
        values["n_kv_heads"] = None
    return values


def cell_id(spec: TrialSpec) -> str:
    """Stable id of a spec: the same cell gets the same id in every run, on every machine, and after
    new spec fields arrive with defaults (resume and --compare keep working on older results)."""
    values = _id_values(spec)
    return spec_id(values, defaults_for(values))


def same_trial(spec: TrialSpec, ignoring: tuple[str, ...] = ()) -> str:
    """What makes two cells one trial (those ``ignoring`` fields aside): their ids, but with tokens_per_step resolved
    into the batch_size it sizes (batch_size 4 and tokens_per_step 1024 at seq_len 256 run the same). Not the cell
    id itself: a cell given by tokens_per_step keeps the id its results were stored under."""
    values = {**_id_values(spec), "tokens_per_step": None, **dict.fromkeys(ignoring)}
    return spec_id(values, defaults_for(values))


def shown(values: dict[str, Any]) -> str:
    """``backend=te precision=fp8``: a grid combination as a user reads it (never a dict's repr), in YAML's words
    (true, null)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else 'null' if v is None else v}"
                    for k, v in values.items())
