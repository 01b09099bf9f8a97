"""Third-party output that is not the user's business, kept for ``-v``.

torchao logs a warning for each optional compiled extension it cannot load (``Failed to load
..._C_mxfp8...so``: kernels for GPUs this machine does not have) and for a missing Triton; torch's
``_pytree`` warns that torchao registers an Enum the old way; Kineto, torch's profiler library, prints
``USDT: ... profiler_start`` and ``profiler_stop`` around every profiled window. None of it changes a
result. Unless verbose, these loggers pass only errors and Kineto logs nothing below its top level.
Call before torch's profiler or torchao are first used (it is safe to call more than once).
"""

from __future__ import annotations

import logging
import os

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")  # and their children
KINETO_QUIET = "6"  # Kineto's levels: 0 verbose .. 4 error, 5 USDT (profiler_start/stop); 6 shows none of them


def quiet_third_party(verbose: bool = False) -> None:
    """Hide the output above unless ``verbose`` (then it shows at the loggers' own levels)."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    if not verbose:
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
