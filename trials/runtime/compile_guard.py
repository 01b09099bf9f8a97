"""TorchDynamo's recompile limit, for processes that run many trials.

Transformer Engine wraps its element-wise fusers in ``torch.compile``. Dynamo recompiles a function
for every new shape or dtype it meets and, past ``recompile_limit`` (8) versions of one function,
silently runs it uncompiled from then on. In a process that runs trial after trial that would time
later cells with TE's fusers off: slower BF16 backward, inflated FP8 speedups. A long-lived trial
process therefore raises the limit and watches Dynamo's warning; a hit is recorded, and the process
is replaced after that trial.
"""

from __future__ import annotations

import logging

LIMIT_MESSAGE = "hit config."  # "torch._dynamo hit config.recompile_limit (8)" (and older cache_size_limit)
DYNAMO_LOGGER = "torch._dynamo.convert_frame"


class RecompileWatch(logging.Handler):
    """Counts Dynamo's 'hit config.<limit>' warnings; attach once per process."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if LIMIT_MESSAGE in message and "limit" in message:
            self.hits.append(message.splitlines()[0] + " " + " ".join(message.splitlines()[1:2]).strip())

    def take(self) -> list[str]:
        """The hits since the last call."""
        hits, self.hits = self.hits, []
        return hits


def raise_recompile_limit(limit: int) -> None:
    """Allow ``limit`` compiled versions of each function (the name differs across torch versions)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(limit, getattr(config, name)))
    acc = "accumulated_recompile_limit" if hasattr(config, "accumulated_recompile_limit") else "accumulated_cache_size_limit"
    if hasattr(config, acc):
        setattr(config, acc, max(limit * 8, getattr(config, acc)))


def watch() -> RecompileWatch:
    handler = RecompileWatch()
    logging.getLogger(DYNAMO_LOGGER).addHandler(handler)
    return handler
