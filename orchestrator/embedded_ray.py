"""The local Ray a sweep starts when it is given no cluster: how it is configured, and what a user is told
when it does not come up.

Ray reads its authentication mode (``RAY_AUTH_MODE``) once, when ``ray`` is first imported, while the GCS
and raylet it starts read it from the environment they inherit. Setting the variable after the import
splits the two: the driver skips making a token, the GCS looks for one, finds none and dies, and
``ray.init`` times out 30 s later. So the mode is decided here, before the import, and never after it:
no module of ``orchestrator`` imports Ray at import time (tests/test_clean_start.py fails when one does),
and :func:`configure` leaves the environment alone once Ray is in the process, which keeps the driver and
its GCS agreeing (``ray.init`` then sets up the token itself).

Token authentication is Ray's default for a new local cluster; the mode is only made explicit (unless the
user set one) so that Ray does not warn about it at every start. A token file left in ``~/.ray`` by an
earlier Ray is fine: the new cluster and the driver both use it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

AUTH_MODE = "token"  # Ray's own default for new local clusters, said explicitly
# How long ``ray.init`` waits for the local GCS to write its port file before it gives up (Ray's own knob,
# RAY_gcs_server_port_wait_time_s; Ray's default is 30 s). A GCS that has not written it in this time has died
# (its reason is in gcs_server.err, which the one line quotes): on the 2-core machine it wrote it 0.10-0.22 s
# after its start, idle and beside 8 busy processes (benchmarks/ray_start.py). A user's own value wins.
GCS_PORT_WAIT_S = 10
LOGS = ("gcs_server.err", "raylet.err", "gcs_server.out", "raylet.out")  # where a process that died says why
FATAL = re.compile(r"^\[[^\]]* [CEF] \d+ \d+\]\s*(?:\([^)]*\)\s*)?(.*)$")  # a glog line of severity C, E or F


class RayStartError(RuntimeError):
    """The local Ray did not come up; the message is one line: what failed, Ray's own first error line,
    and the log it came from."""


def configure(local: bool) -> None:
    """Set, before ``import ray``, what this driver and the Ray it starts (``local``) must agree on, and how
    long that start waits for its GCS (:data:`GCS_PORT_WAIT_S`). Joining a cluster, the cluster's mode is the
    user's to give (RAY_AUTH_MODE, RAY_AUTH_TOKEN)."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", AUTH_MODE)
    if local:  # read by ray.init when it starts the GCS, so this may come after the import
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_PORT_WAIT_S))
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's classic progress output, read when Tune is imported


def local_node() -> tuple[list[str], float] | None:
    """What the local Ray :func:`start` makes will have, asked of Ray's own detection before it starts: the GPU
    ids its workers will see (one each as CUDA_VISIBLE_DEVICES) and its CPU count. None where Ray's private
    helpers moved (the caller then plans nothing on them). Imports Ray: :func:`configure` first."""
    configure(local=True)
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource
        from ray._private.utils import get_num_cpus

        gpus = get_accelerator_manager_for_resource("GPU")
        count = gpus.get_current_node_num_accelerators()
        visible = gpus.get_current_process_visible_accelerator_ids()
        ids = [str(i) for i in range(count)] if visible is None else list(visible)[:count]
        return ids, float(get_num_cpus())
    except Exception:  # noqa: BLE001 - an optimisation's guess, never a failure
        return None


def start(ray, package_root: str, **kwargs) -> None:
    """``ray.init`` of a new local instance whose workers import JuicyTalk from ``package_root``, or
    :class:`RayStartError` in one line when it fails.

    The path goes to the workers through the environment Ray's processes inherit, not a job
    ``runtime_env``: a runtime environment makes Ray start workers of its own for it instead of taking
    the ones it prestarts with the cluster (measured: the first actor ready 0.8-1.3 s after ray.init
    instead of 2.0-2.4 s; every trial's worker is such an actor).

    A GCS that dies at start is reported after :data:`GCS_PORT_WAIT_S`, not Ray's 30 s: Ray's wait for its port
    file holds the GIL in native code, so nothing in this process can notice the death sooner. A raylet that
    dies is still reported after Ray's own fixed 30 s wait for it to register.

    A Ctrl-C during ``ray.init`` is held until it returns and raised once Ray, started whole, is shut down whole:
    raised inside it, the driver knew none of the processes started so far, and the agents its raylet had started
    outlived the driver by 15-20 s. Ray's own processes block SIGINT, so the start goes on to its end."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    since = time.time()
    with sigint_held() as held:
        try:
            # address="local": always a new embedded instance, never some cluster started earlier on this host
            ray.init(address="local", **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever Ray raised, the user gets one line
            if not held.seen:
                raise RayStartError(start_failure(exc, since)) from None
    if held.seen:
        ray.shutdown()
        raise KeyboardInterrupt


@dataclass
class Held:
    seen: bool = False  # a SIGINT came while held


@contextmanager
def sigint_held() -> Iterator[Held]:
    """SIGINT noted instead of raised inside the block (Python delivers signals to the main thread only: elsewhere
    nothing is held); a second one raises KeyboardInterrupt at once, as a user who presses Ctrl-C again means."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def on_int(signum: int, frame: object) -> None:
        if held.seen:
            raise KeyboardInterrupt
        held.seen = True

    before = signal.signal(signal.SIGINT, on_int)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, before)


def start_failure(exc: BaseException, since: float) -> str:
    """One line for a failed local start: the exception's first line, and the first fatal line of the
    session's logs with the log's path."""
    what = (str(exc).strip().splitlines() or [""])[0]
    line = f"Ray could not start here ({type(exc).__name__}: {_clip(what)})"
    session = _session_dir(str(exc), since)
    found = _first_fatal(session) if session else None
    if found:
        log, text = found
        line += f"; {log.name}: {_clip(text)} (log: {log})"
    elif session:
        line += f" (logs: {session / 'logs'})"
    return line


def _session_dir(message: str, since: float) -> Path | None:
    """The session directory of the failed start: named in Ray's message, else the newest one begun since."""
    named = re.search(r"(/\S*/session_[^/\s]+)", message)
    if named and Path(named.group(1)).is_dir():
        return Path(named.group(1))
    root = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray"
    fresh = [p for p in root.glob("session_2*") if p.is_dir() and p.stat().st_mtime >= since - 1]
    return max(fresh, key=lambda p: p.stat().st_mtime) if fresh else None


def _first_fatal(session: Path) -> tuple[Path, str] | None:
    for name in LOGS:
        log = session / "logs" / name
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for text in lines:
            m = FATAL.match(text)
            if m:
                body = m.group(1)
                # Ray prefixes a failed check with a paragraph about reporting bugs; what failed follows it
                return log, body[body.index("Check failed"):] if "Check failed" in body else body
    return None


def _clip(text: str, width: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
