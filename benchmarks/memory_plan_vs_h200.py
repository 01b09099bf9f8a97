"""The memory plan (trials/measure/memory_plan.py) against the peaks the published H200 runs measured.

Every ``ok`` training record under docs/results/h200 (one per cell and run) is turned back into its spec and
planned on this machine (no GPU needed: the plan runs the module under fake tensors); the measured peak is
``peak_mem_allocated_bytes - mem_at_start_bytes``. Prints estimate/measured per stack, precision and
``compile``, then the cells furthest from 1. Records of unit-graphed cells that measured their graphs' pool
(``graph_pool_bytes``) are planned graphed and listed apart: the planned pool against the measured one, and the
planned peak against the peak held (the allocator's, plus ``graph_pool_free_bytes`` where the record has it).
Older graphed records (MiniGPT's whole-forward graphs, without the pool's bytes) are planned as their eager twin, as
they always were here. Usage:
    python benchmarks/memory_plan_vs_h200.py [RESULTS_DIR]
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pandas as pd

from orchestrator.report.render import held_peak
from trials.measure import memory_plan
from trials.spec import TrialSpec


def spec_of(record: pd.Series, graphed: bool = False) -> TrialSpec:
    names = {f.name for f in dataclasses.fields(TrialSpec)} - {"tokens_per_step"} - (set() if graphed else {"cuda_graphs"})
    kw = {k: (v.item() if hasattr(v, "item") else v) for k, v in record.items()
          if k in names and v is not None and not (isinstance(v, float) and pd.isna(v))}
    # an int field's column with a null in it reads back as floats (ac_every 2.0, which the spec refuses)
    ints = {f.name for f in dataclasses.fields(TrialSpec) if str(f.type).split(" |")[0] == "int"}
    kw.update({k: int(v) for k, v in kw.items() if k in ints and isinstance(v, float)}, device="cuda")
    return TrialSpec(**kw)


def main(root: Path) -> None:
    logging.disable(logging.WARNING)
    frames = []
    for path in sorted(root.glob("**/results.parquet")):
        df = pd.read_parquet(path)
        df = df[(df["status"] == "ok") & df["peak_mem_allocated_bytes"].notna()]
        if "workload" in df:
            df = df[df["workload"] == "train"]
        frames.append(df.assign(run=path.parent.name).drop_duplicates("cell_id"))
    rows, pools = [], []
    records = pd.concat(frames)
    for (_, rec), held in zip(records.iterrows(), held_peak(records)):
        start = rec.get("mem_at_start_bytes")
        held -= 0 if start is None or pd.isna(start) else start
        pool = rec.get("graph_pool_bytes")
        if bool(rec.get("cuda_graphs")) and pool is not None and not pd.isna(pool):
            pools.append(graphed_row(rec, held))
            continue
        plan = memory_plan.plan(spec_of(rec))
        measured = held  # no graphs' pool: the allocator's peak
        rows.append({"run": rec["run"], "model": rec.get("model") or "minigpt", "arch": rec.get("arch"),
                     "backend": rec["backend"], "precision": rec["precision"], "compile": bool(rec.get("compile")),
                     "d_model": rec["d_model"], "n_layers": rec["n_layers"], "seq_len": rec["seq_len"],
                     "est_gib": plan.total / 2**30, "measured_gib": measured / 2**30, "ratio": plan.total / measured})
    res = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    print(f"{len(res)} training records; estimate / measured peak:")
    print(res.groupby(["backend", "precision", "compile"])["ratio"].describe()[["count", "min", "50%", "max"]]
          .round(3).to_string())
    within = (res["ratio"] - 1).abs() <= 0.15
    print(f"within 15%: {within.sum()} of {len(res)}")
    print(res.loc[~within].round(3).to_string(index=False))
    if pools:
        print(f"\n{len(pools)} graphed training records; planned / measured pool and peak (held: the allocator's peak "
              "and, where recorded, the pool's free bytes):")
        print(pd.DataFrame(pools).round(3).to_string(index=False))


def graphed_row(rec: pd.Series, held: float) -> dict:
    """A graphed record's plan against it: the pool, and the peak against ``held`` (its peak since start, the pool's
    free bytes included: orchestrator/report/render.py ``held_peak``)."""
    plan = memory_plan.plan(spec_of(rec, graphed=True))
    free = rec.get("graph_pool_free_bytes")
    return {"run": rec["run"], "cell": rec["cell_label"], "pool_est_gib": plan.graph_pool / 2**30,
            "pool_gib": rec["graph_pool_bytes"] / 2**30, "pool_ratio": plan.graph_pool / rec["graph_pool_bytes"],
            "est_gib": plan.total / 2**30, "held_gib": held / 2**30,
            "free_recorded": free is not None and not pd.isna(free), "ratio": plan.total / held}


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs/results/h200")
