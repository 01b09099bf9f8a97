"""How one trial's model is spread and recomputed: the ranks it spans and the units it checkpoints.

    ranks          one trial in N processes (torchrun or Ray Train): process group, DDP or FSDP2 over the
                   model source's units then the root, slowest-rank timing, one record
    checkpointing  activation checkpointing per unit (none, full, selective every ac_every-th), and the
                   saved-for-backward byte counter that the trial and the memory plan share

Both work on the units a model source names (``trials.models``: ``units(model)``), never on model names.
May import: torch, ``trials.spec``. Never ``trials.workloads``, ``trials.measure``, Ray or ``orchestrator``.
"""
