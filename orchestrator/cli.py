"""``juicytalk``: trial, sweep, collect, report, export, fields, doctor.

Exit status: 0 success; 1 when trials errored or are missing (sweep) or a trial errored (trial);
2 for bad input, which is one line on stderr naming the field, and nothing is started; 130 for a Ctrl-C that ends
a command (a sweep's before its trials run: once they run, its summary says "interrupted", exit 1), in one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:  # imported where used: `juicytalk --help` loads neither
    import pyarrow as pa

    from .store import Store

DEFAULT_OUT = "./juicytalk-results"
PROG = "juicytalk"


def summary_records(store: Store) -> pa.Table:
    """The columns of every record in ``store`` that the sweep's closing summary (progress.SUMMARY_COLUMNS) and its
    efficiency line (efficiency.INPUT_COLUMNS) read: naming them here by hand once left the summary without a
    served cell's decode p50 and a compiled cell's ``compiled_eager_why``, which its tests, handed whole records,
    never saw."""
    from .efficiency import INPUT_COLUMNS
    from .progress import SUMMARY_COLUMNS

    return store.read_records(list(dict.fromkeys([*SUMMARY_COLUMNS, *INPUT_COLUMNS])))


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _console() -> Console:
    """Rich output on stdout: a terminal's width when there is one; piped or redirected, lines as long as
    they need (rich would wrap at 80 columns and break labels mid-word). No emoji codes: a model's name is
    data, and rich would print ``hf:llama:`` (a label and its colon) as "hf🦙"."""
    return Console(emoji=False) if sys.stdout.isatty() else Console(width=10_000, emoji=False)


def _quiet_ray_logs(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from trials.runtime.noise import quiet_third_party

    quiet_third_party(verbose)
    if not verbose:
        for name in ("ray", "ray.tune", "ray.train", "ray.air"):
            logging.getLogger(name).setLevel(logging.ERROR)
        # Tune's own experiment state (its resume files, which JuicyTalk never resumes from: the store is the
        # truth) fails loudly on a full disk; the sweep reports that disk itself, in one line
        logging.getLogger("ray.tune.execution.experiment_state").setLevel(logging.CRITICAL)
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")


# -- sweep --------------------------------------------------------------------------------------
def _ray_elsewhere(args: argparse.Namespace) -> bool:
    """The sweep runs on a Ray cluster given by ``--address`` or RAY_ADDRESS: its hosts and GPUs are not this one's."""
    return bool(args.address or os.environ.get("RAY_ADDRESS"))


def _gpu_memory(args: argparse.Namespace) -> int | None:
    """The GPU memory a sweep's memory plan is held against: ``--gpu-memory``, else this machine's first GPU where
    Ray runs here (a cluster's GPUs are not this machine's: give ``--gpu-memory``), else None (not checked).
    Read through NVML (plan.local_gpu_memory_bytes), without importing torch."""
    if args.gpu_memory:
        return int(args.gpu_memory * 2**30)
    if _ray_elsewhere(args):
        return None
    from .plan import local_gpu_memory_bytes

    return local_gpu_memory_bytes()


def _here(args: argparse.Namespace) -> tuple[int | None, bool]:
    """Where Ray runs here (no ``--address``, no RAY_ADDRESS): this host's RAM, which the ranks of a cell share, and
    whether this machine has no GPU, so that its ``device: auto`` cells run on CPU (``--gpu-memory`` or not);
    elsewhere (None, False): a cluster's hosts are not this one."""
    if _ray_elsewhere(args):
        return None, False
    from .plan import host_memory_bytes, local_gpu_memory_bytes

    return host_memory_bytes(), local_gpu_memory_bytes() is None


def _ranks_here(args: argparse.Namespace, sweep: Any, rows: list[dict[str, Any]]) -> str | None:
    """Where Ray runs here and a cell with trials to run has ranks: the line a real sweep refuses its resources
    and ranks with on this machine (runner.resources_refusal, once Ray is up), said without starting Ray."""
    from .plan import to_run
    from .runner import local_nodes, resources_refusal

    widths = [row["spec"].world_size for row in rows if to_run(row)]
    if max(widths, default=1) <= 1 or _ray_elsewhere(args):
        return None
    nodes = local_nodes()
    return None if nodes is None else resources_refusal(nodes, sweep.resources, widths)


def _not_fitting(sweep: Any, rows: list[dict[str, Any]], gpu_memory: int | None, host_memory: int | None
                 ) -> list[dict[str, Any]]:
    """orchestrator/plan.py's ``will_not_fit`` of ``rows``, once the cells on CPU it would refuse are known to run
    here: one this machine records ``unsupported`` (``unsupported_here``: a TE cell without a GPU) never allocates.
    The capability probe runs only where a CPU cell is over."""
    from .plan import unsupported_here, will_not_fit

    over = will_not_fit(rows, gpu_memory, host_memory)
    if not any(row["on_cpu"] for row in over):
        return over
    unsupported = unsupported_here(sweep)
    for row in rows:
        row["unsupported"] = unsupported.get(row["cell_id"])
    return will_not_fit(rows, gpu_memory, host_memory)


def _fit_refusal(sweep: Any, rows: list[dict[str, Any]], gpu_memory: int | None, host_memory: int | None
                 ) -> str | None:
    """orchestrator/plan.py's ``refusal`` of ``rows``, the cells this machine records unsupported left out."""
    from .plan import refusal

    _not_fitting(sweep, rows, gpu_memory, host_memory)
    return refusal(rows, gpu_memory, host_memory)


def _trial_fit(spec: Any) -> str | None:
    """The one line ``juicytalk trial`` refuses ``spec`` with where it will not fit here (a sweep's rule,
    orchestrator/plan.py's ``refusal``: this machine's GPU, this host's RAM), else None."""
    from .plan import host_memory_bytes, local_gpu_memory_bytes, plan_row
    from .sweep import Cell, Sweep, cell_id, cell_label

    gpu_memory = local_gpu_memory_bytes()
    try:
        cell = Cell(spec, cell_id(spec), cell_label(spec))
        row = plan_row(spec, cell.label, cell.cell_id, cpu_here=gpu_memory is None)
        return _fit_refusal(Sweep(name="trial", grids=[], fixed={}, cells=[cell]), [row], gpu_memory,
                            host_memory_bytes())
    except Exception as exc:  # noqa: BLE001 - as a sweep's: a plan that fails never stops a trial
        logging.getLogger(__name__).warning("memory plan failed, not checked: %s: %s", type(exc).__name__, exc)
        return None


def _fitted(search: Any, gpu_memory: int | None, host_memory: int | None, cpu_here: bool, store: Store
            ) -> tuple[Any, str | None]:
    """A best-setting search less the cells a real sweep refuses as not fitting (orchestrator/plan.py's
    ``will_not_fit``: the grid's rule; a cell with a final record in ``store`` stays), and the one line it ends with
    where that leaves a side of each kind nothing to run; any other search as it is (a crossover probe that runs out
    of memory ends its bisection with the reason)."""
    from .best import BestPlan

    if not isinstance(search, BestPlan) or (gpu_memory is None and host_memory is None):
        return search, None
    from .plan import FIT_MARGIN, plan_rows, why_refused
    from .sweep import Cell, Sweep, cell_id, cell_label

    cells = [Cell(spec, cell_id(spec), cell_label(spec)) for spec in search.specs()]
    sweep = Sweep(name=store.sweep_name, grids=[], fixed={}, samples=search.samples, cells=cells)
    rows = plan_rows(sweep, store, cpu_here=cpu_here)
    unfit = {row["cell_id"]: why_refused(row, gpu_memory, host_memory)
             for row in _not_fitting(sweep, rows, gpu_memory, host_memory)}
    fitted = search.without(unfit, gpu_memory, FIT_MARGIN)
    return fitted, fitted.refusal()


def cmd_sweep(args: argparse.Namespace) -> int:
    from .embedded_ray import RayStartError
    from .lock import SweepLocked, lock_problem
    from .runner import MAX_FAILURES, SweepInputError, resources_note, run_sweep
    from .store import StorageFull, Store, missing_bucket, storage_problem
    from .sweep import SweepError, load_sweep, shown

    _quiet_ray_logs(args.verbose)
    try:
        sweep = load_sweep(args.file)
    except SweepError as exc:
        return _fail(str(exc))
    if args.max_concurrent is not None and args.max_concurrent < 1:
        return _fail("--max-concurrent: must be a positive integer")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        return _fail(f"--gpu-memory: must be a positive finite number of GiB, got {args.gpu_memory}")
    if args.out and (why := storage_problem(args.out)):
        return _fail(f"--out: {why}")
    storage = args.out or sweep.storage or DEFAULT_OUT
    if why := lock_problem(storage) or missing_bucket(storage):
        return _fail(f"{'--out' if args.out else 'storage'}: {why}")
    console = _console()
    if args.dry_run:
        from trials.record.fields import FINAL_STATUSES

        from .tables import print_table
        from .plan import (config_defaults, cpu_matmul_flops_per_s, expected_ooms, guessed, plan_rows, plan_table,
                           slow_on_cpu, unsupported_here, why_refused, will_not_fit)

        gpu_memory = _gpu_memory(args)
        host_memory, cpu_here = _here(args)
        rows = plan_rows(sweep, Store(storage, sweep.name), unsupported_here(sweep), cpu_here=cpu_here)
        if rows:
            print_table(console, plan_table(sweep, rows, gpu_memory, host_memory))
        for row in rows:
            if row["unsupported"]:
                console.print(f"[cyan]unsupported here[/] {row['label']}: {row['unsupported']} (it is recorded "
                              "as unsupported with this reason)", soft_wrap=True)
        for line in config_defaults(sweep):
            console.print(f"[yellow]config defaults[/] {line}", soft_wrap=True)
        for line in guessed(rows):
            console.print(f"[yellow]a guess[/] {line}", soft_wrap=True)
        refused = will_not_fit(rows, gpu_memory, host_memory) if args.fit_check else []
        refused_ids = {row["cell_id"] for row in refused}
        for row in refused:
            console.print(f"[red]will not fit[/] {why_refused(row, gpu_memory, host_memory)}, so a real sweep refuses "
                          "it (--no-fit-check runs it anyway)", soft_wrap=True)
        for line in expected_ooms([row for row in rows if row["cell_id"] not in refused_ids], gpu_memory, host_memory):
            console.print(f"[yellow]expected OOM[/] {line}", soft_wrap=True)
        if line := _ranks_here(args, sweep, rows):
            console.print(f"[red]refused[/] {line}: a real sweep refuses it before any trial starts", soft_wrap=True)
        if any(row["on_cpu"] and not row["unsupported"] for row in rows):
            for line in slow_on_cpu(rows, cpu_matmul_flops_per_s()):
                console.print(f"[yellow]slow on CPU[/] {line}", soft_wrap=True)
        for asked, why in sweep.skipped:
            console.print(f"[cyan]skipped[/] {shown(asked)}: {why}", soft_wrap=True)
        for asked, why in sweep.collapsed:
            console.print(f"[dim]collapsed[/] {shown(asked)}: {why}", soft_wrap=True)
        for given, why in sweep.not_applied:
            console.print(Text.assemble(("not applied", "dim"), f" {given}: {why}"), soft_wrap=True)
        if sweep.search is not None:
            plan, line = _fitted(sweep.search, gpu_memory, host_memory, cpu_here, Store(storage, sweep.name)) \
                if args.fit_check else (sweep.search, None)
            console.print(plan.summary(), soft_wrap=True)
            if line:
                console.print(f"[red]will not fit[/] {line}", soft_wrap=True)
        total = len(sweep.cells) * sweep.samples
        done = sum(1 for row in rows for status in row["records"] if status in FINAL_STATUSES)
        console.print(f"{total} trials{' in the grid' if sweep.search else ''}: {done} have a final record, "
                      f"{total - done} would run now; results go to {Store(storage, sweep.name).url()}", soft_wrap=True)
        return 0
    from .progress import SweepProgress, reasons_below, summary_table
    from .tables import print_table

    gpu_memory = _gpu_memory(args) if args.fit_check else None
    host_memory, cpu_here = _here(args) if args.fit_check else (None, False)
    if gpu_memory is not None or host_memory is not None:  # before Ray or any trial: a cell that will not fit
        from .plan import plan_rows

        try:
            rows = plan_rows(sweep, Store(storage, sweep.name), cpu_here=cpu_here, restart=args.restart,
                             only_to_run=True)
            line = _fit_refusal(sweep, rows, gpu_memory, host_memory)
        except Exception as exc:  # noqa: BLE001 - a plan that fails never stops a sweep: its trials say what fits
            logging.getLogger(__name__).warning("memory plan failed, cells not checked: %s: %s", type(exc).__name__, exc)
            line = None
        if line:
            return _fail(line)
    if sweep.search is not None and args.fit_check:  # the search runs no cell the memory plan refuses
        try:
            sweep.search, line = _fitted(sweep.search, gpu_memory, host_memory, cpu_here, Store(storage, sweep.name))
        except Exception as exc:  # noqa: BLE001 - as the grid's: a plan that fails never stops a sweep
            logging.getLogger(__name__).warning("memory plan failed, search cells not checked: %s: %s",
                                                type(exc).__name__, exc)
            line = None
        if line:
            return _fail(line)
    for asked, why in sweep.skipped:
        console.print(f"[cyan]skipped[/] {shown(asked)}: {why}", soft_wrap=True)
    try:
        outcome = run_sweep(sweep, storage, address=args.address, restart=args.restart,
                            max_concurrent=args.max_concurrent, verbose=args.verbose, dashboard=args.dashboard,
                            progress=None if args.no_progress else SweepProgress(), launcher=args.launcher)
    except (SweepInputError, SweepLocked) as exc:
        return _fail(str(exc))
    except RayStartError as exc:  # not the user's input: the machine's; one line, with Ray's own reason
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except StorageFull as exc:  # one line; what was written stays, and the same command resumes
        store = Store(storage, sweep.name)
        done = len(store.final_keys()) if store.exists() else 0
        print(f"{PROG}: error: storage: {exc}; {done} of {len(sweep.cells) * sweep.samples} trials have intact "
              "records; free space and rerun the same command to resume", file=sys.stderr)
        return 1
    from .efficiency import describe, run_efficiency

    store = Store(storage, sweep.name)
    records = summary_records(store)
    print_table(console, summary_table(outcome.items, outcome.statuses, records))
    for line in reasons_below(outcome.items, outcome.statuses, records):
        console.print(Text(line), soft_wrap=True)  # an error's text, never markup
    from .plan import config_defaults

    for line in config_defaults(sweep):  # the sizes nobody set, beside what the sweep set
        console.print(f"[yellow]config defaults[/] {line}", soft_wrap=True)
    console.print(f"{outcome.total} trials: {outcome.already_done} already done, {outcome.ran} run now, "
                  f"{len(outcome.failed)} failed, {len(outcome.missing)} missing"
                  + (" (interrupted)" if outcome.interrupted else "")
                  + f"; driver wall {outcome.wall_s:.1f}s (Ray's start included)", soft_wrap=True)
    if note := resources_note(sweep.resources, outcome.resources):
        console.print(note, soft_wrap=True)
    if outcome.ran and args.address is None:  # trials ran here: their start is this Python's (trials/runtime/bytecode.py)
        from trials.runtime.bytecode import advice

        if slow := advice():
            console.print(f"[yellow]slow start[/] {slow}", soft_wrap=True)
    if outcome.ran:
        eff = run_efficiency(records.to_pandas())
        this_run = eff[eff["run_id"] == outcome.run_id]
        if not this_run.empty:
            console.print(describe(this_run.iloc[0]))
    console.print(f"results: {outcome.results_path}")
    report = None
    if store.record_files():
        try:
            from .report import answer, build_report

            report = None if args.no_report else build_report(  # on object storage: written there too
                store.url(), out_html=store.path("report.html") if store.local else None, sweep_text=sweep.source_text)
            if outcome.search is not None and report is None:  # the report's headline leads with it
                console.print(f"[bold]{outcome.search.title}: {outcome.search.statement}[/]", soft_wrap=True)
            for line in report.headline if report else answer(store.url()):
                console.print(f"[bold]{line}[/]", soft_wrap=True)
            if report:
                console.print(f"report:  {report.html_path}")
        except Exception as exc:  # noqa: BLE001 - a failing report must not hide a finished sweep
            logging.getLogger(__name__).error("report failed: %s", exc)
    for key in outcome.failed:
        console.print(f"[red]failed[/] {key}: {outcome.statuses[key]} (see {store.url('logs', key + '.log')})")
    labels = {it.key: it.label for it in outcome.items}
    for key in outcome.missing:
        why = "not run: the sweep was interrupted" if outcome.interrupted else \
            f"no record: its worker died {MAX_FAILURES + 1} times"
        console.print(f"[red]missing[/] {labels.get(key, key)} ({key}): {why}; rerun the same command to resume",
                      soft_wrap=True)
    return 0 if outcome.complete else 1


# -- collect / report / doctor ------------------------------------------------------------------
def _sweep_dir(path: str) -> tuple[str, str] | None:
    p = Path(path).expanduser().resolve()
    if not (p / "trials").is_dir():
        return None
    return str(p.parent), p.name


def cmd_collect(args: argparse.Namespace) -> int:
    from .store import Store, is_uri, storage_problem

    if why := storage_problem(args.dir):
        return _fail(f"DIR: {why}")
    if is_uri(args.dir):  # an object store's sweep prefix
        store = Store.at(args.dir)
        if not store.exists("trials"):
            return _fail(f"DIR: {args.dir} is not a sweep directory (it has no trials/ folder)")
        path, rows = store.collect()
        print(f"{rows} records -> {path}")
        return 0
    if not Path(args.dir).expanduser().exists():
        return _fail(f"DIR: {args.dir} does not exist")
    where = _sweep_dir(args.dir)
    if where is None:
        return _fail(f"DIR: {args.dir} is not a sweep directory (it has no trials/ folder)")
    path, rows = Store(*where).collect()
    print(f"{rows} records -> {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import ReportInputError, build_report
    from .store import storage_problem

    for flag, where in (("DIR", args.dir), ("--compare", args.compare)):
        if where and (why := storage_problem(where)):
            return _fail(f"{flag}: {why}")
    if args.png and Path(args.png).exists() and not Path(args.png).is_dir():
        return _fail(f"--png: {args.png} is a file; give a directory (one PNG per chart is written into it)")
    if args.plotlyjs and not args.plotlyjs.endswith(".js"):
        return _fail(f"--plotlyjs: must name a .js file, got {args.plotlyjs!r}")
    if args.png:
        from .report.render import browser_problem

        if why := browser_problem():
            return _fail(f"--png: {why}")
    try:
        report = build_report(args.dir, out_html=args.out, png_dir=args.png, compare_dir=args.compare,
                              plotlyjs=args.plotlyjs)
    except ReportInputError as exc:
        return _fail(str(exc))
    for warning in report.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    for line in report.headline:
        print(line)
    print(f"report: {report.html_path}")
    for extra in report.other_paths:
        print(f"        {extra}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from trials.runtime.noise import quiet_third_party

    quiet_third_party()
    from trials.backends.capability import probe
    from trials.measure.fingerprint import fingerprint
    from trials.measure.metrics import peak_tflops
    from trials.measure.nvml import power_and_clocks

    cap = probe("auto", want_te=True, want_torchao=True)
    info = {"capability": cap.as_dict(), "fingerprint": fingerprint(cap.device_type), "power": power_and_clocks()}
    info["peaks_tflops"] = {p: peak_tflops(cap.gpu_name, p) for p in ("bf16", "fp8", "fp32")}
    from trials.runtime.bytecode import advice

    info["bytecode"] = advice()
    from importlib import metadata

    try:
        info["ray_version"] = metadata.version("ray")  # not ``import ray``: a local Ray is configured before that
    except metadata.PackageNotFoundError:
        info["ray_version"] = "not installed"
    if args.ray:
        from .embedded_ray import RayStartError
        from .runner import SweepInputError, ray_session

        try:
            with ray_session(args.address) as r:
                info["cluster_resources"] = r.cluster_resources()
                info["nodes"] = [n["NodeManagerAddress"] for n in r.nodes() if n.get("Alive")]
        except SweepInputError as exc:
            return _fail(str(exc))
        except RayStartError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for line in doctor_lines(info):
        print(line)
    return 0


def doctor_lines(info: dict) -> list[str]:
    """``juicytalk doctor``'s text: what is known, in words (``--json`` has every field, nulls included)."""
    c, fp, pw = info["capability"], info["fingerprint"], info["power"]
    if c["device_type"] == "cuda":
        device = (f"cuda  {c['gpu_name']}  compute capability {c['compute_capability']}  {c['sm_count']} SMs  "
                  f"CUDA {c['cuda_version']}")
    else:
        device = "cpu (no CUDA device visible)"
    lines = [f"device        {device}",
             f"torch         {fp['torch_version']}" + (f"   driver {fp['driver_version']}" if fp["driver_version"] else ""),
             f"TE            {c['te_version'] if c['te_available'] else 'unavailable: ' + str(c['te_error'])}",
             f"torchao       {c['torchao_version'] or 'unavailable: ' + str(c['torchao_error'])}"]
    from trials.backends import recipe_owner

    for recipe, v in c["fp8"].items():
        lines.append(f"fp8 {recipe_owner(recipe):7} {recipe:18} {'yes' if v['supported'] else 'no '}  {v['reason']}".rstrip())
    lines.append("power         " + (f"limit {pw['power_limit_w']:g} W, SM clock {pw['sm_clock_mhz']} of "
                                     f"{pw['sm_clock_max_mhz']} MHz now" if pw["why"] is None else f"unknown: {pw['why']}"))
    peaks = info["peaks_tflops"]
    known = ", ".join(f"{p} {v:g}" for p, v in peaks.items() if v is not None)
    lines.append(f"peaks         {known} TFLOP/s (dense datasheet; JUICYTALK_PEAK_TFLOPS overrides)" if known else
                 "peaks         unknown for this device (MFU is left out; JUICYTALK_PEAK_TFLOPS gives them)")
    lines.append(f"ray           {info['ray_version']}")
    lines.append(f"bytecode      {info['bytecode'] or 'present or writable for torch and TE: no process compiles them'}")
    if "cluster_resources" in info:
        resources = "  ".join(f"{k}={v:g}" for k, v in sorted(info["cluster_resources"].items())
                              if not k.startswith("node:") and isinstance(v, (int, float)))
        lines.append(f"cluster       {resources}  nodes {', '.join(info['nodes'])}")
    return lines


def cmd_export(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        return _fail("--mlflow: needs the mlflow package: pip install 'juicytalk[mlflow]'")
    from .trackers import mlflow_uri

    if why := mlflow_uri.problem(args.mlflow):
        return _fail(f"--mlflow: {why}")
    if not Path(args.results).exists():
        return _fail(f"RESULTS: {args.results} does not exist (a sweep directory or a results.parquet)")
    if why := mlflow_uri.unreachable(args.mlflow):
        return _fail(f"--mlflow: {why}")
    from .export import export_mlflow

    done = export_mlflow(args.results, args.mlflow, args.experiment)
    print(f"{done.created} MLflow runs created, {done.already} already there (experiment {done.experiment}, "
          f"{args.mlflow})")
    return 0


def cmd_fields(args: argparse.Namespace) -> int:
    from trials.record.fields import field_table

    print(field_table(), end="")
    return 0


# -- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from trials.cli import OneLineParser, add_trial_arguments

    from .launchers import DEFAULT_LAUNCHER, LAUNCHERS

    parser = OneLineParser(prog=PROG, description="Does FP8 pay off for my model size on this GPU?")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trial", help="run one trial here (no Ray)")
    add_trial_arguments(p)
    p.add_argument("--no-fit-check", dest="fit_check", action="store_false",
                   help="run it though the memory plan says it will not fit this GPU or this host's RAM")

    p = sub.add_parser("sweep", help="run a sweep file through Ray Tune")
    p.add_argument("file")
    p.add_argument("--out", help=f"storage root: a directory or a pyarrow URI (default: the file's storage, "
                                 f"else {DEFAULT_OUT})")
    p.add_argument("--address", help="Ray cluster address (auto, ray://host:10001); default RAY_ADDRESS, "
                                     "else a local embedded Ray")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="GPU memory to check the estimates against (default: this machine's GPU where Ray runs "
                        "here); a cell over it by more than the plan's error is refused")
    p.add_argument("--no-fit-check", dest="fit_check", action="store_false",
                   help="run cells the memory plan says will not fit (the dry run then says only 'expected OOM')")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="run only trials without a final record (default)")
    mode.add_argument("--restart", action="store_true", help="move earlier results aside and start over")
    p.add_argument("--max-concurrent", type=int, metavar="N",
                   help="run at most N trials at once (default: the file's max_concurrent, else as resources allow)")
    p.add_argument("--launcher", choices=list(LAUNCHERS),
                   help=f"how trials run on a worker (default: the file's launcher, else {DEFAULT_LAUNCHER})")
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (local Ray only)")
    p.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    p.add_argument("--no-progress", action="store_true", help="no live view")
    p.add_argument("-v", "--verbose", action="store_true", help="Ray's own output too")

    p = sub.add_parser("collect", help="consolidate a sweep's trial records into results.parquet")
    p.add_argument("dir", help="the sweep directory (<out>/<sweep name>)")

    p = sub.add_parser("report", help="HTML (+PNG, markdown, CSV) report of a sweep's results")
    p.add_argument("dir", help="sweep directory or results.parquet")
    p.add_argument("--out", help="HTML file (default DIR/report.html)")
    p.add_argument("--png", help="also write one PNG per chart into this directory")
    p.add_argument("--compare", help="a second sweep directory to compare against")
    p.add_argument("--plotlyjs", help="load plotly.js from this .js path, relative to the HTML file, writing it "
                                      "there if absent (for published reports that share one copy); default: embed")

    p = sub.add_parser("export", help="records already on disk -> MLflow, one run per record (idempotent)")
    p.add_argument("results", help="sweep directory or results.parquet")
    p.add_argument("--mlflow", required=True, metavar="URI", help="MLflow tracking URI (sqlite:///path/mlflow.db, http://host:5000, file:/path)")
    p.add_argument("--experiment", help="experiment name (default: the records' sweep name)")

    sub.add_parser("fields", help="the record's fields as a markdown table (docs/guide/record-fields.md's)")

    p = sub.add_parser("doctor", help="what this machine (and Ray cluster) can run")
    p.add_argument("--ray", action="store_true", help="also start/connect Ray and show cluster resources")
    p.add_argument("--address", help="with --ray: the cluster to connect to (default RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", action="store_true", help="everything as one JSON object (unknowns as null)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "trial":
            from trials.cli import run_from_args

            return run_from_args(args, f"{PROG} trial", _trial_fit if args.fit_check else None)
        return {"sweep": cmd_sweep, "collect": cmd_collect, "report": cmd_report, "doctor": cmd_doctor,
                "fields": cmd_fields, "export": cmd_export}[args.command](args)
    except KeyboardInterrupt:  # a sweep's Ctrl-C once its trials run ends in its summary instead
        print(f"{PROG}: interrupted" + ("; what the sweep started is stopped, its records stay, and the same command "
                                        "resumes it" if args.command == "sweep" else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
