"""What else used the device while a trial's steps were timed, and whether that disturbed the timing.

A step time is the trial's only if nothing else took its CPU or GPU meanwhile. Tried on a 2-core host beside
another job, step times came out up to 100x their idle values (hf:gpt2 bf16: 710 ms against 6.96 ms) and nothing
said so. :func:`watch` brackets the timed steps and reads, over that window:

- the host (Linux /proc): how long this process's threads waited on a run queue for a CPU against how long they
  ran (``/proc/self/task/*/schedstat``: the scheduler's own account, ns), the CPU time other processes used as a
  share of the host's core-seconds (``/proc/stat``'s busy jiffies less the trial's own: ``utime + stime`` of this
  process tree and of the trial's other ranks on this host with theirs, :func:`rank_pids`) and the 1-minute load
  average at the window's end;
- the GPU (NVML, the check optimum-benchmark makes): the other compute processes on the trial's device at the
  window's start and end, with the memory each held (this process tree's own are not listed). Where NVML lists
  no compute process at all it cannot see them (the trial's own process holds a CUDA context, so it is one:
  a container whose PID namespace hides them, a vGPU): unknown (null), never "none".

The cell is **disturbed** when another compute process shared its GPU, or when its threads waited for a CPU at
least :data:`WAIT_SHARE_LIMIT` of the time they wanted one. The wait share is the flag, not the other processes'
CPU share: work on cores the trial does not need (a 1-thread trial on a 16-core host beside a 4-thread job)
does not slow it, while a wait on the run queue is time the step did not run. A share ``w`` stretches the host's
part of a step by up to ``1 / (1 - w)``: at 0.2, 1.25x. A quiet host's share is ~0 (the scheduler wakes a
runnable thread on an idle core at once); two busy processes on the trial's core make it ~2/3.
Where /proc or NVML cannot tell (not Linux, no schedstats, no driver) the fields are null and say nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from . import nvml

log = logging.getLogger(__name__)

WAIT_SHARE_LIMIT = 0.2  # run-queue wait / (run + wait) of the trial's threads: a 1.25x stretch of host time
# /proc/stat counts in jiffies (10 ms), each counter +-1: under this many jiffies per CPU (a 0.2 s window) the
# other processes' share is too coarse to say (null); the wait share, in ns, stands
MIN_WINDOW_JIFFIES = 20
PROC = Path("/proc")


@dataclass
class HostSample:
    """One reading of the host's counters: the trial's threads' scheduler times, all CPUs' jiffies, the tree's."""
    thread_run_ns: dict[int, int]  # tid -> ns on a CPU
    thread_wait_ns: dict[int, int]  # tid -> ns runnable, waiting on a run queue
    busy_jiffies: int  # all CPUs: user + nice + system + irq + softirq + steal
    total_jiffies: int  # the same plus idle and iowait: the window's core-time, in jiffies
    tree_jiffies: int  # this process and its descendants: utime + stime (+ its waited-for children's)
    tree_pids: frozenset[int]
    cpus: int = 1  # the host's CPUs (/proc/stat's cpuN lines): total_jiffies grows by this many a jiffy


@dataclass
class Disturbance:
    """What else ran during the timed window; :meth:`fields` are the record's ``timing_*`` fields."""
    wait_share: float | None = None
    foreign_cpu_share: float | None = None
    load_1m: float | None = None
    foreign_gpu: list[dict[str, Any]] | None = None  # [{"pid", "used_bytes"}]; None: not a GPU trial or no NVML
    why: list[str] = field(default_factory=list)

    @property
    def disturbed(self) -> bool | None:
        if self.wait_share is None and self.foreign_gpu is None:
            return None
        return bool(self.why)

    def fields(self) -> dict[str, Any]:
        return {"timing_wait_share": self.wait_share, "timing_foreign_cpu_share": self.foreign_cpu_share,
                "timing_load_1m": self.load_1m,
                "timing_foreign_gpu_processes": None if self.foreign_gpu is None else json.dumps(self.foreign_gpu),
                "timing_disturbed": self.disturbed, "timing_disturbed_why": "; ".join(self.why) or None}


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses): field 3 onwards."""
    text = (PROC / str(pid) / "stat").read_text()
    return text[text.rindex(")") + 2:].split()


def _tree(*roots: int) -> frozenset[int]:
    """Each of ``roots`` and every live descendant (compile workers, a launcher's children), from each process's
    ppid."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(entry.name)[1]), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):  # a process that ended while we looked
                continue
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return frozenset(out)


def _tree_jiffies(pids: frozenset[int], roots: frozenset[int]) -> int:
    total = 0
    for pid in pids:
        try:
            f = _stat_fields(pid)  # utime, stime at 14, 15 (1-based), cutime, cstime at 16, 17
        except (OSError, ValueError):
            continue
        total += int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if pid in roots else 0)
    return total


def rank_pids() -> frozenset[int]:
    """The pids of this trial's other ranks on this host (torchrun's or Ray Train's rank processes), gathered over
    the trial's process group: their CPU time is the trial's own, not another job's. Empty for a one-process
    trial (no process group, or a group of one). A collective: every rank calls it at the same point (the timed
    steps' start, which every rank reaches). A rank is taken for this host's by its host name; ranks on one host
    in PID namespaces of their own (one container each) would name pids this process cannot see."""
    import torch.distributed as dist

    from ..parallel.ranks import Ranks, gathered  # torch: imported when a trial runs, not with this module

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return frozenset()
    here, me = socket.gethostname(), os.getpid()
    ranks = gathered((here, me), Ranks(dist.get_rank(), dist.get_world_size()))
    return frozenset(pid for host, pid in ranks if host == here and pid != me)


def host_sample(siblings: frozenset[int] = frozenset()) -> HostSample | None:
    """The counters now, or None where /proc does not have them (not Linux, no schedstats). ``siblings``: the
    trial's other rank processes on this host (:func:`rank_pids`), counted with their descendants as the trial's
    own, as this process's tree is."""
    try:
        run, wait = {}, {}
        for task in (PROC / "self" / "task").iterdir():
            try:
                r, w, _ = (PROC / "self" / "task" / task.name / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            run[int(task.name)], wait[int(task.name)] = int(r), int(w)
        lines = (PROC / "stat").read_text().splitlines()
        cpu = [int(v) for v in lines[0].split()[1:9]]
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
        user, nice, system, idle, iowait, irq, softirq, steal = cpu
        busy = user + nice + system + irq + softirq + steal
        roots = frozenset({os.getpid()}) | siblings
        pids = _tree(*roots)
        return HostSample(run, wait, busy, busy + idle + iowait, _tree_jiffies(pids, roots), pids, max(cpus, 1))
    except (OSError, ValueError, IndexError) as exc:
        log.debug("host counters unavailable: %s", exc)
        return None


def compare(start: HostSample, end: HostSample) -> tuple[float | None, float | None]:
    """(wait share of the trial's threads, other processes' share of the host's core-time) between two samples."""
    run = sum(ns - start.thread_run_ns.get(tid, 0) for tid, ns in end.thread_run_ns.items())
    wait = sum(ns - start.thread_wait_ns.get(tid, 0) for tid, ns in end.thread_wait_ns.items())
    wait_share = wait / (run + wait) if run + wait > 0 else None
    span = end.total_jiffies - start.total_jiffies
    own = end.tree_jiffies - start.tree_jiffies
    enough = span >= MIN_WINDOW_JIFFIES * end.cpus
    foreign = max(0.0, (end.busy_jiffies - start.busy_jiffies - own) / span) if enough else None
    return wait_share, foreign


def _load_1m() -> float | None:
    try:
        return float((PROC / "loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def gpu_processes() -> list[dict[str, Any]] | None:
    """The compute processes on torch's current GPU (pid, bytes used), ours among them, or None where NVML cannot
    tell. Called by a process that holds a CUDA context on that GPU (the timed steps ran there), so it is one of
    them: an empty list means NVML cannot see processes here (a container's PID namespace, a vGPU), not that
    there are none, and is None too."""
    with nvml.session() as nv:
        if nv is None:
            return None
        try:
            procs = [{"pid": pid, "used_bytes": used}
                     for pid, used in nvml.compute_processes(nv, nvml.torch_device_handle(nv))]
        except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver, container and MIG mode
            log.debug("NVML processes: %s", exc)
            return None
    if not procs:
        log.info("NVML lists no compute process on this GPU, not even this one (it holds a CUDA context): it "
                 "cannot see processes here, so other processes on the GPU are unknown (timing_foreign_gpu_processes "
                 "null)")
        return None
    return procs


def nvml_self(procs: list[dict[str, Any]], own: frozenset[int], reserved: int) -> int | None:
    """The pid NVML gives this process, where it is none of ``own`` (in a container NVML names processes by the
    host's pids): the one whose memory is nearest ``reserved`` (what this process's allocator holds; it holds a
    CUDA context, so it is listed). None where NVML lists one of ``own`` (same pid namespace) or nothing.
    Decided once, from the window's first reading: deciding at each reading could leave out a different pid at
    the end and list this process as another. Processes whose memory NVML does not give (``usedGpuMemory``
    None: some containers and MIG) come after those it does; where it gives none, the first is taken: the
    listing may then name the wrong pid, but how many others there are, and so the flag, stands."""
    if not procs or any(p["pid"] in own for p in procs):
        return None
    return min(procs, key=lambda p: (p["used_bytes"] is None, abs((p["used_bytes"] or 0) - reserved)))["pid"]


def foreign_gpu(start: list[dict[str, Any]] | None, end: list[dict[str, Any]] | None, own: frozenset[int],
                us: int | None) -> list[dict[str, Any]] | None:
    """The other processes in either reading (the end's wins for one in both), less ``own`` and ``us``
    (:func:`nvml_self`), by pid; None where neither reading could be taken."""
    if start is None and end is None:
        return None
    seen = {p["pid"]: p for p in (start or []) + (end or []) if p["pid"] not in own and p["pid"] != us}
    return sorted(seen.values(), key=lambda p: p["pid"])


def _us(procs: list[dict[str, Any]], sample: HostSample | None) -> int | None:
    import torch

    own = sample.tree_pids if sample else frozenset({os.getpid()})
    return nvml_self(procs, own, torch.cuda.memory_reserved())


@contextlib.contextmanager
def watch(device: str) -> Iterator[Disturbance]:
    """Bracket the timed steps; the yielded :class:`Disturbance` is filled in when the block ends.
    The readings are taken outside the block (a few ms of /proc and NVML): nothing is read while it runs."""
    out = Disturbance()
    siblings = rank_pids()  # before the first reading: a collective, it waits for the slowest rank
    start = host_sample(siblings)
    gpu_start = gpu_processes() if device == "cuda" else None
    us = _us(gpu_start, start) if gpu_start is not None else None  # this process's NVML pid, decided once
    yield out
    end = host_sample(siblings)
    if start is not None and end is not None:
        out.wait_share, out.foreign_cpu_share = compare(start, end)
    out.load_1m = _load_1m()
    if device == "cuda":
        gpu_end = gpu_processes()
        if gpu_start is None and gpu_end is not None:
            us = _us(gpu_end, end)
        own = (start.tree_pids if start else frozenset()) | (end.tree_pids if end else frozenset()) | {os.getpid()}
        out.foreign_gpu = foreign_gpu(gpu_start, gpu_end, own, us)
    if out.wait_share is not None and out.wait_share >= WAIT_SHARE_LIMIT:
        # short: it is the sweep summary's "why" of an ok trial (the fields hold the numbers)
        other = f", others' CPU {out.foreign_cpu_share:.0%}" if out.foreign_cpu_share is not None else ""
        load = f", load {out.load_1m:.1f}" if out.load_1m is not None else ""
        out.why.append(f"threads waited for a CPU {out.wait_share:.0%} of the time (limit {WAIT_SHARE_LIMIT:.0%})"
                       f"{other}{load}")
    if out.foreign_gpu:
        used = sum(p["used_bytes"] or 0 for p in out.foreign_gpu)
        out.why.append(f"{len(out.foreign_gpu)} other process(es) on the GPU ({used / 2**20:.0f} MiB)")
