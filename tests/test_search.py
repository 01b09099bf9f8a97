"""The crossover search: the bisection on a crossover it is given, its budget, reuse and resume, bad
blocks refused in one line, and one real search through Ray Tune's searcher API on CPU."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from orchestrator.crossover import Bisection, Outcome
from orchestrator.search import Search
from orchestrator.store import Store
from orchestrator.sweep import SweepError, cell_id, parse_sweep
from orchestrator.work import WorkItem
from trials.record.fields import FINAL_STATUSES, empty_record

from .conftest import juicytalk

SEARCH = """
    name: cross
    search:
      find: crossover
      variant: {backend: te, precision: fp8, recipe: delayed}
      baseline: {backend: te, precision: bf16}
      target: 1.10
      over: {d_model: [512, 8192], step: 256}
      fixed: {n_layers: 4, cuda_graphs: true}
      max_trials: %d
    samples: 2
"""
JITTER = (1.0, 1.01, 0.99, 1.02)


def plan(max_trials: int = 40):
    return parse_sweep(textwrap.dedent(SEARCH % max_trials), source="s.yaml").search


def speedup(x: int) -> float:
    """A crossover the search is given: FP8 is 0.8x at 512 and gains 0.1x per doubling of d_model."""
    return 0.8 + 0.1 * math.log2(x / 512)


def run(bisection: Bisection, f=speedup, launch_bound=lambda side, x: False) -> tuple[object, int]:
    """Feed the bisection what it asks for until it answers; returns (answer, trials run)."""
    ran = 0
    while True:
        d = bisection.decide()
        if d.answer is not None:
            return d.answer, ran
        for side, x, sample in d.need:
            ms = 10.0 * JITTER[sample % 4] * (1.0 if side == "baseline" else 1.0 / f(x))
            bisection.observe(side, x, sample, Outcome("ok", ms, wall_s=3.0, gpu_name="NVIDIA H200",
                                                       launch_bound=launch_bound(side, x)))
            ran += 1


def dense_grid(p, f=speedup) -> tuple[int, int]:
    """What a dense grid over the same range says: (the first point shown above the target, its trials)."""
    b, first, trials = Bisection(p), None, 0
    for x in p.points:
        n = p.samples
        while True:
            for side in ("baseline", "variant"):
                for s in range(n):
                    if (side, x, s) not in b.seen:
                        ms = 10.0 * JITTER[s % 4] * (1.0 if side == "baseline" else 1.0 / f(x))
                        b.observe(side, x, s, Outcome("ok", ms))
                        trials += 1
            probe = b.probe(x, n)
            if probe.verdict != "straddle" or n == p.max_samples:
                break
            n += 1
        if first is None and probe.verdict == "above":
            first = x
    return first, trials


def test_the_bisection_finds_the_crossover_a_dense_grid_finds_in_a_fraction_of_its_trials():
    p = plan(max_trials=60)
    answer, ran = run(Bisection(p))
    first, dense = dense_grid(p)
    assert answer.found and answer.bracket[1] - answer.bracket[0] == 256
    assert abs(answer.crossover - first) <= 256, (answer.crossover, first)
    assert ran <= 0.4 * dense and answer.trials == ran, (ran, dense)
    probed = {pr.x for pr in answer.probes}
    assert p.points[0] not in probed and p.points[-1] not in probed  # a crossover inside needs neither end
    assert "te-fp8-delayed beats te-bf16 by >= 1.10x from d_model" in answer.statement
    assert "on NVIDIA H200" in answer.statement and f"{ran} trials" in answer.statement


@pytest.mark.parametrize("f, found, says", [
    (lambda x: 2.0, True, "from d_model 512 (the start of the range)"),
    (lambda x: 0.5, False, "never beats te-bf16 by >= 1.10x for d_model in [512, 8192]"),
])
def test_a_crossover_at_either_end_of_the_range_probes_that_end(f, found, says):
    p = plan(max_trials=60)
    answer, _ = run(Bisection(p), f=f)
    end = p.points[0] if found else p.points[-1]
    assert answer.found == found and says in answer.statement and end in {pr.x for pr in answer.probes}


def test_the_search_stops_at_max_trials_and_says_so():
    answer, ran = run(Bisection(plan(max_trials=8)))
    assert not answer.found and ran <= 8 and "max_trials=8" in answer.statement


@pytest.mark.parametrize("f", [speedup, lambda x: 2.0, lambda x: 0.5, lambda x: 1.10],
                         ids=["inside", "at-start", "never", "straddles-everywhere"])
def test_the_default_budget_never_ends_a_search_before_its_answer(f):
    """Without max_trials, the budget is what the bisection can need (its longest path of probes, both cells,
    max_samples each): small-sample intervals are wide, so probes take more samples than two."""
    default = parse_sweep(textwrap.dedent(SEARCH.replace("      max_trials: %d\n", "")), source="s.yaml").search
    answer, ran = run(Bisection(default), f=f)
    assert "max_trials" not in answer.statement and ran <= default.max_trials, answer.statement


def test_records_already_there_are_reused_and_an_interrupted_search_resumes():
    p = plan()
    done = Bisection(p)
    full, ran_full = run(done)
    half = Bisection(p)  # half of those records on disk: from an earlier grid, or a run that was interrupted
    for i, (key, outcome) in enumerate(sorted(done.seen.items())):
        if i % 2 == 0:
            half.observe(*key, outcome)
    resumed, ran_now = run(half)
    assert resumed.crossover == full.crossover and ran_now < ran_full and resumed.trials == full.trials


def test_a_point_whose_interval_straddles_the_target_gets_more_samples():
    p = plan(max_trials=80)  # every probe straddles: 8 probes up the range to its top, 4 samples of 2 cells each
    answer, _ = run(Bisection(p), f=lambda x: 1.10)  # exactly the target everywhere: never shown above it
    assert not answer.found and "never beats" in answer.statement
    top = next(pr for pr in answer.probes if pr.x == p.points[-1])
    assert top.samples == p.max_samples and "straddles" in top.why


def test_an_answer_whose_bracket_was_launch_bound_says_so():
    """Eager steps of small models are the host's time: the answer carries that, for the bracket's ends only."""
    p = plan(max_trials=60)
    clean, _ = run(Bisection(p))
    lo, hi = clean.bracket
    answer, _ = run(Bisection(p), launch_bound=lambda side, x: x <= hi and side == "variant")
    assert answer.bracket == clean.bracket and f"launch-bound at d_model {lo} and {hi}:" in answer.statement
    assert "launch-bound" not in clean.statement
    assert [pr.x for pr in answer.probes if pr.launch_bound] == [pr.x for pr in answer.probes if pr.x <= hi]


def test_an_unsupported_cell_ends_the_search_with_its_reason():
    b = Bisection(plan())
    x = b.decide().need[0][1]  # the first point it probes
    for s in range(2):
        b.observe("baseline", x, s, Outcome("ok", 10.0))
        b.observe("variant", x, s, Outcome("unsupported", None, error="fp8 recipe delayed: needs cc 8.9"))
    answer = b.decide().answer
    assert not answer.found and f"d_model={x}" in answer.statement and "unsupported" in answer.statement


def write(store: Store, search: Search, trial: tuple[str, int, int], status: str, run_id: str, **fields) -> None:
    """The record a trial of the search would leave: ``trial`` is (side, x, sample)."""
    item = search.item(*trial)
    store.write_record({**empty_record(), "cell_id": item.cell_id, "sample": item.sample, "status": status,
                        "run_id": run_id, **fields})


def test_a_trial_an_earlier_run_left_unfinished_runs_again_and_one_of_this_run_ends_the_search(tmp_path):
    """A timeout or error record has no final status: a rerun runs that trial again, as a grid does; within
    the run that saw it, the failure is the probe's and the answer says so."""
    assert {"timeout", "error"}.isdisjoint(FINAL_STATUSES)
    p, store = plan(), Store(str(tmp_path), "cross")
    store.ensure()
    first = Search(p, store)
    need = first.decide().need
    for trial in need:  # the variant's trials time out, the baseline's run
        write(store, first, trial, "ok" if trial[0] == "baseline" else "timeout", "run-1", step_ms_p50=10.0,
              error="" if trial[0] == "baseline" else "killed after 1800 s")
        first.observe_trial(*trial)
    x = need[0][1]
    assert first.finished and f"cannot probe d_model={x}: the variant cell is timeout" in first.answer().statement

    again = Search(p, store)  # the same command, run again
    assert not again.finished and sorted(again.decide().need) == sorted(t for t in need if t[0] == "variant")
    for trial in again.decide().need:  # the grid of this run wrote them, failed again: read back, they count
        write(store, again, trial, "error", "run-2", error="RuntimeError: boom")
    again.refresh()
    assert again.finished and f"cannot probe d_model={x}: the variant cell is error" in again.answer().statement


def test_an_fp8_cell_that_ran_no_fp8_is_no_probe_and_the_answer_says_why(tmp_path):
    """torchao converts no Linear at a width that is no multiple of 16: the cell runs ok, in BF16; its time is
    no FP8 time, however fast."""
    p, store = plan(), Store(str(tmp_path), "cross")
    search = Search(p, store)
    need = search.decide().need
    x = need[0][1]
    rows = [{"cell_id": search.item(*t).cell_id, "sample": t[2], "status": "ok", "step_ms_p50": 10.0 if t[0] ==
             "baseline" else 5.0, "effective_precision": "bf16", "trial_wall_s": 3.0, "error": None,
             "gpu_name": None, "launch_bound": False} for t in need]
    search.observe_records(rows)
    answer = search.answer()
    assert answer.done and not answer.found, answer.statement
    assert f"cannot probe d_model={x}: the variant cell ran bf16, not the fp8 asked" in answer.statement
    ran_fp8 = Search(p, store)  # the same records with FP8 run: a probe (2x, above the target)
    ran_fp8.observe_records([{**r, "effective_precision": "fp8" if r["step_ms_p50"] == 5.0 else "bf16"}
                             for r in rows])
    assert not ran_fp8.finished and next(pr for pr in ran_fp8.decide().probes.values()).verdict == "above"


def test_search_cells_are_grid_cells():
    p = plan()
    grid = parse_sweep(textwrap.dedent("""
        name: g
        grid: {d_model: [1024], backend: [te], precision: [fp8], recipe: [delayed]}
        fixed: {n_layers: 4, cuda_graphs: true}
    """))
    assert WorkItem.of(p.spec("variant", 1024), 1).cell_id == grid.cells[0].cell_id == cell_id(grid.cells[0].spec)
    item = WorkItem.of(p.spec("variant", 1024), 1)
    assert WorkItem.from_config(item.config()) == item  # what a worker rebuilds from a searcher's config


def test_a_field_of_the_sweeps_fixed_that_a_side_drops_leaves_it_the_grids_cell():
    """fixed: {recipe: current} beside a grid and a search: the grid drops recipe from its bf16 cells, and the
    search's bf16 baseline must be those very cells (same ids), or its records are not reused and every
    baseline trial runs twice."""
    both = parse_sweep(textwrap.dedent("""
        name: gs
        fixed: {recipe: current, n_layers: 2}
        grid: {d_model: [256, 512], backend: [te], precision: [bf16, fp8]}
        search:
          find: crossover
          variant: {backend: te, precision: fp8}
          baseline: {backend: te, precision: bf16}
          target: 1.1
          over: {d_model: [256, 512], step: 256}
    """))
    grid_ids = {c.cell_id for c in both.cells}
    probes = {WorkItem.of(both.search.spec(side, x), 0).cell_id for side in ("variant", "baseline")
              for x in both.search.points}
    assert probes == grid_ids, (probes - grid_ids, grid_ids - probes)


COMPILED = "variant: {backend: torch, compile: true}\n  baseline: {backend: torch}"


@pytest.mark.parametrize("block, key, line", [
    ("search: {find: fastest, variant: {}, baseline: {}, target: 1.1, over: {d_model: [64, 128]}}", "search.find", 2),
    ("search:\n  find: crossover\n  variant: {backend: te}\n  baseline: {backend: te}\n  target: 1.1\n"
     "  over: {seq_len: [64, 128]}", "search.over.seq_len", 7),
    ("search:\n  find: crossover\n  variant: {precision: fp8, colour: red}\n  baseline: {}\n  target: 1.1\n"
     "  over: {d_model: [64, 128]}", "search.variant.colour", 4),
    ("search:\n  find: crossover\n  variant: {precision: fp8}\n  baseline: {}\n  target: 1.1\n"
     "  over: {d_model: [520, 1032], step: 256}", "search.over", 7),  # 520 is no multiple of 16 for fp8
    ("search:\n  find: crossover\n  variant: {}\n  baseline: {}\n  target: 1.1\n  over: {d_model: [128, 64]}",
     "search.over.d_model", 7),
    ("search:\n  find: crossover\n  variant: {}\n  baseline: {}\n  over: {d_model: [64, 128]}", "search.target", 2),
    # the same cell on both sides: written alike, or alike once the defaults are in
    ("search:\n  find: crossover\n  variant: {backend: torch}\n  baseline: {backend: torch}\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}", "search.variant", 4),
    ("search:\n  find: crossover\n  variant: {precision: bf16}\n  baseline: {}\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}", "search.variant", 4),
    # the searched axis fixed for the whole sweep, not only in search.fixed
    ("fixed: {d_model: 768}\nsearch:\n  find: crossover\n  " + COMPILED + "\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}", "fixed.d_model", 2),
    ("search:\n  find: crossover\n  " + COMPILED + "\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}\n  fixed: {d_model: 768}", "search.fixed.d_model", 8),
    # a bad cell names the key written that makes it bad: the sweep's fixed, search.fixed
    ("fixed: {seq_len: 4}\nsearch:\n  find: crossover\n  " + COMPILED + "\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}", "fixed.seq_len", 2),
    # ... where the cell drops another written field (compile on te): it is no suspect
    ("fixed: {seq_len: 4, compile: true}\nsearch:\n  find: crossover\n  variant: {backend: te, precision: fp8}\n"
     "  baseline: {backend: te}\n  target: 1.1\n  over: {d_model: [256, 512], step: 256}", "fixed.seq_len", 2),
    ("search:\n  find: crossover\n  " + COMPILED + "\n  target: 1.1\n"
     "  over: {d_model: [256, 512], step: 256}\n  fixed: {seq_len: 4}", "search.fixed.seq_len", 8),
])
def test_bad_search_blocks_name_key_and_line(block, key, line):
    with pytest.raises(SweepError) as exc:
        parse_sweep("name: s\n" + block + "\n", source="s.yaml")
    assert exc.value.key == key and exc.value.line == line, str(exc.value)


@pytest.mark.slow
def test_a_real_search_on_cpu_writes_grid_records_answers_and_resumes(tmp_path, ray_cluster):
    """Through Ray Tune's Searcher API on the test cluster: the twin in fp32 against bf16 on CPU."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text(textwrap.dedent("""
        name: cpu-search
        search:
          find: crossover
          variant: {precision: fp32}
          baseline: {precision: bf16}
          target: 1.0
          over: {d_model: [32, 64], step: 32}
          max_trials: 8
        fixed: {backend: torch, device: cpu, n_layers: 1, seq_len: 16, batch_size: 2, train_steps: 2,
                warmup_steps: 1, bench_steps: 3, gen_len: 2, prompt_len: 2, profile: false}
        samples: 2
        resources: {cpu: 1, gpu: 0}
        max_concurrent: 1
    """))  # one Tune worker and trial process, not one per node (a sweep's second costs ~6 CPU-s)
    out = tmp_path / "out"
    first = juicytalk("sweep", str(sweep), "--out", str(out), "--no-progress", "--no-report", "--address", ray_cluster)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    answer = json.loads((out / "cpu-search" / "search.json").read_text())
    assert answer["done"] and 4 <= answer["trials"] <= 8
    assert f"search: {answer['statement']}" in " ".join(first.stdout.split())  # found or not: timing decides
    records = list((out / "cpu-search" / "trials").glob("*.parquet"))
    assert len(records) == answer["trials"]
    again = juicytalk("sweep", str(sweep), "--out", str(out), "--no-progress", "--address", ray_cluster)
    assert again.returncode == 0 and f"{answer['trials']} already done, 0 run now" in " ".join(again.stdout.split())
    assert " ".join(again.stdout.split()).count(answer["statement"]) == 1  # the report's headline says it, once
    md = Path(out / "cpu-search" / "results.md").read_text()
    assert "## Crossover search" in md and answer["statement"] in md
    # A cell that cannot run here (no CUDA device) ends the search with its reason, not a crash.
    sweep.write_text(sweep.read_text().replace("name: cpu-search", "name: cpu-cuda").replace(
        "variant: {precision: fp32}", "variant: {precision: fp32, device: cuda}"))
    cannot = juicytalk("sweep", str(sweep), "--out", str(out), "--no-progress", "--no-report", "--address", ray_cluster)
    said = " ".join(cannot.stdout.split())
    assert cannot.returncode == 0 and "search: cannot probe d_model=" in said and "unsupported" in said, said[-3000:]
