"""The one type check for declared values: spec fields (from YAML and flags) and record fields.

Types are named as the declarations name them: ``int``, ``float``, ``str``, ``bool``,
``list[float]``, ``list[int]``. A bool is never an int here, and an int is a valid float.
"""

from __future__ import annotations

import numbers
from typing import Any

WANTED = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
          "list[float]": "a list of numbers", "list[int]": "a list of integers"}


def matches(value: Any, type_name: str) -> bool:
    """Whether ``value`` (not None) is of the declared type; an unknown type name matches anything."""
    if type_name == "bool":
        return isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if type_name == "str":
        return isinstance(value, str)
    if type_name.startswith("list[") and type_name.endswith("]"):
        inner = type_name[len("list["):-1]
        return isinstance(value, (list, tuple)) and all(v is None or matches(v, inner) for v in value)
    return True
