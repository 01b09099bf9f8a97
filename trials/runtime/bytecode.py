"""Whether the libraries a trial imports run from bytecode here, or are compiled from source by every process.

``pip install`` leaves ``.pyc`` files beside a package's sources; an environment built without them (``uv``'s
default, a copied site folder) normally gets them at the first import, which writes them. Where nothing may
write them (``PYTHONDONTWRITEBYTECODE`` set, or a read-only install), every process that imports torch
compiles its sources again: on the lent H200 host (no bytecode, the variable set) importing torch, Dynamo
and Inductor took 11.0-11.5 s and Transformer Engine 15.6 s, against 2.9-3.3 s and 5.9 s once
``python -m compileall`` had run (11 s, once). A sweep pays it in its driver's Ray, in every trial process and
inside the first training step, where TE's fusers import the compiler. Found, not fixed: writing bytecode
into someone's environment is theirs to decide, so ``juicytalk doctor`` and the sweep say it and how.
"""

from __future__ import annotations

import importlib.util
import os
import sys

CHECKED = ("torch", "transformer_engine")  # the imports that dominate a trial process's start


def compiled_from_source(package: str) -> str | None:
    """Why each process compiles ``package`` from source, or None (it has bytecode, the first import writes it,
    or it is not installed). Looks at the package's ``__init__``; imports nothing."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    cached = importlib.util.cache_from_source(spec.origin)  # honours PYTHONPYCACHEPREFIX
    if os.path.exists(cached):
        return None
    if sys.dont_write_bytecode:
        return "PYTHONDONTWRITEBYTECODE is set"
    folder = os.path.dirname(cached)
    while folder and not os.path.isdir(folder):  # __pycache__ itself may not exist yet
        folder = os.path.dirname(folder)
    return None if os.access(folder, os.W_OK) else f"{folder} is read-only"


def advice() -> str | None:
    """One line for a user whose processes compile torch (or TE) from source, with the fix; None where none do."""
    found = {name: why for name in CHECKED if (why := compiled_from_source(name))}
    if not found:
        return None
    names = " and ".join(found)
    roots = sorted({os.path.dirname(os.path.dirname(importlib.util.find_spec(n).origin)) for n in found})
    why = "; ".join(dict.fromkeys(found.values()))
    return (f"{names} {'have' if len(found) > 1 else 'has'} no bytecode here and none can be written ({why}): every "
            f"trial process compiles {'them' if len(found) > 1 else 'it'} from source, seconds of each start; "
            f"`python -m compileall -q -j 0 {' '.join(roots)}` once writes it")
