"""The launcher seam: how a trial's spec becomes a record on a Ray worker.

A launcher owns ``python -m trials.server`` child processes (see :mod:`trials.server`). Each child
imports torch and Transformer Engine before its first spec arrives, runs up to
:attr:`Launcher.trials_per_process` trials, and is replaced when it retires or dies. Two rules hold
for every launcher, because they are what make the numbers trustworthy:

* one trial at a time per GPU: a new child is spawned only after the previous one has exited, so two
  trial processes never hold CUDA contexts on the same device at once;
* a child that died, hung past ``trial_timeout_s`` or retired is never reused.

Implementations differ in how many trials a child serves (:mod:`.process`: one; :mod:`.warm`: many).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trials.models import CWD_ENV
from trials.server import alive

log = logging.getLogger(__name__)

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
EXIT_GRACE_S = 30.0  # a retiring child writes its reply, then exits at once (os._exit)
COMPILE_CACHE_ENV = "JUICYTALK_COMPILE_CACHE"


class TrialDied(RuntimeError):
    """The trial process ended without a record (killed, crashed): Tune retries the trial."""


@dataclass(frozen=True)
class LaunchSettings:
    """What the sweep file says about launching (keys ``launcher``, ``warm_max_trials``, ``compile_cache``)."""

    launcher: str
    warm_max_trials: int
    compile_cache: str | None = None
    servers: str | None = None  # where the driver's prestarted trial servers wait to be adopted (.prestart)
    # the driver's working directory: a relative file path in a trial's ``model`` is read from it, as the user
    # wrote it, not from the launcher's folder the trial runs in (trials.models.CWD_ENV)
    cwd: str | None = None


def compile_cache_dir(configured: str | None) -> str:
    """Per-node directory for Inductor and Triton caches: the sweep's, else $JUICYTALK_COMPILE_CACHE,
    else the user's cache directory. New processes and later sweeps reuse compiled kernels from it."""
    chosen = configured or os.environ.get(COMPILE_CACHE_ENV)
    if not chosen:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "juicytalk", "compile")
    return str(Path(chosen).expanduser().resolve())


def trial_env(settings: LaunchSettings) -> dict[str, str]:
    env = dict(os.environ)
    paths = [PACKAGE_ROOT, *(env.get("PYTHONPATH") or "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))  # each entry once, in order
    cache = compile_cache_dir(settings.compile_cache)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if settings.cwd:
        env[CWD_ENV] = settings.cwd
    return env


def _wants_te(env: dict[str, str]) -> bool:
    """Preload TE only where a trial can use it: a GPU was given to this worker and TE is installed."""
    return bool(env.get("CUDA_VISIBLE_DEVICES")) and importlib.util.find_spec("transformer_engine") is not None


def server_command(max_trials: int, env: dict[str, str], fork: bool) -> list[str]:
    """``python -m trials.server`` with the flags a launcher gives it (its channel comes after)."""
    cmd = [sys.executable, "-m", "trials.server", "--max-trials", str(max_trials)]
    if _wants_te(env):
        cmd.append("--preload-te")
    if fork:
        cmd.append("--fork")
    return cmd


class Adopted:
    """The process handle of a trial server this launcher did not start (:mod:`.prestart`): what
    :class:`subprocess.Popen` offers, for a pid that is not our child (its parent reaps it)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if alive(self.pid) else -1  # its exit status is its parent's to read

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"trials.server pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        return -1


class TrialProcess:
    """One ``python -m trials.server``: its request and reply channels, its log, how many trials it ran.

    Spawned here (:meth:`spawn`: stdin and a reply pipe), or adopted, already importing, from the
    driver that started it before Ray (:mod:`.prestart`: one Unix socket for both)."""

    def __init__(self, proc: Any, requests: Any, replies: Any, log_path: Path):
        self.proc = proc  # a Popen, or an Adopted
        self._requests = requests
        self._replies = replies
        self.log_path = log_path
        self.trials = 0

    @classmethod
    def spawn(cls, max_trials: int, env: dict[str, str], workdir: str, fork: bool = False) -> "TrialProcess":
        read_fd, write_fd = os.pipe()
        fd, path = tempfile.mkstemp(prefix="server-", suffix=".log", dir=workdir)
        os.close(fd)
        cmd = server_command(max_trials, env, fork) + ["--reply-fd", str(write_fd)]
        with open(path, "wb") as log_fh:
            # its own process group: a kill reaches a forked trial process too
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log_fh, stderr=subprocess.STDOUT,
                                    env=env, cwd=workdir, pass_fds=(write_fd,), text=True,
                                    start_new_session=True)
        os.close(write_fd)
        # replies unbuffered: a readline must not take the next reply into a buffer that select cannot see
        return cls(proc, proc.stdin, os.fdopen(read_fd, "rb", buffering=0), Path(path))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")

    def submit(self, spec: dict[str, Any], out: Path) -> None:
        self._requests.write(json.dumps({"spec": spec, "out": str(out)}) + "\n")
        self._requests.flush()
        self.trials += 1

    def reply(self, deadline: float | None) -> dict[str, Any] | None:
        """The server's next message; None when it died first; TimeoutError past ``deadline``."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self._replies], [], [], wait)
        if not ready:
            raise TimeoutError
        line = self._replies.readline()
        return json.loads(line) if line else None

    def wait_exit(self, timeout_s: float = EXIT_GRACE_S) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the trial process it forked
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        for channel in (self._replies, self._requests):
            try:
                channel.close()
            except OSError:  # a broken pipe to a dead child
                pass
        self.log_path.unlink(missing_ok=True)


@dataclass
class Outcome:
    """A record (or None when the child died without one) and the trial's output."""

    record: dict[str, Any] | None
    log_text: str
    wall_s: float
    died: str | None = None


# (servers directory, the command a launcher would spawn, its env) -> that server claimed, or None
Adopt = Callable[[str, list[str], dict[str, str]], "TrialProcess | None"]


class Launcher(ABC):
    """Turns specs into records on one worker, one trial at a time."""

    name: str = ""
    fork: bool = False  # each trial in a process forked from the server (which then serves many)

    def __init__(self, settings: LaunchSettings, adopt: Adopt | None = None):
        self.settings = settings
        # claims a trial server the driver prestarted (:func:`.prestart.claim`, given by ``make_launcher``):
        # this module does not import .prestart, which builds its servers' processes from this module's
        self._adopt = adopt
        self._workdir = tempfile.TemporaryDirectory(prefix="juicytalk-")
        self._env = trial_env(settings)
        self._child: TrialProcess | None = None

    @staticmethod
    @abstractmethod
    def process_trials(settings: LaunchSettings) -> int:
        """How many trials one trial process runs before it is replaced."""

    @property
    def trials_per_process(self) -> int:
        return self.process_trials(self.settings)

    def run(self, spec: dict[str, Any], timeout_s: float | None, on_start: Callable[[int], None] | None = None
            ) -> Outcome:
        """Run one trial; a timeout becomes a record (status timeout), a dead child an Outcome.died.
        ``timeout_s`` bounds the wait for the trial process to take the trial (a fresh one imports first), then,
        from the trial's start, its run: a slow import under a loaded host spends none of the trial's time."""
        t0 = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        child = self._child or self._spawn()
        self._child = None  # given back below only if it can serve again
        out = Path(self._workdir.name, f"record-{child.pid}-{child.trials}.json")
        offset = child.log_offset()
        try:
            child.submit(spec, out)
            reply = child.reply(deadline)
            while reply is not None and "started" in reply:
                if on_start:
                    on_start(reply["started"])
                if timeout_s is not None:  # the trial runs from here: trial_timeout_s bounds its run, as it bounds
                    deadline = time.monotonic() + timeout_s  # a multi-rank trial's once its ranks start (ranks.py)
                reply = child.reply(deadline)
        except TimeoutError:
            text = child.log_since(offset)
            child.close()
            record = failure_record(spec, "timeout", f"exceeded trial_timeout_s={timeout_s}")
            return self._done(Outcome(record, text, time.perf_counter() - t0))
        except OSError as exc:  # the pipe to a dead server
            reply = {"died": f"{type(exc).__name__}: {exc}"}
        text = child.log_since(offset)
        if reply is None or "died" in reply or not out.exists():
            code = child.poll()
            child.close()
            tail = (text.strip().splitlines() or ["no output"])[-1][:500]
            why = (reply or {}).get("died") or f"trial process exited with {code} and no record: {tail}"
            return self._done(Outcome(None, text, time.perf_counter() - t0, why))
        record = json.loads(out.read_text())
        out.unlink()
        if reply.get("retire"):
            log.info("trial process %d retires: %s", child.pid, reply.get("why"))
            child.wait_exit()
            child.close()
        else:
            self._child = child
        return self._done(Outcome(record, text, time.perf_counter() - t0))

    def _done(self, outcome: Outcome) -> Outcome:
        """Pre-spawn the next child now: it imports while Tune schedules the next trial."""
        if self._child is None:
            self._child = self._spawn()
        return outcome

    def own_pids(self) -> frozenset[int]:
        """The trial process this launcher keeps between trials (empty when it keeps none)."""
        return frozenset({self._child.pid}) if self._child is not None else frozenset()

    def _spawn(self) -> TrialProcess:
        """A server the driver started for this launcher (:mod:`.prestart`) if one waits, else a new one."""
        if self.settings.servers and self._adopt is not None:
            command = server_command(self.trials_per_process, self._env, self.fork)
            adopted = self._adopt(self.settings.servers, command, self._env)
            if adopted is not None:
                return adopted
        return TrialProcess.spawn(self.trials_per_process, self._env, self._workdir.name, fork=self.fork)

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
        self._workdir.cleanup()


def failure_record(spec: dict[str, Any], status: str, error: str) -> dict[str, Any]:
    from trials.record.fields import empty_record

    record = empty_record()
    record.update(spec)
    record.update(status=status, error=error)
    return record
