"""A trial process that serves trials one after another: imports and compiles are paid once.

    python -m trials.server --reply-fd N [--max-trials K] [--preload-te] [--fork]
    python -m trials.server --listen PATH [--max-trials K] [--preload-te] [--fork]

Started before its first spec is known (torch, and TE where asked, are imported while the caller is
still scheduling), it reads one JSON request per line on stdin::

    {"spec": {...TrialSpec fields...}, "out": "/abs/path/record.json"}

runs :func:`trials.trial.run_trial`, writes the record to ``out`` atomically, and answers on file
descriptor N with ``{"started": pid}`` (the process that runs the trial) and then either
``{"out": ..., "retire": bool, "why": ...}`` (the record is in ``out``) or ``{"died": why}``. Replies go to their
own descriptor so that library output on stdout can never corrupt them. With ``--fork`` each trial
runs in a fresh child forked from the server (imports inherited, CUDA never initialised before).

With ``--listen`` the server is started before anyone knows who will use it (a sweep's driver starts
it while its Ray starts: ``orchestrator/launchers/prestart.py``): it imports, then accepts one
connection on the Unix socket PATH, and requests and replies both travel on that connection. It then
also exits when the process that connected is gone (its pid from the socket's peer credentials).

Every trial frees what it used before it returns (device memory, cuBLAS workspaces, TE's FP8
global state: :func:`trials.trial.run_trial`) and the next starts every memory counter afresh. What
one trial leaves for the next is said: the BF16 partner's teacher-forced read, on the host, which the
next FP8 cell of the same model takes instead of training that partner again (``tf_partner_reused``).
It retires - exits after answering - when a trial ends in oom, error or diverged (the process may be
in a bad state), when TorchDynamo hit its recompile limit (later cells would run TE's fusers
uncompiled), after ``--max-trials`` trials, at EOF on stdin (or the connection), and when its parent dies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

RETIRE_STATUSES = ("oom", "error", "diverged")
RECOMPILE_LIMIT = 64  # Dynamo's default is 8 versions per function; TE's fusers see one per shape/dtype


def _exit_with_parent(parent: int, interval_s: float = 0.5) -> None:
    """Exit when the process that started us is gone (a killed Ray worker must not leave us running)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _exit_with_peer(pid: int, interval_s: float = 0.5) -> None:
    """Exit when the process that adopted us (``--listen``) is gone: its trial must not outlive it."""

    def watch() -> None:
        while alive(pid):
            time.sleep(interval_s)
        os._exit(3)

    threading.Thread(target=watch, name="peer-watch", daemon=True).start()


def preload(te: bool) -> None:
    """Import what every trial needs before the first spec arrives."""
    import torch  # noqa: F401

    from . import trial  # noqa: F401  (model, train, bench, metrics...)
    from .workloads import inference, training  # noqa: F401  (imported by a trial on first use)

    if te:
        from .backends import te_compat

        try:
            te_compat.import_te()
            te_compat.import_fuser_compiler()
        except Exception as exc:  # noqa: BLE001 - the trial itself reports TE's absence as unsupported
            logging.getLogger(__name__).info("TE preload failed: %s", exc)


def _send(reply, message: dict[str, Any]) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def _run_one(request: dict[str, Any], index: int, watch, partners: Any = None) -> dict[str, Any]:
    """Run one trial here and write its record; returns the record. ``partners``: the BF16 partner read this
    process keeps for the next FP8 cell that shares it (trials/teacher_forced.Partners), None in a forked child."""
    from .cli import write_json_atomic
    from .spec import TrialSpec
    from .trial import run_trial

    # leaves nothing behind on the device; ``partners`` keeps one read on the host
    record = run_trial(TrialSpec.from_dict(request["spec"]), process_trial_index=index, partners=partners)
    record["dynamo_recompile_limit_hit"] = bool(watch.take())
    write_json_atomic(Path(request["out"]), record)
    return record


def _run_forked(request: dict[str, Any], reply, watch) -> dict[str, Any]:
    """Fork a fresh trial process from this one (imports done, CUDA untouched) and wait for it to exit.

    The child gets its own CUDA context and address space, as a freshly started process would; the
    next child is forked only after this one has exited, so contexts never overlap on the GPU.
    """
    pid = os.fork()
    if pid == 0:  # the trial process
        code = 1
        try:
            _exit_with_parent(os.getppid())  # threads do not survive fork: watch the server again
            _run_one(request, 0, watch)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _send(reply, {"started": pid})
    _, status = os.waitpid(pid, 0)
    out = Path(request["out"])
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and out.exists():
        return {"out": str(out), "retire": False, "why": None}
    how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exited with {os.WEXITSTATUS(status)}")
    return {"died": f"trial process {pid} {how} without a record"}


def guard_recompiles() -> Any:
    """Raise Dynamo's recompile limit and watch for hits (:mod:`trials.runtime.compile_guard`); imports TorchDynamo
    (seconds where TE did not import it already), so it is done before the first request is read."""
    from .runtime import compile_guard

    compile_guard.raise_recompile_limit(RECOMPILE_LIMIT)
    return compile_guard.watch()


def serve(requests, reply, max_trials: int, watch: Any, fork: bool = False) -> int:
    """Run requests until told to retire; returns the number of trials run. ``watch``: :func:`guard_recompiles`'.

    ``fork``: every trial in a process forked from this one, which never touches CUDA itself and so
    serves any number of trials. Where importing left CUDA initialised (forked children could not
    use it), trials run here instead, ``max_trials`` at most.
    """
    import torch

    from .workloads.teacher_forced import Partners

    if fork and torch.cuda.is_initialized():
        logging.getLogger(__name__).warning("CUDA was initialised while importing: trials run in this process")
        fork = False
    partners = Partners()  # trials run here share it; forked children each start from this empty one
    index = 0
    for line in iter(requests.readline, ""):
        if not line.strip():
            continue
        request = json.loads(line)
        index += 1
        if fork:
            answer = _run_forked(request, reply, watch)
        else:
            _send(reply, {"started": os.getpid()})
            record = _run_one(request, index - 1, watch, partners)
            why = None
            if record["status"] in RETIRE_STATUSES:
                why = f"trial ended in {record['status']}"
            elif record["dynamo_recompile_limit_hit"]:
                why = "TorchDynamo hit its recompile limit"
            elif index >= max_trials:
                why = f"ran max_trials={max_trials}"
            answer = {"out": request["out"], "retire": why is not None, "why": why}
        _send(reply, answer)
        if answer.get("retire"):
            break
    return index


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trials.server", description=__doc__.splitlines()[0])
    channel = parser.add_mutually_exclusive_group(required=True)
    channel.add_argument("--reply-fd", type=int, help="file descriptor for one JSON reply per trial")
    channel.add_argument("--listen", metavar="PATH", help="accept one connection on this Unix socket and serve it")
    parser.add_argument("--max-trials", type=int, default=1, help="retire after this many trials")
    parser.add_argument("--preload-te", action="store_true", help="import Transformer Engine before the first spec")
    parser.add_argument("--fork", action="store_true", help="run each trial in a fresh process forked from this one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .runtime.noise import quiet_third_party

    quiet_third_party()
    _exit_with_parent(os.getppid())
    if args.listen is None:
        preload(args.preload_te)
        watch = guard_recompiles()
        with os.fdopen(args.reply_fd, "w", encoding="utf-8") as reply:
            serve(sys.stdin, reply, max(1, args.max_trials), watch, fork=args.fork)
        return 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(args.listen)  # before the imports: whoever adopts us may connect and send while they run
        listener.listen(1)
        preload(args.preload_te)
        watch = guard_recompiles()
        conn, _ = listener.accept()
    os.unlink(args.listen)
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    _exit_with_peer(pid)
    with conn, conn.makefile("r", encoding="utf-8") as requests, conn.makefile("w", encoding="utf-8") as reply:
        serve(requests, reply, max(1, args.max_trials), watch, fork=args.fork)
    return 0


if __name__ == "__main__":
    code = main()
    # Records are written and replied: skip interpreter teardown (seconds with CUDA and TE loaded).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
