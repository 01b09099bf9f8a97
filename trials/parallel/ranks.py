"""The rank seam: one trial, N processes, one record. torchrun-style ranks, DDP or FSDP2, slowest-rank timing.

A trial with ``world_size > 1`` (or ``parallel`` other than ``none``) runs in ``world_size`` processes
started by whoever launches it: ``torchrun --nproc-per-node N -m trials ...`` or a Ray Train worker
group. Each reads its place from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins one process group: NCCL on GPUs, gloo on
CPU (where a launcher already made one, as Ray Train does, it is used as is).

- ``batch_size`` is per rank. Every rank draws the same global batch (``world_size * batch_size``
  rows; with ``grad_accum``, ``grad_accum`` times that, split into micro-batches on each rank) from the seeded
  data and trains on its own rows, so DDP's averaged gradient is exactly the one-process gradient of the
  global batch (the acceptance test checks the loss curves agree). Under gradient accumulation the ranks
  reduce gradients on a step's last micro-batch only (:func:`held_gradients` on the others: DDP's
  ``no_sync``, FSDP2's ``set_requires_gradient_sync``, which torchtitan's FSDP notes name for it).
- ``parallel: ddp`` wraps the model in ``DistributedDataParallel``; ``parallel: fsdp`` shards it with
  FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per decoder layer, then the root. The units
  are the model source's (trials/models: MiniGPT's blocks, a transformers model's ``_no_split_modules``
  layers, a factory's ``fsdp_units`` or its largest ``nn.ModuleList``); nothing here knows which model
  it shards. As torchtitan does, ``compile: true`` compiles each unit (before sharding, after activation
  checkpointing), so FSDP2's hooks stay outside the compiled code; the root runs eager.
- A step's time is the slowest rank's: each rank times its own steps, then an all-reduce (MAX) of the
  per-step times; every rank then holds the same numbers, so whatever runs after timing (the energy
  window, the profiler) runs the same number of steps on every rank and no collective waits forever
  (a rank whose NVML or profiler fails still runs them, unmeasured). What else ran during the timed
  steps is every rank's reading in one (:func:`timing`); losses are the global batch's (:func:`mean`),
  so every rank decides divergence alike.
- Rank 0 keeps the record; the others return theirs for nobody to write.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..spec import COLLECTIVE_TIMEOUT_S

log = logging.getLogger(__name__)

# What gloo and NCCL say when a collective waited past the group's timeout (a rank stopped or hung).
TIMEOUT_MARKERS = ("timed out waiting", "collective operation timeout", "watchdog caught", "wait timeout")


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that waited past the process group's timeout."""
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in TIMEOUT_MARKERS)


class Unsupported(RuntimeError):
    """What a stack's own library refuses to shard, in its words: the trial's status is ``unsupported``, not
    ``error`` (TE modules FSDP2 cannot take in the installed TE)."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "Ranks":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


SINGLE = Ranks()


@contextlib.contextmanager
def session(world_size: int, parallel: str, device: str) -> Iterator[Ranks]:
    """This process's place in the trial's process group (made here if the launcher made none)."""
    if world_size == 1 and parallel == "none":
        yield SINGLE
        return
    import torch.distributed as dist

    ranks = Ranks.from_env()
    if ranks.world != world_size:
        raise RuntimeError(f"world_size: the trial asks for {world_size} ranks but this process is rank {ranks.rank} "
                           f"of WORLD_SIZE={ranks.world}; start it with torchrun --nproc-per-node {world_size} "
                           "(or through juicytalk sweep)")
    made = not dist.is_initialized()
    if device == "cuda":
        torch.cuda.set_device(ranks.local)
    if made:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = "nccl" if device == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if "MASTER_ADDR" in os.environ:  # torchrun or another launcher said where rank 0 listens
            dist.init_process_group(backend, timeout=timeout)
        else:  # one rank on its own (world_size 1 under DDP or FSDP2): a group of one on a free local port
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    try:
        yield ranks
    finally:
        if made:
            dist.destroy_process_group()


def global_batch(data: Any, batch: int, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch (every rank draws the same ``world * batch`` rows)."""
    x, y = data.batch(batch * ranks.world)
    rows = slice(ranks.rank * batch, (ranks.rank + 1) * batch)
    return x[rows], y[rows]


class RankData:
    """``data.batch(b)`` for one rank: its ``b`` rows of a global batch of ``world * b``."""

    def __init__(self, data: Any, ranks: Ranks):
        self.data, self.ranks = data, ranks
        self.device, self.vocab, self.seq_len = data.device, data.vocab, data.seq_len

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return global_batch(self.data, batch, self.ranks)


def wrap(model: nn.Module, parallel: str, device: str, ranks: Ranks, units: tuple[str, ...] = ()) -> nn.Module:
    """The module the step calls: DDP around ``model``, or ``model`` itself sharded in place by FSDP2, one unit
    per entry of ``units`` (qualified names), then the root."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[ranks.local] if device == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        if not units:
            raise RuntimeError("parallel fsdp: the model has no units to shard (its source found no decoder layers)")
        for name in units:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
        return model
    return model


@contextlib.contextmanager
def held_gradients(module: nn.Module, parallel: str) -> Iterator[None]:
    """A micro-batch's forward and backward that keep this rank's gradients to itself: every one of a step's but
    the last, whose backward then reduces their sum once (DDP's ``no_sync``; FSDP2's
    ``set_requires_gradient_sync(False)``, which accumulates unsharded gradients until it is on again). ``module``:
    what :func:`wrap` returned."""
    if parallel == "ddp":
        with module.no_sync():
            yield
        return
    if parallel == "fsdp":
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def compile_units(model: nn.Module, units: tuple[str, ...]) -> None:
    """``torch.compile`` each unit in place of itself (torchtitan's ``apply_compile``): one compiled region per
    decoder layer, the same code for every layer, so Inductor compiles it once; the root stays eager."""
    for name in units:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent)
        holder.register_module(child, torch.compile(holder.get_submodule(child)))


@contextlib.contextmanager
def whole(model: nn.Module, parallel: str) -> Iterator[None]:
    """The root's own parameters gathered for code that calls the model's parts directly (generation
    reads ``model.tok`` and ``model.head``, which FSDP2's forward hooks on the root would not gather)."""
    if parallel != "fsdp":
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def slowest(values: list[float], ranks: Ranks) -> list[float]:
    """Per-step times of the slowest rank (elementwise MAX over ranks)."""
    return _reduce(values, ranks, "MAX")


def mean(values: list[float], ranks: Ranks) -> list[float]:
    """Elementwise mean over ranks: a rank's loss is its rows' mean, the global batch's is their mean."""
    total = _reduce(values, ranks, "SUM")
    return [v / ranks.world for v in total]


def _reduce(values: list[float], ranks: Ranks, op: str) -> list[float]:
    if ranks.world == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.tolist()


def local_shard(full: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's part of ``full`` (a whole tensor every rank holds), cut as FSDP2 cut ``param`` (a DTensor;
    a plain tensor is returned whole): what an optimizer state seeded from a whole tensor needs."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def amax_group(ranks: Ranks) -> Any:
    """The group TE's delayed scaling reduces its amaxes over: all ranks, so that every rank casts with
    the same scales (FP8 weight shards all-gathered under FSDP2 carry one scale for the whole weight;
    Megatron reduces them over data-parallel ranks for the same reason). None for one rank."""
    if ranks.world == 1:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


def select_device(world_size: int, parallel: str) -> None:
    """A multi-rank trial's process takes its own GPU before anything touches CUDA."""
    if (world_size > 1 or parallel != "none") and torch.cuda.is_available():
        torch.cuda.set_device(Ranks.from_env().local)


def gathered(value: float | int | str | None, ranks: Ranks) -> list[Any]:
    """Every rank's ``value`` (on every rank)."""
    if ranks.world == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def timing(fields: dict[str, Any], ranks: Ranks) -> dict[str, Any]:
    """This rank's readings of what else ran during the timed steps (``timing_*``: disturbance and GC), every
    rank's in one (:func:`merged_timing`): the steps' times are the slowest rank's, so what disturbed any rank's
    steps disturbed them."""
    return dict(fields) if ranks.world == 1 else merged_timing(gathered(fields, ranks))


def merged_timing(every: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's ``timing_*`` fields (rank 0's first) as one record's: disturbed where any rank was (unknown where
    none was and a rank could not tell), every rank's reasons and other GPU processes (each with its rank), and the
    largest of each number (wait share, others' CPU share, load, GC pauses). One rank's are returned as they are."""
    if len(every) == 1:
        return dict(every[0])
    out: dict[str, Any] = {}
    for key in every[0]:
        values = [f.get(key) for f in every]
        merge = _TIMING_MERGES.get(key)
        if merge is not None:
            out[key] = merge(values)
        elif all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            out[key] = max((v for v in values if v is not None), default=None)
        else:  # a field no rule here knows: rank 0's, as before the ranks' were merged
            out[key] = values[0]
    return out


def _any_disturbed(flags: list[bool | None]) -> bool | None:
    if any(flags):
        return True
    return None if None in flags else False


def _reasons(whys: list[str | None]) -> str | None:
    return "; ".join(f"rank {rank}: {why}" for rank, why in enumerate(whys) if why) or None


def _processes(lists: list[str | None]) -> str | None:
    """Every rank's other GPU processes, each tagged with its rank (a process on two ranks' GPUs is listed twice,
    with what it held on each); null where nothing was seen and a rank could not tell."""
    seen = [{**p, "rank": rank} for rank, text in enumerate(lists) if text for p in json.loads(text)]
    return None if not seen and None in lists else json.dumps(seen)


_TIMING_MERGES = {"timing_disturbed": _any_disturbed, "timing_disturbed_why": _reasons,
                  "timing_foreign_gpu_processes": _processes}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _comm_device() -> str:
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def facts(ranks: Ranks, device: str) -> dict[str, Any]:
    """Record fields about the group: the NCCL version, whether all ranks share one host."""
    hosts = gathered(socket.gethostname(), ranks)
    nccl = None
    if device == "cuda":
        with contextlib.suppress(Exception):
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {"nccl_version": nccl, "interconnect": "same host" if len(set(hosts)) == 1 else
            f"{len(set(hosts))} hosts"}
