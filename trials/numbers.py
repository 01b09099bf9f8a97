"""Numbers as people read them: significant figures, not a fixed number of decimals.

Fixed decimals hide the differences that matter on small values (0.054 and 0.130 TFLOP/s both read 0.1;
a CPU trial's 0.04 TFLOP/s reads 0.0) and print noise on large ones. Every table, sentence and summary line
that rounds a measured number rounds it here.

    fmt_sig(0.0541, unit=" TFLOP/s")  # '0.0541 TFLOP/s'
    fmt_sig(12.79)                    # '12.8'
    round_sig(0.12987)                # 0.13
"""

from __future__ import annotations

import math
from typing import Any

DIGITS = 3  # enough to tell 1.03x from 1.05x and 0.054 from 0.130


def _decimals(value: float, digits: int) -> int:
    return digits - 1 - math.floor(math.log10(abs(value)))


def round_sig(value: Any, digits: int = DIGITS) -> Any:
    """``value`` rounded to ``digits`` significant figures; None, NaN, inf, 0 and non-numbers as they are."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        return value
    return round(float(value), _decimals(value, digits))


def fmt_sig(value: Any, digits: int = DIGITS, unit: str = "") -> str:
    """``value`` with ``digits`` significant figures (trailing zeros kept: '1.50'), '-' for a missing one."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value}{unit}"
    if not math.isfinite(value) or value == 0:
        return f"{value:g}{unit}"
    rounded = round(float(value), _decimals(value, digits))
    return f"{rounded:.{max(0, _decimals(rounded, digits))}f}{unit}"
