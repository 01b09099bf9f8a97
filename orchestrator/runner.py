"""The Ray Tune driver: pending (cell, sample) pairs -> one Tune trial each -> one record each.

Tune reuses its worker actors across trials (``reuse_actors=True``); each worker runs trials in
child processes through the sweep's launcher (:mod:`orchestrator.launchers`), so a CUDA context, a
crash or a hang never takes the worker down, ``trial_timeout_s`` can kill a stuck trial, and a
worker or trial process killed from outside is retried by Tune's ``FailureConfig``. A trial that
fails on its own (OOM, divergence, an exception) still produces a record and is not retried: an
OOM would only happen again.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from trials.runtime.environ import environ
from trials.record.fields import FINAL_STATUSES

from . import embedded_ray
from .launchers import LAUNCHERS, LaunchSettings, prestart
from .launchers.base import PACKAGE_ROOT
from .launchers.ranks import RANKS_DRIVER_CPU
from .lock import Lease, sweep_lock
from .store import StorageFull, Store, utc_stamp
from .search import Search
from .sweep import Sweep
from .work import Context, WorkItem, grid_items

log = logging.getLogger(__name__)

MAX_FAILURES = 2  # Tune retries of a trial whose worker or trial process died


class SweepInputError(ValueError):
    """The sweep cannot run here as given (unschedulable resources, storage not shared); exit 2."""


@dataclass
class SweepOutcome:
    total: int
    ran: int
    already_done: int
    run_id: str = ""
    statuses: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    results_path: str | None = None
    search: Any = None  # the search's answer (orchestrator/answer.py), when the sweep has one
    interrupted: bool = False  # Ctrl-C or SIGTERM stopped the run
    resources: dict[str, float] = field(default_factory=dict)  # what each trial got (after a CPU fallback)
    items: list[WorkItem] = field(default_factory=list)  # every (cell, sample) of the run: the grid's, the search's

    @property
    def failed(self) -> list[str]:
        return sorted(k for k, s in self.statuses.items() if s not in FINAL_STATUSES)

    @property
    def complete(self) -> bool:
        return not self.missing and not self.failed


def work_items(sweep: Sweep) -> list[WorkItem]:
    """The grid's (cell, sample) pairs."""
    return grid_items(sweep.cells, sweep.samples)


def run_context(sweep: Sweep, storage: str, launcher: str | None = None) -> Context:
    launch = {"launcher": launcher or sweep.launcher, "warm_max_trials": sweep.warm_max_trials,
              "compile_cache": sweep.compile_cache, "cwd": os.getcwd()}
    return Context(storage=storage, sweep_name=sweep.name, timeout_s=sweep.trial_timeout_s, launch=launch)


# ---------------------------------------------------------------------------------------------
# Ray session
# ---------------------------------------------------------------------------------------------
@contextmanager
def ray_session(address: str | None, dashboard: bool = False, verbose: bool = False) -> Iterator[Any]:
    """Connect to ``address`` (or RAY_ADDRESS), else start a local embedded Ray; shut it down after."""
    given = bool(address)
    address = address or os.environ.get("RAY_ADDRESS") or None
    embedded_ray.configure(local=not address)  # before Ray is imported: it reads its auth mode once, at import
    import ray

    kwargs: dict[str, Any] = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    if address:
        _connect(ray, address, "--address" if given else "RAY_ADDRESS", kwargs)
    else:
        embedded_ray.start(ray, PACKAGE_ROOT, include_dashboard=dashboard, **kwargs)
    before = _term_like_int()
    try:
        yield ray
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
        ray.shutdown()


@contextmanager
def prestarted_servers(address: str | None, context: Context, resources: dict[str, float], trials: int
                       ) -> Iterator[Context]:
    """``context`` naming the trial servers started here for a local Ray's launchers to adopt, while Ray and
    Tune start (:mod:`~orchestrator.launchers.prestart`), for ``trials`` single-rank trials at most at once;
    ``context`` as it is when joining a cluster or when none can be planned. Ends the servers on exit."""
    node = None if address or os.environ.get("RAY_ADDRESS") or trials < 1 else embedded_ray.local_node()
    settings = LaunchSettings(**context.launch)
    kind = LAUNCHERS[settings.launcher]
    try:
        servers = None if node is None else prestart.start(settings, kind.fork, kind.process_trials(settings),
                                                           resources, *node, trials)
    except OSError as exc:  # a saving, never a failure: the launchers start their own
        log.warning("trial servers could not be started before Ray (%s); the workers start them", exc)
        servers = None
    if servers is None:
        yield context
        return
    with servers:
        yield replace(context, launch={**context.launch, "servers": servers.directory})


def check_address(address: str | None) -> None:
    """Before anything is written: a ``ray://`` address (Ray Client) needs ``ray[client]`` (grpcio), which
    a plain ``ray[tune]`` install lacks; Ray would say so in a traceback after the sweep's folder exists."""
    given = bool(address)
    address = address or os.environ.get("RAY_ADDRESS") or ""
    if address.startswith("ray://"):
        import importlib.util

        if importlib.util.find_spec("grpc") is None:
            raise SweepInputError(f"{'--address' if given else 'RAY_ADDRESS'} {address}: a ray:// address connects "
                                  "through Ray Client, which needs the grpcio package: pip install 'ray[client]' "
                                  "(or give the cluster's GCS address host:6379 from one of its nodes)")


CONNECT_PROBE_S = 5.0  # how long the cluster's GCS port may take to accept a TCP connection


def _connect(ray: Any, address: str, origin: str, kwargs: dict[str, Any]) -> None:
    """``ray.init(address)``, or one line (:class:`SweepInputError`) when no cluster can be joined there.
    Ray retries a GCS that does not answer for many minutes, printing a warning every few seconds, and
    raises a traceback on a wrong token; a mistyped address or a stopped cluster is bad input."""
    host, _, port = address.rpartition(":")
    if "://" not in address and host and port.isdigit():  # host:port (not "auto", not a ray:// client URI)
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_PROBE_S).close()
        except OSError as exc:
            raise SweepInputError(f"{origin} {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                                  "start one (ray start --head) or leave the address out for a local Ray") from None
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:  # Ray wraps what went wrong (a wrong token is an AuthenticationError)
        causes = [exc]
        while causes[-1].__cause__ is not None:
            causes.append(causes[-1].__cause__)
        if any("InvalidAuthToken" in str(c) or isinstance(c, ray.exceptions.AuthenticationError) for c in causes):
            raise SweepInputError(f"{origin} {address}: the cluster refused this driver's token; set RAY_AUTH_MODE="
                                  "token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) as the cluster has them") from None
        raise SweepInputError(f"{origin} {address}: {exc}") from None


def _term_like_int() -> Any:
    """SIGTERM (what Slurm, Kubernetes and systemd send) does what SIGINT does: Tune stops its trials, the
    sweep prints its summary and the same command resumes. Installed after ``ray.init``, whose native
    handler would otherwise dump a stack and kill the driver. Returns the handler it replaced (None off
    the main thread, where Python cannot set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum: int, frame: Any) -> None:
        handler = signal.getsignal(signal.SIGINT)  # Tune's own while it runs, Python's otherwise
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, on_term)


class Interrupts:
    """Whether Ctrl-C (or SIGTERM, which does what SIGINT does) stopped a Tune run, so the summary can say
    "interrupted" instead of guessing. Tune stops its loop on its own SIGINT handler and returns normally,
    keeping what it saw to itself; while :meth:`catching`, the driver's handler notes the signal and hands it
    to Tune's SIGUSR1 handler (the same stop Tune's SIGINT handler makes). A second Ctrl-C raises
    KeyboardInterrupt, as it does under Tune."""

    def __init__(self) -> None:
        self.seen = False

    def _on_int(self, signum: int, frame: Any) -> None:
        stop = signal.getsignal(signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else None
        if self.seen or not callable(stop):
            self.seen = True
            raise KeyboardInterrupt
        self.seen = True
        stop(signum, frame)

    @contextmanager
    def catching(self) -> Iterator["Interrupts"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = signal.signal(signal.SIGINT, self._on_int)
        try:
            with environ(TUNE_DISABLE_SIGINT_HANDLER="1"):  # Tune leaves SIGINT to this handler; SIGUSR1 stays its
                yield self
        finally:
            signal.signal(signal.SIGINT, before)


def check_resources(nodes: list[dict[str, Any]], resources: dict[str, float]) -> dict[str, float]:
    """Fail fast when no node can ever hold one trial; without GPUs anywhere, fall back to CPU.
    ``nodes`` is ``ray.nodes()``.

    Trials that run on CPU are timed on the host's cores, so two at once on one host would time each
    other (as two on one GPU would): a CPU trial takes every CPU of a node (the smallest node that
    fits it), one trial per host at a time. Trials on nodes larger than that may still share one,
    which the report flags. A rank of a multi-rank cell takes the CPUs the file gives it
    (``rank_cpu``), not a node: gloo ranks on one host (a DDP/FSDP cell tried on a laptop) share its
    cores by design, and their record says so (``interconnect``: same host).
    """
    nodes = [n for n in nodes if n.get("Alive")]
    total_gpu = sum(n["Resources"].get("GPU", 0) for n in nodes)
    wanted = dict(resources)
    fallback = wanted.get("gpu", 0) > 0 and total_gpu == 0
    if fallback:
        wanted["gpu"] = 0
    fits = [n for n in nodes if n["Resources"].get("CPU", 0) >= wanted["cpu"]
            and n["Resources"].get("GPU", 0) >= wanted.get("gpu", 0)]
    if not fits:
        best = ", ".join(f"{n['NodeManagerAddress']}: cpu={n['Resources'].get('CPU', 0):g} "
                         f"gpu={n['Resources'].get('GPU', 0):g}" for n in nodes)
        raise SweepInputError(f"resources: no node can run a trial needing cpu={wanted['cpu']:g} "
                              f"gpu={wanted.get('gpu', 0):g} (nodes: {best}); lower resources in the sweep file")
    wanted["rank_cpu"] = wanted["cpu"]  # what the file says, per rank, before a CPU trial is widened to a node
    if wanted.get("gpu", 0) == 0:
        wanted["cpu"] = min(n["Resources"]["CPU"] for n in fits)
    if fallback:  # the sweep's summary says so in one line (resources_note)
        log.info("no GPUs in this Ray cluster: trials run on CPU (torch backend), one per host at a time "
                 "(cpu=%g each); te/fp8 cells are unsupported", wanted["cpu"])
    return wanted


def resources_note(asked: dict[str, float], got: dict[str, float]) -> str | None:
    """One line for the summary when :func:`check_resources` gave each trial other resources than the file
    asked (no GPUs: CPU trials, each taking a whole host), else None."""
    if not got or all(got.get(k, 0) == asked.get(k, 0) for k in ("gpu", "cpu")):
        return None
    def fmt(r: dict[str, float]) -> str:
        return f"gpu={r.get('gpu', 0):g} cpu={r.get('cpu', 0):g}"
    why = ("no GPUs in this Ray cluster: trials ran on CPU" if asked.get("gpu") and not got.get("gpu")
           else "CPU trials")
    return (f"resources: {why}, each taking a whole host so that two never time each other: {fmt(got)} per trial "
            f"(the file asks {fmt(asked)})")


def rank_slots(node: dict[str, float], rank_cpu: float, gpu: bool) -> int:
    """How many ranks of a multi-rank cell one node (its ``ray.nodes()`` resources) holds at once: its CPUs in
    ``rank_cpu``'s, and on GPU no more than its GPUs (a rank's GPU and CPUs are on one node). A rank asks
    ``rank_cpu`` less the trial's own sliver (``launchers.ranks.rank_cpu``), so the trial fits beside its ranks."""
    cpus = int(node.get("CPU", 0) / rank_cpu + 1e-9) if rank_cpu > 0 else sys.maxsize  # 1e-9: 0.3 / 0.1 is 2.99..
    return min(cpus, int(node.get("GPU", 0))) if gpu else cpus


def check_ranks(nodes: list[dict[str, Any]], world_sizes: list[int], resources: dict[str, float]) -> int | None:
    """A multi-rank cell needs world_size ranks' worth of resources at once (``resources`` as
    :func:`check_resources` returns them: a GPU and ``rank_cpu`` CPUs per rank, or ``rank_cpu`` CPUs on CPU,
    counted per node by :func:`rank_slots`); refuse it in one line when the cluster (``ray.nodes()``) can never
    give them (before any trial starts). Returns how many trials may run at once (None: no limit from ranks): a
    multi-rank trial holds only a sliver itself and Ray Train asks for its ranks after it started, so two such
    trials started together could each hold what the other's ranks need (and a worker group that cannot be placed
    waits for ever)."""
    widest = max(world_sizes, default=1)
    if widest <= 1:
        return None
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    gpu, unit = bool(resources.get("gpu")), resources.get("rank_cpu", resources["cpu"])
    slots = sum(rank_slots(r, unit, gpu) for r in alive)
    if slots < widest:
        raise SweepInputError(_ranks_refusal(alive, widest, unit, gpu, slots))
    return max(1, slots // widest)


def _ranks_refusal(alive: list[dict[str, float]], widest: int, unit: float, gpu: bool, slots: int) -> str:
    """The one line :func:`check_ranks` refuses with, and what to write instead."""
    most_cpu = int(max((r.get("CPU", 0) for r in alive), default=0))
    fit = next((c for c in range(most_cpu, 0, -1) if sum(rank_slots(r, c, gpu) for r in alive) >= widest), 0)
    fewer = f"resources: {{cpu: {fit}}} (each rank's CPUs) or a smaller world_size"
    if gpu:
        gpus = sum(r.get("GPU", 0) for r in alive)
        if gpus < widest:
            return (f"world_size: {widest} ranks need {widest} GPUs at once; this cluster has {gpus:g} (1 per rank); "
                    f"write a smaller world_size (at most {slots})")
        return (f"world_size: {widest} ranks need {widest} GPUs with {unit:g} CPUs each at once (a rank's GPU and "
                f"CPUs on one node); this cluster has room for {slots}; write "
                + (fewer if fit else f"a smaller world_size (at most {slots})"))
    cpus = sum(r.get("CPU", 0) for r in alive)
    spread = f", room for {slots} ranks: a rank's CPUs are on one node" if cpus >= widest * unit else ""
    return (f"world_size: {widest} ranks need {widest * unit:g} CPUs at once; this cluster has {cpus:g} ({unit:g} "
            f"per rank{spread}); write " + (fewer if fit else f"a world_size of at most {slots}"))


def local_nodes() -> list[dict[str, Any]] | None:
    """What ``ray.nodes()`` will say of the local Ray a sweep starts here, said before it starts
    (``embedded_ray.local_node``: Ray's own detection): one node of this machine's CPUs and GPUs; None where it
    cannot say. Imports Ray."""
    node = embedded_ray.local_node()
    if node is None:
        return None
    gpus, cpus = node
    return [{"Alive": True, "NodeManagerAddress": "this machine", "Resources": {"CPU": cpus, "GPU": float(len(gpus))}}]


def resources_refusal(nodes: list[dict[str, Any]], resources: dict[str, float], world_sizes: list[int]) -> str | None:
    """The one line a sweep is refused with on ``nodes`` when no node can hold one of its trials
    (:func:`check_resources`) or its widest cell's ranks (:func:`check_ranks`), the rules a sweep applies once Ray
    is up; None where they fit. The dry run asks it of :func:`local_nodes`."""
    try:
        check_ranks(nodes, world_sizes, check_resources(nodes, resources))
    except SweepInputError as exc:
        return str(exc)
    return None


def check_shared_storage(ray: Any, store: Store) -> None:
    """A multi-node sweep needs storage every node sees; a node-local path would lose records."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0]
    if len(nodes) < 2 or not store.local:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .storage_probe import sees

    marker = f".probe-{os.getpid()}-{int(time.time() * 1000)}"
    Path(store.root, marker).write_text("juicytalk storage probe")
    try:
        probe = ray.remote(num_cpus=0)(sees)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(store.root, marker) for n in nodes]
        blind = [ip for ip, seen in ray.get(refs, timeout=120) if not seen]
    finally:
        Path(store.root, marker).unlink(missing_ok=True)
    if blind:
        raise SweepInputError(
            f"storage: {store.root} is node-local: node(s) {', '.join(sorted(set(blind)))} cannot see it. A "
            "multi-node sweep needs shared storage (an NFS/EFS mount on every node, or an s3:// URI)")


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
def param_space(items: list[WorkItem]) -> dict[str, Any]:
    """What Tune sees of each trial: its flattened spec, ``sample`` and ``cell_id`` (the ResultGrid's and
    trackers' columns). ``trial`` (the store key) is the grid; every other key is looked up from it."""
    from ray import tune

    rows = {it.key: it.config() for it in items}
    space: dict[str, Any] = {"trial": tune.grid_search(list(rows))}
    for name in (k for k in next(iter(rows.values())) if k != "trial"):
        space[name] = tune.sample_from(lambda config, name=name: rows[config["trial"]][name])
    return space


def _trial_name(trial: Any) -> str:
    """label-s<sample>, as the sweep's tables name a trial, from a searcher's (concrete) config."""
    item = WorkItem.from_config(trial.config)
    return f"{item.label}-s{item.sample}"


def _stopper(lease: Lease | None = None) -> Any:
    """A Tune stopper: stop every trial once a trial could not write to the store because it is full, or once this
    driver lost the sweep lock (``lease``: another driver runs the same cells now)."""
    from ray import tune

    from .trainable import STORAGE_FULL

    class StopSweep(tune.Stopper):
        def __init__(self) -> None:
            self.full = False

        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            self.full = self.full or bool(result.get(STORAGE_FULL))
            return self.stop_all()

        def stop_all(self) -> bool:
            return self.full or bool(lease is not None and lease.lost)

    return StopSweep()


# Tune's result files (what ExperimentAnalysis and Tuner.restore read), named because Tune's automatic loggers
# (off in fit) add TensorBoard's too, which imports torch into the driver (~2 s of CPU a sweep): event files are the
# tensorboard tracker's, written where the sweep names it. Named through Ray's RAY_TUNE_CALLBACKS, not callbacks=:
# for its usage statistics Tune counts the callbacks passed there by importing its MLflow, W&B, Comet and Aim
# integrations (~1.4 CPU-s of every sweep's start), and skips that when none are passed (no trackers).
TUNE_LOGGERS = "ray.tune.logger.CSVLoggerCallback,ray.tune.logger.JsonLoggerCallback"


def tune_loggers() -> AbstractContextManager:
    """Around ``tuner.fit()``: Tune's automatic loggers off, :data:`TUNE_LOGGERS` (after any the user named in
    RAY_TUNE_CALLBACKS) on (benchmarks/sweep_start.py times Tune under the same)."""
    loggers = ",".join(filter(None, [os.environ.get("RAY_TUNE_CALLBACKS"), TUNE_LOGGERS]))
    return environ(TUNE_DISABLE_AUTO_CALLBACK_LOGGERS="1", RAY_TUNE_CALLBACKS=loggers)


def fit(ray: Any, sweep: Sweep, store: Store, context: Context, resources: dict[str, float],
        max_concurrent: int | None, verbose: bool, items: list[WorkItem] | None = None, searcher: Any = None,
        max_trials: int = 1, interrupts: Interrupts | None = None, lease: Lease | None = None) -> None:
    """Run ``items`` (a grid) or what ``searcher`` proposes (at most ``max_trials``) as Tune trials;
    raises :class:`StorageFull` when the store ran out of room, :class:`~orchestrator.lock.SweepLocked` when this
    driver lost the sweep lock (``lease``) meanwhile; ``interrupts`` notes a Ctrl-C."""
    from ray import tune

    from .trackers import build_callbacks
    from .trainable import STORAGE_FULL, TrialTrainable

    one = {"cpu": resources["cpu"], "gpu": resources.get("gpu", 0)}
    names = {it.key: f"{it.label}-s{it.sample}" for it in items or []}  # a grid config is not resolved when named

    def per_trial(config: dict[str, Any]) -> dict[str, float]:
        # a multi-rank trial holds next to nothing itself (Ray needs some resource): its Ray Train workers take a
        # GPU and rank_cpu CPUs, or rank_cpu CPUs, per rank, less that sliver (orchestrator/launchers/ranks.py)
        return {"cpu": RANKS_DRIVER_CPU, "gpu": 0} if int(config.get("world_size", 1)) > 1 else one

    interrupts = interrupts or Interrupts()
    trainable = tune.with_resources(tune.with_parameters(TrialTrainable, context=context), per_trial)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space(items) if items else {},
        tune_config=tune.TuneConfig(
            num_samples=1 if items else max_trials,
            search_alg=searcher,
            max_concurrent_trials=max_concurrent,
            reuse_actors=True,
            trial_name_creator=lambda t: names.get(t.config["trial"]) or _trial_name(t),
            trial_dirname_creator=lambda t: t.config["trial"],
        ),
        run_config=tune.RunConfig(
            name=f"{sweep.name}-{time.strftime('%Y%m%dT%H%M%S')}",
            storage_path=store.url("ray"),  # an object store's URI with its query (endpoint_override=...) kept
            failure_config=tune.FailureConfig(max_failures=MAX_FAILURES),
            stop=_stopper(lease),
            # the store holds every result; a one-step trial has nothing to resume from
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False, checkpoint_frequency=0),
            # the trackers' callbacks; Tune's own result files come from TUNE_LOGGERS (below)
            callbacks=build_callbacks(sweep.trackers, {"sweep": sweep.name, "run_id": context.run["run_id"]}) or None,
            verbose=1 if verbose else 0,
            log_to_file=True,
        ),
    )
    with interrupts.catching(), tune_loggers():
        results = tuner.fit()
    full = next((r.metrics[STORAGE_FULL] for r in results if (r.metrics or {}).get(STORAGE_FULL)), None)
    if full:
        raise StorageFull(store.root, f"no space left on device (first failed write: {full})")
    if lease is not None:
        lease.check()


def prepare_store(sweep: Sweep, storage: str, restart: bool) -> Store:
    """Open the sweep's directory; ``restart`` moves an existing one aside (nothing is deleted)."""
    store = Store(storage, sweep.name)
    if restart and not store.local and store.exists():  # a prefix cannot be renamed: it would be copied whole
        raise SweepInputError(f"--restart: {store.url()} is on object storage, where results are not moved aside; "
                              "give the sweep a new --out prefix instead")
    if restart and store.local and Path(store.root).exists():
        aside = f"{store.root}-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(store.root, aside)
        log.warning("--restart: previous results moved to %s", aside)
    store.ensure()
    store.remove_temporaries()
    for key in store.running():  # one driver per sweep: markers at start are from a crashed run
        store.clear_running(key)
    store.write_text(store.path("sweep.yaml"), sweep.source_text)
    return store


def run_sweep(sweep: Sweep, storage: str, address: str | None = None, restart: bool = False,
              max_concurrent: int | None = None, verbose: bool = False, dashboard: bool = False,
              progress: Any = None, launcher: str | None = None) -> SweepOutcome:
    """Run every (cell, sample) without a final record; consolidate; report what is missing.

    One driver per sweep directory: a second one is refused (:func:`~orchestrator.lock.sweep_lock`).
    """
    check_address(address)
    with sweep_lock(Store(storage, sweep.name)) as lease:
        return _run_locked(sweep, storage, address, restart, max_concurrent, verbose, dashboard, progress, launcher,
                           lease)


def _run_locked(sweep: Sweep, storage: str, address: str | None, restart: bool, max_concurrent: int | None,
                verbose: bool, dashboard: bool, progress: Any, launcher: str | None, lease: Lease) -> SweepOutcome:
    t0 = time.perf_counter()
    started = utc_stamp()
    run = {"run_id": f"{started.replace('-', '').replace(':', '')}-{uuid.uuid4().hex[:6]}",
           "run_started_at": started, "run_gpus": None}
    store = prepare_store(sweep, storage, restart)
    context = run_context(sweep, storage if "://" in storage else str(Path(storage).expanduser().resolve()), launcher)
    items = work_items(sweep)
    done = store.final_keys()
    pending = [it for it in items if it.key not in done]
    log.info("%d trials, %d already have a final record, %d to run", len(items), len(items) - len(pending), len(pending))
    search = None if sweep.search is None else Search(sweep.search, store)
    world_sizes = [int(it.spec.get("world_size", 1)) for it in pending] + (
        [] if search is None else [int(search.item(*where, 0).spec.get("world_size", 1)) for where in search.cells.values()])
    interrupts, resources = Interrupts(), dict(sweep.resources)
    if pending or (search is not None and not search.finished):
        single = sum(1 for w in world_sizes if w == 1) if search is None else sys.maxsize
        at_once = min(single, max_concurrent or sweep.max_concurrent or single)
        with prestarted_servers(address, context, sweep.resources, at_once) as context, \
                ray_session(address, dashboard=dashboard, verbose=verbose) as ray:
            nodes = ray.nodes()
            resources = check_resources(nodes, sweep.resources)
            check_shared_storage(ray, store)
            run["run_gpus"] = int(ray.cluster_resources().get("GPU", 0)) if resources.get("gpu") else 0
            ranks_limit = check_ranks(nodes, world_sizes, resources)
            context = context.with_run(run, resources)
            if progress is not None:
                progress.start(store, items, done)
            try:
                limit = min((v for v in (max_concurrent or sweep.max_concurrent, ranks_limit) if v), default=None)
                if pending:
                    fit(ray, sweep, store, context, resources, limit, verbose, items=pending, interrupts=interrupts,
                        lease=lease)
                if search is not None and not interrupts.seen:
                    search.refresh()  # the grid's records, just written, are the search's too
                    if not search.finished:
                        from .searcher import RecordSearcher  # imports Ray: inside the sweep's Ray session

                        fit(ray, sweep, store, context, resources, limit, verbose, searcher=RecordSearcher(search),
                            max_trials=search.plan.max_trials, interrupts=interrupts, lease=lease)
            finally:
                if progress is not None:
                    progress.stop()
    if search is not None:
        search.refresh()
        items = items + [it for it in search.items() if it.key not in {i.key for i in items}]
        store.write_text(store.path("search.json"), search.answer().to_json())
    statuses = store.statuses()
    keys = {it.key for it in items}
    path, _ = store.collect()
    return SweepOutcome(total=len(items), ran=sum(1 for k in keys if k not in done and k in statuses),
                        already_done=sum(1 for k in keys if k in done),
                        run_id=run["run_id"], statuses={k: v for k, v in statuses.items() if k in keys},
                        missing=sorted(keys - statuses.keys()), wall_s=time.perf_counter() - t0,
                        results_path=path, search=None if search is None else search.answer(), items=items,
                        interrupted=interrupts.seen, resources=resources)
