"""A CUDA graph capture that raises leaves the process as it found it, so the next trial in it runs.

torch begins a capture by marking the CUDA generators it registers (the device's default one, and any a caller
registers, such as TE's RNG trackers') as capturing, and unmarks them in ``CUDAGraph.capture_end`` only after
``cudaStreamEndCapture`` succeeds. A capture invalidated inside (a host sync, ``.item()``, data-dependent control
flow) raises there first: the generators stay marked, so every later random draw in the process raises
"Offset increment outside graph capture encountered unexpectedly" (a model's weight init included), and
``torch.cuda.graph`` never leaves its side stream, which stays the current one. :func:`sound_after_failure` puts
the stream back and runs one small capture over the same generators, whose own end unmarks them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

import torch

log = logging.getLogger(__name__)


def _registered_generators() -> list[torch.Generator]:
    """Generators a capture registers besides the default one: TE's RNG trackers' (where TE is imported)."""
    distributed = sys.modules.get("transformer_engine.pytorch.distributed")
    states = getattr(distributed, "get_all_rng_states", None)
    return list(states().values()) if states is not None else []


def end_generator_capture() -> None:
    """One capture of one kernel over the default CUDA generator and TE's: its end unmarks them (module docstring)."""
    graph = torch.cuda.CUDAGraph()
    if hasattr(graph, "register_generator_state"):
        for generator in _registered_generators():
            graph.register_generator_state(generator)
    flag = torch.zeros(1, device="cuda")  # allocated before the capture: the capture allocates nothing
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):  # not the failed capture's stream
        flag.add_(1)
    torch.cuda.synchronize()


@contextlib.contextmanager
def sound_after_failure() -> Iterator[None]:
    """Run a capture (``torch.cuda.graph`` or a ``make_graphed_callables``); where it raises, the stream current
    before it current again and the generators unmarked, then the error raised on."""
    stream = torch.cuda.current_stream()
    try:
        yield
    except BaseException:
        torch.cuda.set_stream(stream)
        try:
            end_generator_capture()
        except Exception as exc:  # noqa: BLE001 - the capture's own error is the one to raise
            log.warning("could not end the CUDA generators' capture after a failed one: %s: %s",
                        type(exc).__name__, exc)
        raise
