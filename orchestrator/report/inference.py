"""The report's inference section: FP8 against TE BF16 for prefill and KV-cached decode, weight memory
and token agreement (teacher-forced; greedy as a secondary measure), from ``workload: infer`` records
(training analyses never see them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from .analysis import (DECODE_STEP, PREFILL, SHAPE_KEYS, TEACHER_FORCED_NOTE, Pairs, _interval, against_fastest_bf16,
                       noise_side, pair_cells, shape_key, shape_keys, teacher_forced_columns, varying_keys)

# What DECODE_STEP times: one decode step, which yields a token for each row of the batch (at batch 32, 32 tokens):
# a time per step, not per token.
DECODE_MS = "ms/decode step"


@dataclass
class InferencePairs:
    decode: Pairs  # ratio = BF16 ms per decode step / FP8's (> 1: FP8 decodes faster)
    prefill: Pairs


def split(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(training records, inference records)."""
    infer = df["workload"] == "infer"
    return df[~infer], df[infer]


def inference_pairs(infer: pd.DataFrame) -> InferencePairs | None:
    """FP8-vs-BF16 pairs by decode and by prefill time; None without inference records."""
    if infer.empty:
        return None
    return InferencePairs(pair_cells(infer, DECODE_STEP), pair_cells(infer, PREFILL))


def _cells(infer: pd.DataFrame) -> pd.DataFrame:
    keys = ["cell_label", "variant", "d_model", "n_layers", "batch_size", "cuda_graphs",
            *[k for k in varying_keys(infer) if k != "batch_size"]]
    g = infer[infer["status"] == "ok"].groupby(keys, dropna=False, sort=True)
    cells = g.agg(samples=("status", "size"), decode_tok_s=("decode_tokens_per_s", "median"),
                  decode_ms=("decode_ms_per_token_p50", "median"), prefill_ms=("prefill_ms_p50", "median"),
                  prefill_tok_s=("prefill_tokens_per_s", "median"), weight_gib=("weight_bytes", "median"),
                  kv_mib=("kv_cache_bytes", "median"), peak_gib=("peak_decode_mem_bytes", "max"),
                  rows=("decode_rows", "max"), match=("gen_match_rate", "median"),
                  stride=("gen_stride_accuracy", "median"), ref_stride=("ref_stride_accuracy", "median"))
    cells = cells.reset_index()
    cells["weight_gib"] /= 2**30
    cells["kv_mib"] /= 2**20
    cells["peak_gib"] /= 2**30
    return cells


def _key(values: Any, variant: str) -> tuple:
    """A cell's identity across tables: its shape fields and its variant."""
    return shape_key(values) + (variant,)


def inference_sections(infer: pd.DataFrame, pairs: InferencePairs | None) -> list[tuple[str, str, pd.DataFrame]]:
    if infer.empty or pairs is None:
        return []
    cells = _cells(infer)
    sections = []
    dec = pairs.decode.rows
    if not dec.empty:
        dec = dec[dec["kind"] == "fp8_speedup"]
        pre = pairs.prefill.rows
        prefill = ({_key(r, r["candidate"]): r for r in pre[pre["kind"] == "fp8_speedup"].to_dict("records")}
                   if not pre.empty else {})
        ok = infer[infer["status"] == "ok"]
        per_cell = {_key(dict(zip(SHAPE_KEYS, shape)), variant): g
                    for (shape, variant), g in ok.groupby([shape_keys(ok), "variant"])}
        # the fastest BF16 decode of the same shape, batch and graph mode, whatever its stack
        fastest_rows, _ = against_fastest_bf16(infer, DECODE_STEP, same_execution=True)
        fastest = {_key(r, r["variant"]): r for r in fastest_rows.to_dict("records")}
        rows, findings = [], []
        for r in dec.to_dict("records"):
            p = prefill.get(_key(r, r["candidate"]))
            f = fastest[_key(r, r["candidate"])]
            cand, ref = per_cell[_key(r, r["candidate"])], per_cell[_key(r, r["reference"])]
            rows.append({"d_model": r["d_model"], "n_layers": r["n_layers"], "batch": r["batch_size"],
                         "graphs": r["cuda_graphs"], "FP8 variant": r["candidate"], "BF16 partner": r["reference"],
                         f"BF16 {DECODE_MS}": r["reference_ms"], f"FP8 {DECODE_MS}": r["candidate_ms"],
                         "decode speedup": r["ratio"], "CI low": r["ci_low"], "CI high": r["ci_high"],
                         "CI over": r["ci_method"], "fastest BF16": f["fastest BF16"],
                         f"fastest BF16 {DECODE_MS}": f["BF16 ms"],
                         "vs fastest BF16": f["ratio"], "fastest CI low": f["ci_low"], "fastest CI high": f["ci_high"],
                         "prefill speedup": None if p is None else p["ratio"],
                         "prefill CI low": None if p is None else p["ci_low"],
                         "prefill CI high": None if p is None else p["ci_high"],
                         "weights FP8/BF16": cand["weight_bytes"].median() / ref["weight_bytes"].median(),
                         **teacher_forced_columns(r),
                         "greedy agreement (secondary)": cand["gen_match_rate"].median()})
            findings.append(_verdict(rows[-1], f["ci_method"], None if p is None else p["ci_method"]))
        table = pd.DataFrame(rows)
        if not table.empty:
            table = table.sort_values(["FP8 variant", "graphs", "batch", "d_model"]).round(3)
            sections.append(("Inference: FP8 vs BF16", "decode speedup = BF16 ms per decode step / FP8's (a step decodes "
                             "one token for each row of the batch) against the "
                             "BF16 of the FP8 cell's own stack, and against the fastest BF16 decode of the same shape, "
                             "batch and graph mode (any stack); prefill against its own stack's; > 1: FP8 faster, 95% "
                             "intervals; weights = the inference model's weight memory; " + TEACHER_FORCED_NOTE
                             + "; greedy agreement (secondary: one early divergence ruins it) = greedy tokens equal to "
                             "the BF16 model's", table))
            sections.append(("Inference: where FP8 pays off", "a verdict per cell against the fastest BF16 decode: "
                             "faster or slower when the 95% interval over samples excludes 1",
                             pd.DataFrame({"finding": findings})))
        if not fastest_rows.empty:
            bf16 = fastest_rows.drop_duplicates(["d_model", "n_layers", "batch_size", "cuda_graphs"])
            sections.append(("Inference: the fastest BF16 decode per shape", "which stack's BF16 decodes fastest at "
                             "each shape, batch and graph mode: the baseline FP8 serving is judged against",
                             pd.DataFrame({"d_model": bf16["d_model"], "n_layers": bf16["n_layers"],
                                           "batch": bf16["batch_size"], "graphs": bf16["cuda_graphs"],
                                           "fastest BF16": bf16["fastest BF16 stack"],
                                           DECODE_MS: bf16["BF16 ms"].round(4)})
                             .sort_values(["graphs", "batch", "d_model", "n_layers"])))
    shown = cells.round({"decode_tok_s": 0, "decode_ms": 4, "prefill_ms": 3, "prefill_tok_s": 0, "weight_gib": 3,
                         "kv_mib": 1, "peak_gib": 2, "match": 3, "stride": 3, "ref_stride": 3})
    sections.append(("Inference: all cells", "medians over samples: decode tokens/s and ms per decode step (one "
                     "token for each row), "
                     "prefill ms for prompt_len x batch, weight and KV-cache memory, peak during decode, FP8 greedy "
                     "token agreement with BF16 (match, secondary) and stride accuracy (ref: the BF16 reference)", shown))
    return sections


def _verdict(r: dict, fastest_method: str, prefill_method: str | None) -> str:
    def word(lo: float, hi: float, method: str | None) -> str:
        side = noise_side(lo, hi, method)
        if side is None:
            return "no interval" if lo != lo or hi != hi else "not judged (one sample a side: steps spread only)"
        return {1: "faster", -1: "slower", 0: "within noise"}[side]

    where = (f"d_model {r['d_model']} x {r['n_layers']}, batch {r['batch']}" + (", CUDA-graphed decode" if r["graphs"]
             else ", eager decode") + f", {r['FP8 variant']}")
    fastest = word(r["fastest CI low"], r["fastest CI high"], fastest_method)
    text = (f"{where}: FP8 decode {fastest} than the fastest BF16 "
            f"({r['fastest BF16']}: "
            f"{_interval(r['vs fastest BF16'], r['fastest CI low'], r['fastest CI high'], unit='x')}); against "
            f"{r['BF16 partner']} {_interval(r['decode speedup'], r['CI low'], r['CI high'], unit='x')}")
    if r["prefill speedup"] is not None:
        text += (f", prefill {word(r['prefill CI low'], r['prefill CI high'], prefill_method)} "
                 f"({_interval(r['prefill speedup'], r['prefill CI low'], r['prefill CI high'], unit='x')})")
    return text + "."
