"""The best-against-best search (orchestrator/best.py): on a recorded grid it answers the grid's best; it finds it
for a fraction of the grid's trials; a cell that runs out of memory is a probe; a rerun resumes; bad blocks and a
space where nothing fits are one line, exit 2, before Ray; and examples/fp8-pays-cpu.yaml end to end in a new
user's shell, with its report's "Best against best" sections."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from orchestrator.best import FULL, SCREENED, Halving
from orchestrator.crossover import Outcome
from orchestrator.search import Search
from orchestrator.store import Store
from orchestrator.sweep import SweepError, parse_sweep
from trials.record.fields import empty_record

from .conftest import REPO, juicytalk, user_env

# Llama-shaped MiniGPT cells on a GPU: te FP8 against the torch twin's BF16, every default axis (te: micro-batch,
# checkpointing, te_layer, graphs; torch: micro-batch, checkpointing, compile, graphs)
SEARCH = """
    name: best
    search:
      find: best
      sides:
        - {backend: te, precision: fp8, recipe: delayed}
        - {backend: torch, precision: bf16}
      global_batch: 2048
      %s
    fixed: {arch: llama, d_model: 1024, n_layers: 4, seq_len: 256}
    samples: 3
"""
JITTER = (1.0, 1.02, 0.98, 1.01, 0.99)


def plan(extra: str = ""):
    return parse_sweep(textwrap.dedent(SEARCH % extra), source="s.yaml").search


def step_ms(spec) -> float | None:
    """A step time the search is given, with the interactions that decide the real ones: a small micro-batch is
    launch-bound (graphs and compile pay there most), checkpointing recomputes, 8 rows without it run out of memory,
    FP8 is faster at large micro-batches only. None: out of memory."""
    b, ac = spec.batch_size, spec.activation_checkpointing
    if b == 8 and ac == "none":
        return None
    ms = 100.0 * (1 + 1.5 / b) * {"none": 1.0, "selective": 1.12, "full": 1.3}[ac]
    if spec.cuda_graphs:
        ms *= 1 - 0.3 / b
    if spec.compile:
        ms *= 0.9 - 0.05 / b
    if spec.precision == "fp8":
        ms *= 0.75 + 0.2 / b
    if spec.te_layer == "modules":
        ms *= 1.04
    return ms


def outcome(p, trial: tuple) -> Outcome:
    """What the trial ``trial`` (side, cell, phase, sample) records: screens a little faster and noisier."""
    s, i, phase, k = trial
    ms = step_ms(p.sides[s].cells[i].spec)
    if ms is None:
        return Outcome("oom", None, wall_s=2.0, error="CUDA out of memory")
    screen = phase == SCREENED
    return Outcome("ok", ms * (0.97 if screen else 1.0) * JITTER[(k + 2 * i + (1 if screen else 0)) % 5],
                   wall_s=2.0 if screen else 10.0, gpu_name="NVIDIA H100")


def grid_best(p) -> dict[int, str]:
    """Each side's best setting by the grid: every cell, ``samples`` full samples, the lowest median."""
    out = {}
    for s, side in enumerate(p.sides):
        medians = {}
        for i, cell in enumerate(side.cells):
            got = [outcome(p, (s, i, FULL, k)) for k in range(p.samples)]
            if all(o.status == "ok" for o in got):
                medians[cell.text] = sorted(o.ms for o in got)[len(got) // 2]
        out[s] = min(medians, key=medians.get)
    return out


def run(state: Halving) -> tuple[object, int]:
    ran = 0
    while (decision := state.decide()).answer is None:
        for trial in decision.need:
            state.observe(*trial, outcome(state.plan, trial))
            ran += 1
    return decision.answer, ran


def test_the_search_finds_each_sides_grid_best_for_a_fraction_of_the_grid():
    p = plan()
    answer, ran = run(Halving(p))
    best = grid_best(p)
    assert [side.winner.setting for side in answer.sides] == [best[0], best[1]], answer.statement
    grid_trials = sum(len(side.cells) for side in p.sides) * p.samples
    assert answer.grid_trials == grid_trials and ran == answer.trials < grid_trials / 2
    assert answer.gpu_seconds < 0.35 * grid_trials * 10.0  # screens at 2 s, full trials at 10 s
    assert answer.found and answer.candidate == "te-fp8-delayed" and answer.reference == "torch-bf16"
    assert answer.statement.startswith("at 2048 tokens per optimizer step, te-fp8-delayed ")
    te = answer.sides[0]
    assert te.does_not_fit == 4 and te.screened == len(p.sides[0].cells)  # 8 rows without checkpointing: oom
    assert "batch_size=8 grad_accum=1 activation_checkpointing=none" not in {c.setting for c in te.timed}


def test_a_recorded_grid_is_the_answer_and_a_rerun_resumes_without_new_trials(tmp_path):
    """Records a grid left (every cell, ``samples`` each, the sweep's schedule) count: the search on them answers
    the grid's best and asks for nothing; a search run half way and run again asks only for the rest."""
    p = plan("over: {batch_size: [2, 4, 8], activation_checkpointing: [none, full]}")
    grid = Store(str(tmp_path), "grid")
    grid.ensure()
    search = Search(p, grid)
    for where in p.wheres():
        if where[2] == FULL:
            for k in range(p.samples):
                write(grid, search, (*where, k))
    found = Search(p, grid)
    assert found.finished and found.decide().need == [] and not found.items()[len(found.state.seen):]
    assert [side.winner.setting for side in found.answer().sides] == list(grid_best(p).values())

    store = Store(str(tmp_path), "resume")
    store.ensure()
    first = Search(p, store)
    while (need := first.decide().need) and len(first.state.seen) < 12:  # interrupted after 12 trials
        for trial in need[:12 - len(first.state.seen)]:
            write(store, first, trial)
            first.observe_trial(*trial)
    assert not first.finished and not first.answer().done
    again = Search(p, store)
    assert len(again.state.seen) == 12 and not set(again.decide().need) & set(again.state.seen)
    while need := again.decide().need:
        for trial in need:
            write(store, again, trial)
            again.observe_trial(*trial)
    done = Search(p, store)
    assert done.finished and done.decide().need == [] and done.answer().statement == again.answer().statement


def test_a_searchs_report_reads_its_full_timings_and_says_why_each_winner_is_fast(tmp_path):
    """The published replay records (examples/fp8-pays-replay.yaml: real CPU trials, screens and full timings, many
    cells of one label) as a finished search's store: the report's FP8-against-BF16 pairs read the settings timed in
    full on both sides (a screen is a shorter schedule, there to rank), and its "why" table holds each side's
    winner, found by cell id."""
    import pyarrow.parquet as pq

    from orchestrator.report import build_report
    from orchestrator.sweep import load_sweep

    sweep = load_sweep(str(REPO / "examples" / "fp8-pays-replay.yaml"))
    store = Store(str(tmp_path), sweep.name)
    store.ensure()
    for record in pq.read_table(REPO / "docs" / "results" / "cpu" / "fp8-pays-replay" / "results.parquet").to_pylist():
        store.write_record(record)
    found = Search(sweep.search, store).answer()
    assert found.done and all(side.winner for side in found.sides), found.statement
    (tmp_path / sweep.name / "search.json").write_text(found.to_json())
    report = build_report(str(tmp_path / sweep.name))
    both = {c.setting for c in found.sides[0].timed} & {c.setting for c in found.sides[1].timed}
    assert len(report.pairs.rows) == len(both), report.pairs.rows[["candidate", "reference", "series"]]
    why = Path(report.md_path).read_text().split("## Best against best: why")[1].split("\n## ")[0]
    assert all(f"| {side.label} " in why for side in found.sides), why


def write(store: Store, search: Search, trial: tuple) -> None:
    item, got = search.item(*trial), outcome(search.plan, trial)
    store.write_record({**empty_record(), "cell_id": item.cell_id, "sample": item.sample, "status": got.status,
                        "step_ms_p50": got.ms, "trial_wall_s": got.wall_s, "run_id": "r", "error": got.error or None})


def test_a_screen_that_hides_the_winner_gets_it_timed_in_full():
    """With one finalist a side, screens that mislead (each cell's full time off its screen by a different factor)
    put the winner out of the contest; the spread of the timed cells' full/screen ratios promotes it back."""
    p = plan("over: {batch_size: [1, 2, 4, 8]}\n      finalists: 2")
    off = {1: 1.0, 2: 1.25, 4: 0.8}  # batch_size -> full time over screen: 4 is fastest in full, not by its screen

    def given(trial):
        s, i, phase, k = trial
        spec = p.sides[s].cells[i].spec
        screen = 100.0 * {1: 1.0, 2: 0.9, 4: 1.05, 8: 2.0}[spec.batch_size]
        ms = screen * (1.0 if phase == SCREENED else off.get(spec.batch_size, 1.0)) * JITTER[k % 5]
        return Outcome("ok", ms, 1.0)

    state = Halving(p)
    while (decision := state.decide()).answer is None:
        for trial in decision.need:
            state.observe(*trial, given(trial))
    assert all(side.winner.values["batch_size"] == 4 for side in decision.answer.sides), decision.answer.statement


@pytest.mark.parametrize("block, key, says", [
    ("sides: [{backend: te, precision: fp8}, {backend: te, precision: bf16}]\n  global_batch: 2048\n"
     "  over: {compile: [false, true]}", "search.over.compile", "no side can vary it"),
    ("sides: [{backend: te, precision: fp8}, {backend: torch}]\n  global_batch: 2000", "search.global_batch",
     "multiple of seq_len x world_size = 256"),
    ("sides: [{backend: te, precision: fp8}, {}]\n  global_batch: 2048", "search.sides.1", "is empty"),
    ("sides: [{backend: te, precision: fp8}, {backend: torch}]\n  global_batch: 2048\n  over: {batch_size: [3]}",
     "search.over.batch_size", "does not divide the global batch's 8 rows"),
    ("sides: [{backend: te, precision: fp8, device: cpu}, {backend: torch}]\n  global_batch: 2048",
     "search.sides.0.device", "needs a CUDA device"),
    ("sides: [{backend: torch, precision: bf16}, {backend: te, precision: bf16}]\n  global_batch: 2048",
     "search.sides", "every side that runs here is bf16"),
    ("sides: [{backend: torch}, {backend: torch, precision: bf16}, {backend: te, precision: fp8}]\n"
     "  global_batch: 2048", "search.sides.1", "runs cells of side torch-bf16 too"),
    ("sides: [{backend: torch, seq_len: 512}, {backend: te, precision: fp8}]\n  global_batch: 2048",
     "search.sides.0.seq_len", "set it under fixed"),
    ("sides: [{backend: torch}, {backend: te, precision: fp8}]\n  global_batch: 2048\n  fixed: {batch_size: 4}",
     "search.fixed.batch_size", "is set by search.global_batch"),
    ("sides: [{backend: torch}, {backend: te, precision: fp8}]\n  global_batch: 2048\n"
     "  over: {activation_checkpointing: [none, partial]}", "search.over.activation_checkpointing", "partial"),
    ("sides: [{backend: torch}, {backend: te, precision: fp8}]", "search.global_batch", "required"),
])
def test_bad_best_blocks_are_one_line_naming_the_key(block, key, says):
    with pytest.raises(SweepError) as exc:
        parse_sweep(f"name: b\nfixed: {{n_layers: 2}}\nsearch:\n  find: best\n  {block}\n", source="s.yaml")
    assert exc.value.key == key and says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_space_where_nothing_fits_is_one_line_exit_2_before_ray(tmp_path):
    """device cuda: GPU cells, held against --gpu-memory on any machine. Nothing is started: no store is made."""
    sweep = tmp_path / "b.yaml"
    sweep.write_text(textwrap.dedent(SEARCH % "over: {batch_size: [4, 8]}").replace("seq_len: 256", "seq_len: 256, "
                                                                                      "device: cuda"))
    out = tmp_path / "out"
    run = juicytalk("sweep", str(sweep), "--out", str(out), "--gpu-memory", "0.001")
    err = run.stderr.strip()
    assert run.returncode == 2 and len(err.splitlines()) == 1 and not out.exists(), run.stderr[-2000:]
    assert "search.sides: nothing of te-fp8-delayed fits: all 2 of its cells will not fit" in err, err
    assert "over 1.4x the memory" in err, err


def test_a_side_recorded_unsupported_here_is_not_held_to_the_hosts_ram(tmp_path):
    """On a machine without a GPU the TE side's cells are recorded unsupported and never allocate, so only the torch
    side, which runs on CPU, is held to the host's RAM (as a grid's cells are)."""
    import torch

    from orchestrator.cli import _fitted
    from orchestrator.plan import host_memory_bytes

    if torch.cuda.is_available():
        pytest.skip("the TE side runs where a GPU is")
    search = parse_sweep(textwrap.dedent(SEARCH % "over: {batch_size: [4, 8]}").replace(
        "d_model: 1024, n_layers: 4", "d_model: 65536, n_layers: 8"), source="s.yaml").search
    _, line = _fitted(search, None, host_memory_bytes(), True, Store(str(tmp_path), "best"))
    assert line is not None and "nothing of torch-bf16 fits" in line and "te-fp8-delayed" not in line, line


@pytest.mark.slow
def test_the_gpu_examples_dry_run_in_a_new_users_shell(tmp_path):
    """examples/fp8-pays.yaml's dry run as its header and the guide give it: what it would search, all of it held to
    an 80 GiB GPU (device cuda) and fitting."""
    dry = juicytalk("sweep", "examples/fp8-pays.yaml", "--dry-run", "--gpu-memory", "80", "--out", str(tmp_path / "o"),
                    env=user_env(tmp_path / "home"))
    said = " ".join(dry.stdout.split())
    assert dry.returncode == 0 and "te-fp8-delayed (32 cells), torchao-fp8-tensorwise (32 cells), torch-bf16 (32 " \
        "cells) at 2048 tokens per optimizer step" in said and "will not fit" not in said, said[-2000:]


@pytest.mark.slow
def test_the_cpu_example_answers_and_reports_in_a_new_users_shell(tmp_path):
    """examples/fp8-pays-cpu.yaml through a local embedded Ray, as the guide runs it: search.json done, every probe a
    record, the report's sections (the winners' kernel breakdowns side by side). (That the same command again runs
    nothing is the runner's for any search: test_search.py's real search; a best search's resume:
    test_a_recorded_grid_is_the_answer_and_a_rerun_resumes_without_new_trials.)"""
    shell = user_env(tmp_path / "home")
    out = tmp_path / "out"
    first = juicytalk("sweep", "examples/fp8-pays-cpu.yaml", "--out", str(out), "--no-progress", env=shell,
                      timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    root = out / "fp8-pays-cpu"
    answer = json.loads((root / "search.json").read_text())
    assert answer["find"] == "best" and answer["done"] and answer["found"], answer["statement"]
    assert len(list((root / "trials").glob("*.parquet"))) == answer["trials"]
    assert {s["label"] for s in answer["sides"]} == {"torchao-fp8-tensorwise", "torch-bf16"}
    said = " ".join(first.stdout.split())
    assert f"Best against best: {answer['statement']}" in said
    md = (root / "results.md").read_text()
    for section in ("## Best against best", "## Best against best: every setting timed in full",
                    "## Best against best: why"):
        assert section in md
