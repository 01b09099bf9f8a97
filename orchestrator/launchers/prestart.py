"""Trial servers a sweep's driver starts before its local Ray, for the launchers to adopt.

A launcher's first trial process imports torch and Transformer Engine (~7 s of TE on the H200) when the
sweep's first trial reaches its Ray worker: after Ray's start, Tune's set-up and the worker's own. On a
local (embedded) cluster the driver knows, before ``ray.init``, which GPUs the trials will be given, so it
starts the trial servers itself right away - one per GPU a trial can run on, one for CPU trials -
each listening on a Unix socket (``python -m trials.server --listen``), and their imports overlap Ray's
start. The first launcher on that GPU adopts its server instead of spawning one; later ones (after a
retirement, an OOM, a death) spawn as before. A cluster joined with ``--address`` gets none.

A launcher adopts a server only if it is the process it would have spawned itself: the same command
(launcher kind, ``warm_max_trials``, TE preload), the same environment but for what Ray adds to its
workers' (:data:`RAY_BOOKKEEPING`), and the same niceness (Ray runs its workers at niceness 15, which
their children inherit; the driver starts the servers so). The driver predicts the two things Ray gives
a worker: ``CUDA_VISIBLE_DEVICES`` (its GPU) and ``OMP_NUM_THREADS`` (its CPUs, when the user set none).
Where the prediction is wrong, the server is dead, or another launcher claimed it, the launcher spawns
its own: adoption is a saving, never a different trial process. The driver ends every server it
started when the sweep ends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trials.server import alive

from .base import Adopted, LaunchSettings, TrialProcess, server_command, trial_env

log = logging.getLogger(__name__)

# What a Tune worker's environment has that its driver's has not, but for its GPU and OMP_NUM_THREADS (Ray
# 2.60, checked by diffing the two): Ray's and Tune's bookkeeping, Ray's debugger hook, Lightning's fork
# switch; and the shell's PWD/OLDPWD, which Ray's workers get as the driver's real working directory while a
# driver started with another cwd than its parent shell's still carries the shell's; nothing a trial reads.
RAY_BOOKKEEPING = ("PYTHONBREAKPOINT", "SPT_NOENV", "PL_DISABLE_FORK", "PWD", "OLDPWD")
RAY_PREFIXES = ("RAY_", "TUNE_")
BIND_WAIT_S = 60.0  # a live server not yet listening is still sooner ready than a new one
RAY_WORKER_NICENESS = 15  # Ray's default niceness for its workers (its RAY_worker_niceness overrides it)


@dataclass(frozen=True)
class Offer:
    """One prestarted server, as the driver describes it (``<name>.json`` beside its socket)."""

    pid: int
    socket: str
    log: str
    command: list[str]
    env: dict[str, str]
    nice: int


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(RAY_PREFIXES) and k not in RAY_BOOKKEEPING}


def mismatch(offer: Offer, command: list[str], env: dict[str, str], nice: int) -> list[str]:
    """What makes ``offer`` another process than the one a launcher would spawn (names, never values)."""
    why = [] if offer.command == command else [f"its command: {' '.join(offer.command[1:])}"]
    theirs, ours = _comparable(offer.env), _comparable(env)
    why += [f"${k}" for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    return why + ([] if offer.nice == nice else [f"niceness {offer.nice}, not {nice}"])


def worker_niceness() -> int:
    value = os.environ.get("RAY_worker_niceness", "")
    return int(value) if value.strip().lstrip("-").isdigit() else RAY_WORKER_NICENESS


class Servers:
    """The trial servers one driver started (a context manager: ended and removed on exit)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="jt-srv-")  # short: a socket path has ~100 characters
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str], env: dict[str, str], nice: int) -> None:
        sock, log_path = os.path.join(self.directory, f"{name}.sock"), os.path.join(self.directory, f"{name}.log")
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(command + ["--listen", sock], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=self.directory,
                                    start_new_session=True)
        self.procs.append(proc)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)  # as Ray's workers, whose children the servers replace
        except OSError:  # below this driver's own niceness: not ours to give; no launcher adopts it then
            pass
        nice = os.getpriority(os.PRIO_PROCESS, proc.pid)
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()  # no zombies left
        offer = Offer(proc.pid, sock, log_path, command, env, nice)
        path = Path(self.directory, f"{name}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(offer)))
        os.replace(tmp, path)  # whole or not at all

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # a server and the trial it may have forked
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs:
            proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def plan(settings: LaunchSettings, fork: bool, max_trials: int, resources: dict[str, float], gpu_ids: list[str],
         node_cpus: float, trials: int) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of each server to start for ``trials`` single-rank trials that ask ``resources``
    each, on a local node with ``gpu_ids`` and ``node_cpus``: one per GPU a trial gets (a trial asking one
    GPU), one for CPU trials (which take the whole node, one at a time); none where that cannot be told."""
    gpu = resources.get("gpu", 0)
    if trials < 1 or (gpu and gpu != 1) or (not gpu and gpu_ids):
        return []  # fractional or several GPUs per trial, CPU trials on a GPU node: no guess is made
    base = trial_env(settings)
    if gpu_ids:
        cpus, slots = resources.get("cpu", 1), [(f"gpu{i}", {"CUDA_VISIBLE_DEVICES": i}) for i in gpu_ids[:trials]]
    else:
        cpus, slots = node_cpus, [("cpu", {})]  # runner.check_resources: a CPU trial takes the whole node
    if "OMP_NUM_THREADS" not in os.environ:  # Ray gives its workers the floor of their CPUs
        base["OMP_NUM_THREADS"] = str(max(1, math.floor(cpus)))
    return [(name, {**base, **extra}) for name, extra in slots]


def start(settings: LaunchSettings, fork: bool, max_trials: int, resources: dict[str, float],
          gpu_ids: list[str], node_cpus: float, trials: int) -> Servers | None:
    """Start the servers of :func:`plan`; None when it plans none."""
    planned = plan(settings, fork, max_trials, resources, gpu_ids, node_cpus, trials)
    if not planned:
        return None
    servers, nice = Servers(), worker_niceness()
    try:
        for name, env in planned:
            servers.start(name, server_command(max_trials, env, fork), env, nice)
    except BaseException:
        servers.close()
        raise
    log.info("%d trial server(s) started before Ray in %s", len(planned), servers.directory)
    return servers


def claim(directory: str, command: list[str], env: dict[str, str]) -> TrialProcess | None:
    """A prestarted server in ``directory`` that is the process a launcher would spawn with ``command``
    and ``env`` (at this process's niceness), connected and claimed for this launcher alone; None if none is."""
    nice = os.nice(0)
    for path in sorted(Path(directory).glob("*.json")):
        try:
            offer = Offer(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        differs = mismatch(offer, command, env, nice)
        if differs:
            # a wrong guess of the driver's (prestart.plan) costs only the saving; said where Ray keeps worker logs
            log.warning("prestarted trial server %d is not the one this launcher would start (%s): not adopted",
                        offer.pid, ", ".join(differs))
            continue
        taken = path.with_suffix(".taken")
        try:
            os.rename(path, taken)  # atomic: one launcher per server
        except OSError:
            continue  # another launcher claimed it first
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect(conn, offer)
        except OSError as exc:
            conn.close()
            log.info("prestarted trial server %d cannot be adopted (%s): a new one is spawned", offer.pid, exc)
            continue
        log.info("adopted prestarted trial server %d", offer.pid)
        return TrialProcess(Adopted(offer.pid), conn.makefile("w", encoding="utf-8"),
                            _Replies(conn), Path(offer.log))
    return None


def _connect(conn: socket.socket, offer: Offer) -> None:
    """Connect to a server that may not have bound its socket yet (it binds as its Python starts)."""
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        if not alive(offer.pid):
            raise ConnectionRefusedError(f"pid {offer.pid} has exited")
        try:
            conn.connect(offer.socket)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class _Replies:
    """The reply side of an adopted server's socket, read unbuffered (a line read must never take the next
    one with it, or ``select`` would wait for what is already read), closing the socket with it."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._reader = conn.makefile("rb", buffering=0)

    def fileno(self) -> int:
        return self._conn.fileno()

    def readline(self) -> bytes:
        return self._reader.readline()

    def close(self) -> None:
        self._reader.close()
        self._conn.close()
