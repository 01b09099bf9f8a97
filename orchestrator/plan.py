"""Dry-run plan: every cell with its size, a memory estimate, and what already has a record.

The estimate is checked against the memory of where a cell runs: the GPU's, per rank (this machine's, or
``--gpu-memory``), for a cell that may run on a GPU; and, where Ray runs here, this host's RAM, which every
rank of a cell shares: the whole plan of each rank of a cell that runs on CPU here (``device: cpu``, or
``auto`` on a machine without a GPU), what stays on the host of one on a GPU. CPU cells whose steps would
take hours even at the host's best matmul pace are flagged too. A training cell over the GPU's memory by more
than the plan's own error (``FIT_MARGIN``), or over the host's RAM, will not fit: a real sweep and
``juicytalk trial`` refuse it before Ray or any trial starts (``--no-fit-check`` runs it anyway).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.table import Table

from trials.measure import memory_plan
from trials import models
from trials.spec import TrialSpec

from .store import Store, trial_key
from .sweep import Sweep


CPU_SLOW_S = 3600.0  # a CPU cell whose steps need longer than this, at the host's best matmul pace, is flagged
# A real sweep refuses a GPU training cell whose estimate is over FIT_MARGIN x the GPU's memory: the plan's
# estimate/measured on the 434 published H200 training records ran 0.70-1.35 (docs/guide/memory.md,
# benchmarks/memory_plan_vs_h200.py), so past 1.4x the cell is over even where the plan overestimates most.
# Between 1x and 1.4x the dry run says "expected OOM" and the cell runs (it may fit; its record says oom if not).
FIT_MARGIN = 1.4
# and one whose ranks' estimate is over the host's RAM: past it the kernel's OOM killer, not the trial, stops the
# cell (a 782.8 GiB estimate on a 24 GB CPU host: killed at 23.8 GB, no record), and may take other processes
# with it; on CPU the plan's activations are exact (docs/guide/memory.md) and nothing it counts runs high
HOST_FIT_MARGIN = 1.0


def unsupported_here(sweep: Sweep) -> dict[str, str]:
    """cell id -> why the cell would be recorded ``unsupported`` on this machine (what a trial here would
    resolve: the same probe and rules, ``trials.backends.capability``). A cluster's GPU nodes may differ."""
    from trials.backends.capability import probe, resolve, wants_torchao

    want_te = any(cell.spec.backend in ("te", "auto") for cell in sweep.cells)
    want_torchao = any(wants_torchao(cell.spec) for cell in sweep.cells)
    caps: dict[str, Any] = {}
    out = {}
    for cell in sweep.cells:
        if cell.spec.device not in caps:  # one probe per requested device
            caps[cell.spec.device] = probe(cell.spec.device, want_te, want_torchao)
        reason = resolve(cell.spec, caps[cell.spec.device]).unsupported
        if reason:
            out[cell.cell_id] = reason
    return out


def estimate_flops_guess(spec: TrialSpec) -> tuple[float, bool]:
    """(model FLOPs of a training trial's steps, training and timed, all ranks: what a CPU cell must get
    through; whether that is a guess). Inference cells: the same steps' forward passes, training's third.
    MiniGPT: its closed form. Any other model: the GEMMs FlopCounterMode counts in one forward of the module
    the source builds (under fake tensors, at the cell's batch and seq), times 3 for forward and backward,
    plus causal attention by MiniGPT's formula over the model's units; where the module cannot run under
    fake tensors, 6 x parameters per token (a guess)."""
    from trials.measure.metrics import flops_per_step  # imports torch: only where a cell is planned

    facts = models.describe(spec)
    steps = spec.train_steps + spec.bench_steps * spec.repeats
    tokens = spec.tokens
    got = None if facts.analytic is not None else memory_plan.probe(spec)
    guess = False
    if facts.analytic is not None:
        per_step = flops_per_step(facts.analytic, tokens)
    elif got is not None:
        attention = 6.0 * len(got.activations.units) * spec.seq_len * (facts.attn_width or 0) * tokens
        per_step = 3.0 * got.forward_flops * spec.micro_batches + attention  # the probe ran one micro-batch
    else:
        per_step, guess = 6.0 * (facts.n_params or 0) * tokens, True
    flops = per_step * steps
    return (flops if spec.workload == "train" else flops / 3), guess


def plan_rows(sweep: Sweep, store: Store, unsupported: dict[str, str] | None = None,
              cpu_here: bool = False, restart: bool = False, only_to_run: bool = False) -> list[dict[str, Any]]:
    """One row per cell; ``cpu_here``: this machine has no GPU, so its ``device: auto`` cells run on CPU. The store
    is read as it is, before any lock on it: an unreadable record is moved aside by the run that holds the lock.
    ``restart``: the records do not count (every trial runs again). ``only_to_run``: the rows of cells with a trial
    still to run alone, what a sweep's fit check reads: a finished sweep run again plans nothing (and imports no
    torch in its driver)."""
    statuses = {} if restart else store.statuses(quarantine=False)
    unsupported = unsupported or {}
    rows = []
    for cell in sweep.cells:
        records = [s for s in (statuses.get(trial_key(cell.cell_id, i)) for i in range(sweep.samples)) if s]
        if only_to_run and not runs_left(records, sweep.samples):
            continue
        rows.append(plan_row(cell.spec, cell.label, cell.cell_id, cpu_here, records, sweep.samples,
                             unsupported.get(cell.cell_id)))
    return rows


def plan_row(spec: TrialSpec, label: str, cell_id: str, cpu_here: bool, records: list[str] | None = None,
             samples: int = 1, unsupported: str | None = None) -> dict[str, Any]:
    """One cell's row (``plan_rows``'; ``juicytalk trial``'s one): ``est_mem_bytes`` is one rank's plan,
    ``est_host_bytes`` what all its ranks keep on the host they share."""
    mem = memory_plan.plan(spec)
    flops, flops_guess = estimate_flops_guess(spec)
    on_cpu = spec.device == "cpu" or (cpu_here and spec.device == "auto")
    return {
        "label": label, "cell_id": cell_id, "spec": spec,
        "params": models.describe(spec).n_params,
        "est_mem_bytes": mem.total, "mem_guess": mem.guess,
        "est_host_bytes": spec.world_size * (mem.total if on_cpu else memory_plan.host_kept_bytes(spec)),
        "guess_why": memory_plan.unplanned(spec) if mem.guess else None,
        "est_flops": flops, "flops_guess": flops_guess,
        "on_cpu": on_cpu,
        "records": list(records or []), "samples": samples,
        "unsupported": unsupported,
    }


def host_memory_bytes() -> int | None:
    """This host's RAM (what a CPU cell's estimate is checked against), or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def cpu_matmul_flops_per_s(n: int = 1024, tries: int = 3) -> float:
    """The host's fp32 matmul pace, best of ``tries`` (a trial's steps reach a fraction of it: a best case)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-9)


def local_gpu_memory_bytes() -> int | None:
    """Memory of this machine's first GPU (CUDA_VISIBLE_DEVICES' first, as torch's device 0), or None without
    one or without NVML (then the plan cannot say what fits). Read through NVML, never torch.cuda: a CUDA
    context in the driver would sit on GPU 0 through the sweep, a foreign compute process that marks every
    trial there disturbed (trials/measure/disturbance.py).

    NVML's total is the board's memory; CUDA's (torch's ``total_memory``, a record's ``gpu_total_memory_bytes``)
    is smaller by what the driver keeps for itself (the two differed on the H200; typically a few hundred MiB,
    under 1%). The fit check uses NVML's as it is: that difference is far inside the memory plan's own error,
    which its 1.4x refusal margin (FIT_MARGIN) and its 1x "expected OOM" line are there to absorb."""
    from trials.measure import nvml

    with nvml.session() as nv:
        if nv is None:
            return None
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        try:
            return int(nv.nvmlDeviceGetMemoryInfo(nvml.handle(nv, first or "0")).total)
        except Exception:  # noqa: BLE001 - no device visible (CUDA_VISIBLE_DEVICES empty or -1), an odd token
            return None


def _over(row: dict[str, Any], gpu_memory_bytes: int | None, host_memory_bytes: int | None,
          refused: bool = False) -> list[tuple[str, int]]:
    """(where, its memory) for each memory ``row``'s estimate is over: the GPU's, one rank's plan against it, for
    a cell that may run on a GPU; the host's, its ranks' together; ``refused``: over by the margin a real run is
    refused at (``FIT_MARGIN``, ``HOST_FIT_MARGIN``), else by anything. Unknown memory is not checked."""
    out = []
    spec = row.get("spec")
    if gpu_memory_bytes and (spec is None or spec.device != "cpu") and \
            row["est_mem_bytes"] > (FIT_MARGIN if refused else 1.0) * gpu_memory_bytes:
        out.append(("GPU", gpu_memory_bytes))
    never_here = row.get("on_cpu") and row.get("unsupported")  # recorded unsupported here: it allocates nothing
    if host_memory_bytes and not never_here and \
            row.get("est_host_bytes", 0) > (HOST_FIT_MARGIN if refused else 1.0) * host_memory_bytes:
        out.append(("host", host_memory_bytes))
    return out


def plan_table(sweep: Sweep, rows: list[dict[str, Any]], gpu_memory_bytes: int | None = None,
               host_memory_bytes: int | None = None) -> Table:
    """The dry-run table of ``plan_rows``; cells whose estimate exceeds the memory where they run (the GPU's,
    or the host's for CPU cells) say 'OOM?'."""
    gib = 2**30
    sizes = [f"GPU memory {gpu_memory_bytes / gib:.0f} GiB"] if gpu_memory_bytes else []
    if host_memory_bytes and any(r.get("on_cpu") for r in rows):
        sizes.append(f"host memory {host_memory_bytes / gib:.0f} GiB")
    where = f" ({', '.join(sizes)})" if sizes else ""
    table = Table(title=f"sweep {sweep.name}: {len(sweep.cells)} cells x {sweep.samples} sample(s){where}")
    table.add_column("cell", no_wrap=True)  # labels stay whole (and greppable); the other columns wrap
    table.add_column("id", no_wrap=True)
    for col in ("params", "est. memory", "records", "here"):
        table.add_column(col)
    for row in rows:
        rec = ", ".join(row["records"]) if row["records"] else "-"
        memory = f"{row['est_mem_bytes'] / gib:.2f} GiB" + (" (guess)" if row.get("mem_guess") else "")
        if _over(row, gpu_memory_bytes, host_memory_bytes):
            memory += " OOM?"
        params = "?" if row["params"] is None else f"{row['params'] / 1e6:.1f}M"
        table.add_row(row["label"], row["cell_id"], params, memory,
                      f"{len(row['records'])}/{row['samples']} ({rec})",
                      "unsupported" if row["unsupported"] else "runs")
    return table


def config_defaults(sweep: Sweep) -> list[str]:
    """One line per model and shape of the sweep whose size values came from transformers' config defaults (a bare
    ``hf:llama`` keeps Llama-2-7B's 11008-wide MLP at any d_model): what the sweep set, beside those defaults."""
    out: dict[str, None] = {}
    for cell in sweep.cells:
        if not cell.spec.source.config_defaults:
            continue
        facts = models.describe(cell.spec)
        if facts.defaults:
            from trials.models.hf import SHAPE_NAMES  # the shape fields a transformers model takes

            given = " ".join(f"{f}={getattr(cell.spec, f)}" for f in SHAPE_NAMES if getattr(cell.spec, f) is not None)
            built = f"; as built: {facts.moe_layers}" if facts.moe_layers else ""  # expert counts need not be used
            out[f"{cell.spec.model}: the sweep set {given or 'no shape field'}; transformers' defaults: "
                f"{' '.join(f'{k}={v}' for k, v in facts.defaults.items())}{built}"] = None
    return list(out)


def guessed(rows: list[dict[str, Any]]) -> list[str]:
    """One line per ``plan_rows`` cell whose memory plan is a guess: why its module does not run under fake
    tensors, and what the estimates then count."""
    return [f"{row['label']}: memory and CPU time estimated from the parameter count (weights, optimizer state, "
            f"the loss; 6 x parameters per token): its module does not run under fake tensors ({row['guess_why']})"
            for row in rows if row.get("mem_guess")]


def oom_line(row: dict[str, Any], limit: int, where: str | None = None) -> str:
    """``row``'s estimate against ``limit``, the memory ``where`` it runs ("GPU" or "host"; default: the host's
    for a cell on CPU, else the GPU's); a GPU training cell's line names the cheapest setting that would fit
    (trials/measure/memory_plan.py: checkpointing first, then FSDP2 ranks)."""
    spec = row.get("spec")
    where = where or ("host" if row.get("on_cpu") else "GPU")
    if where == "host":
        ranks = spec.world_size if spec is not None else 1
        each = row.get("est_host_bytes", row["est_mem_bytes"]) / ranks / 2**30
        kept = "" if row.get("on_cpu") else " kept on the host"
        est = f"{ranks} ranks x {each:.1f} GiB{kept} (they share the host)" if ranks > 1 else f"{each:.1f} GiB{kept}"
        return f"{row['label']}: estimated {est} > {limit / 2**30:.0f} GiB of host memory"
    line = f"{row['label']}: estimated {row['est_mem_bytes'] / 2**30:.1f} GiB > {limit / 2**30:.0f} GiB of GPU memory"
    if spec is not None and spec.workload == "train" and not row.get("mem_guess"):
        fit = memory_plan.cheapest_fit(spec, limit)
        line += (f"; fits with {fit.setting()} ({fit.total / 2**30:.1f} GiB per GPU)" if fit else
                 f"; does not fit even with activation_checkpointing full on up to {memory_plan.FIT_RANKS[-1]} "
                 "FSDP2 ranks sharing its global batch")
    return line


def expected_ooms(rows: list[dict[str, Any]], gpu_memory_bytes: int | None,
                  host_memory_bytes: int | None = None) -> list[str]:
    """One ``oom_line`` per ``plan_rows`` cell and memory its estimate exceeds (``_over``): the GPU's, the host's
    (it still runs, and records oom if it does)."""
    return [oom_line(row, limit, where) for row in rows for where, limit in _over(row, gpu_memory_bytes, host_memory_bytes)]


def runs_left(records: list[str], samples: int) -> bool:
    """A cell whose trials' statuses are ``records`` has a trial still to run: fewer final records than the
    sweep's samples."""
    from trials.record.fields import FINAL_STATUSES

    return sum(1 for status in records if status in FINAL_STATUSES) < samples


def to_run(row: dict[str, Any]) -> bool:
    """A ``plan_rows`` cell with a trial still to run."""
    return runs_left(row["records"], row["samples"])


def will_not_fit(rows: list[dict[str, Any]], gpu_memory_bytes: int | None,
                 host_memory_bytes: int | None = None) -> list[dict[str, Any]]:
    """The ``plan_rows`` a real sweep (and ``juicytalk trial``) refuses: training cells, planned from their module
    (not a guess), with a trial still to run, whose estimate is over ``FIT_MARGIN`` x the GPU's memory or over
    the host's RAM (``HOST_FIT_MARGIN``), all the ranks on it together (``_over``). Memory not known is not
    checked: a GPU with no GPU here and no ``--gpu-memory``, a host where Ray does not run here; nor is the host's
    for a cell on CPU that is ``unsupported`` here (recorded so, never run: a TE cell on a machine without a GPU),
    while ``--gpu-memory`` still holds it to the GPU it names."""
    return [row for row in rows
            if not row.get("mem_guess") and row["spec"].workload == "train" and to_run(row)
            and _over(row, gpu_memory_bytes, host_memory_bytes, refused=True)]


def why_refused(row: dict[str, Any], gpu_memory_bytes: int | None, host_memory_bytes: int | None = None) -> str:
    """A ``will_not_fit`` row's ``oom_line`` and why it will not fit."""
    where, limit = _over(row, gpu_memory_bytes, host_memory_bytes, refused=True)[0]
    why = (f"over {FIT_MARGIN}x the memory, more than the memory plan's error" if where == "GPU" else
           "more than the host's RAM, where the kernel's OOM killer, not the trial, would stop it (maybe other "
           "processes too)")
    return f"{oom_line(row, limit, where)}: {why}"


def refusal(rows: list[dict[str, Any]], gpu_memory_bytes: int | None, host_memory_bytes: int | None = None
            ) -> str | None:
    """The one line a real sweep exits with when ``will_not_fit`` names a cell: its ``oom_line``, why it is
    refused, how to run it anyway, and how many more there are; None when every cell may fit."""
    over = will_not_fit(rows, gpu_memory_bytes, host_memory_bytes)
    if not over:
        return None
    more = f"; {len(over) - 1} more cell(s) will not fit (--dry-run lists them)" if len(over) > 1 else ""
    return (f"{why_refused(over[0], gpu_memory_bytes, host_memory_bytes)}, so nothing was started{more}; "
            f"--no-fit-check runs {'them' if more else 'it'} anyway")


def slow_on_cpu(rows: list[dict[str, Any]], flops_per_s: float) -> list[str]:
    """One line per CPU cell whose steps need more than ``CPU_SLOW_S`` at ``flops_per_s`` (the host's best
    matmul pace: the trial itself is slower still)."""
    out = []
    for row in rows:
        seconds = row["est_flops"] / flops_per_s
        if row.get("on_cpu") and not row.get("unsupported") and seconds > CPU_SLOW_S:
            guess = " (a guess: 6 x parameters per token; the module does not run under fake tensors)" \
                if row.get("flops_guess") else ""
            out.append(f"{row['label']}: at least {seconds / 3600:.1f} h on this CPU ({row['est_flops'] / 1e12:.0f} "
                       f"TFLOP of steps at its best matmul pace, {flops_per_s / 1e9:.0f} GFLOP/s){guess}; a GPU runs "
                       "it, or make the cell smaller")
    return out
