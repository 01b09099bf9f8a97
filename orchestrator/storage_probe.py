"""What a Ray worker on each node runs to say whether it sees the sweep's storage
(``runner.check_shared_storage``). A module of its own, importing nothing of JuicyTalk's: the worker
imports the module a remote function lives in, and the driver's modules pull in Ray Tune (1.5-2 s per node
at every sweep's start)."""

from __future__ import annotations

import os


def sees(path: str, marker: str) -> tuple[str, bool]:
    """(this node's IP, whether ``path``/``marker`` exists here)."""
    import ray

    return ray.util.get_node_ip_address(), os.path.exists(os.path.join(path, marker))
