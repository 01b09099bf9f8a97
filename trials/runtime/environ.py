"""Environment variables set for a block only: some libraries read a setting from ``os.environ`` alone (Tune's
loggers and SIGINT handler, TE's unpickling guard), and a process that runs many blocks (a sweep's driver, a
warm trial server) must leave it as it found it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def environ(**values: str) -> Iterator[None]:
    """``values`` set in ``os.environ`` for the block, then each variable as before (unset where it was unset)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
