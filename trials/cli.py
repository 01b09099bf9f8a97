"""Command line for one trial: every spec field is a ``--kebab-case`` flag.

Used as ``juicytalk trial ...`` and, without Ray or the orchestrator, as ``python -m trials ...``.
Exit status: 0 when the record's status is ok, oom, unsupported or diverged; 1 for error; 2 for bad
input (nothing is run).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .record.atomic import write_text_atomic
from .models import DEFAULT_MODEL, SOURCES
from .runtime.noise import quiet_third_party
from .numbers import DIGITS, fmt_sig
from .spec import SOURCE_DEFAULTS, SpecError, TrialSpec, check_model, spec_field_types

EXIT_OK_STATUSES = ("ok", "oom", "unsupported", "diverged")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (``prog: error: ...``) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


_PARSERS = {"int": int, "float": float, "str": str}


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrialSpec().to_dict()
    for name, type_name in spec_field_types().items():
        flag = "--" + name.replace("_", "-")
        if type_name == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(default {str(defaults[name]).lower()})")
        else:
            default = ("derived" if name in ("n_heads", "ffn") else
                       "the model's: " + ", ".join(f"{m} {SOURCE_DEFAULTS[name](s)}" for m, s in SOURCES.items())
                       if name in SOURCE_DEFAULTS else defaults[name])
            parser.add_argument(flag, dest=name, type=_PARSERS[type_name], default=None, metavar=type_name.upper(),
                                help=f"(default {default})")


def add_trial_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--spec-json", help="the whole spec as a JSON object (flags given too override it)")
    parser.add_argument("--json", dest="json_path", type=Path, help="write the record to this file (atomically)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def spec_from_args(args: argparse.Namespace) -> TrialSpec:
    values: dict[str, Any] = {}
    if args.spec_json:
        try:
            values = json.loads(args.spec_json)
        except json.JSONDecodeError as exc:
            raise SpecError("--spec-json", f"not JSON ({exc.msg} at character {exc.pos}); give an object such as "
                            "'{\"d_model\": 256}'") from None
        if not isinstance(values, dict):
            raise SpecError("--spec-json", f"must be a JSON object of spec fields, got {type(values).__name__}")
    for name in TrialSpec.field_names():
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    spec = TrialSpec.from_dict(values)
    check_model(spec)
    return spec


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, allow_nan=True))


def _fmt(value: Any, unit: str = "", digits: int = DIGITS) -> str:
    """Floats to ``digits`` significant figures (a CPU trial's 0.0412 TFLOP/s is not '0.0')."""
    if isinstance(value, bool):  # as the flags write it
        return str(value).lower()
    if isinstance(value, float) or value is None:
        return fmt_sig(value, digits, unit)
    return f"{value}{unit}"


def _bytes(value: Any) -> str:
    """A size as a user reads it ('-' when unknown, never '- B')."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value / 2**20:.1f} MiB" if value < 2**30 else f"{value / 2**30:.2f} GiB"


def _model_name(r: dict[str, Any]) -> str:
    """The model as the summary names it: MiniGPT's arch, or the model field (hf:llama, py:...)."""
    model = r.get("model") or DEFAULT_MODEL
    return r.get("arch") or "gpt" if model == DEFAULT_MODEL else f"{model} ({r.get('model_class')})"


def summary(record: dict[str, Any]) -> str:
    r = record
    lines = [
        f"status        {r['status']}" + (f"  ({r['error']})" if r.get("error") else ""),
        f"cell          {r.get('workload') or 'train'} {_model_name(r)} d_model={r['d_model']} n_layers={r['n_layers']} heads={r['n_heads']} ffn={r['ffn']} "
        f"batch={r['batch_size']} seq={r['seq_len']} cuda_graphs={_fmt(r['cuda_graphs'])} compile={_fmt(r.get('compile'))}",
        f"requested     backend={r['backend']} precision={r['precision']}"
        + (f" recipe={r['recipe']}" if r["precision"] == "fp8" else "") + f" device={r['device']}",
        (f"ran as        device={r['effective_device']} backend={r['effective_backend']} "
         f"precision={r['effective_precision']}" + (f" recipe={r['effective_recipe']}" if r["effective_recipe"] else "")
         + (f" fp8_flop_share={r['fp8_flop_share']:.3f}" if r.get("fp8_flop_share") is not None else "")
         + (" (fp8 asked, nothing worth the name ran in FP8: not an FP8 result)"
            if r["precision"] == "fp8" and r["effective_precision"] not in ("fp8", None) else "")
         if r.get("effective_backend") else f"ran as        - (did not run: {r['status']})"),
        f"params        {_fmt(r['n_params'])}  ({_fmt((r['n_params'] or 0) / 1e6, 'M')})",
        f"loss          first {_fmt(r['loss_first'], digits=4)}  final {_fmt(r['loss_final'], digits=4)}",
        f"step          p50 {_fmt(r['step_ms_p50'], ' ms')}  p90 {_fmt(r['step_ms_p90'], ' ms')}  "
        f"mean {_fmt(r['step_ms_mean'], ' ms')}  std {_fmt(r['step_ms_std'], ' ms')}  [{r['timer'] or '-'}]",
        f"throughput    {_fmt(r['tokens_per_s'], ' tok/s')}  {_fmt(r['model_tflops'], ' TFLOP/s')}  "
        f"MFU(bf16 peak) {_fmt(r['mfu_bf16_peak'])}  MFU(own peak) {_fmt(r['mfu_precision_peak'])}",
        f"host          {_fmt(r['host_ms_per_step'], ' ms/step to issue')}  launch_bound={_fmt(r['launch_bound'])}"
        f" (by {r.get('launch_bound_by') or '-'})",
        f"memory        allocated {_bytes(r['peak_mem_allocated_bytes'])}  reserved {_bytes(r['peak_mem_reserved_bytes'])}  "
        f"saved for backward {_bytes(r.get('saved_activation_bytes'))} (activation_checkpointing "
        f"{r.get('activation_checkpointing') or 'none'})",
        *([f"graphs        {_fmt(r['graphs_per_step'])} per step  capture {_fmt(r['graph_capture_s'], ' s')}  pool "
           f"{_bytes(r['graph_pool_bytes'])} (plan {_bytes(r['est_graph_pool_bytes'])})  {r['cuda_graphs_why'] or ''}"]
          if r.get("cuda_graphs") and r.get("workload") == "train" else []),
        f"generation    stride accuracy {_fmt(r['gen_stride_accuracy'])}",
        *([f"inference     prefill p50 {_fmt(r['prefill_ms_p50'], ' ms')}  decode p50 "
           f"{_fmt(r['decode_ms_per_token_p50'], ' ms/token')}  {_fmt(r['decode_tokens_per_s'], ' tok/s')}  "
           f"weights {_bytes(r['weight_bytes'])}  kv {_bytes(r['kv_cache_bytes'])}  "
           f"FP8 vs BF16 teacher-forced top-1 {_fmt(r['tf_top1_agreement'])} KL {_fmt(r['tf_kl_mean'])}  "
           f"(greedy tokens {_fmt(r['gen_match_rate'])})"] if r.get("workload") == "infer" else []),
        *([f"fp8 layers    SQNR min fwd {_fmt(r['sqnr_fwd_min_db'], ' dB')} ({r['sqnr_fwd_worst']})  "
           f"dgrad {_fmt(r['sqnr_dgrad_min_db'], ' dB')} ({r['sqnr_dgrad_worst']})  "
           f"wgrad {_fmt(r['sqnr_wgrad_min_db'], ' dB')} ({r['sqnr_wgrad_worst']})  "
           f"max abs/rms {_fmt(r['outlier_ratio_max'])} ({r['outlier_ratio_worst']})  "
           f"reads {_fmt(r['fp8_layers_s'], ' s')} + {_fmt(r['outliers_s'], ' s')}"]
          if r.get("fp8_layers") is not None else []),
        f"device        {r['gpu_name'] or 'cpu'}" + (f" cc={r['compute_capability']}" if r["compute_capability"] else "")
        + f" torch={r['torch_version']}" + (f" te={r['te_version']}" if r["te_version"] else ""),
        f"time          {_fmt(r['duration_s'], ' s')} (setup {_fmt(r['setup_s'], ' s')}, train {_fmt(r['train_s'], ' s')}, "
        f"bench {_fmt(r['bench_s'], ' s')})",
    ]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace, prog: str, check: Callable[[TrialSpec], str | None] | None = None) -> int:
    """Run the trial the flags give; ``check``: what may refuse a good spec first, in one line, exit 2, before
    anything is allocated (``juicytalk trial``'s fit check; the orchestrator's, which this package cannot import)."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party(args.verbose)
    try:
        spec = spec_from_args(args)
    except (SpecError, json.JSONDecodeError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if check is not None and (why := check(spec)):
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 2
    from .trial import run_trial  # torch-heavy import only once the input is known good

    record = run_trial(spec)
    from .parallel.ranks import Ranks

    if not Ranks.from_env().lead:  # under torchrun: one record per trial, rank 0's
        return 0 if record["status"] in EXIT_OK_STATUSES else 1
    if args.json_path:
        write_json_atomic(args.json_path, record)
    if not args.quiet:
        print(summary(record))
    return 0 if record["status"] in EXIT_OK_STATUSES else 1


def main(argv: Sequence[str] | None = None, prog: str = "python -m trials") -> int:
    parser = OneLineParser(prog=prog, description="Run one MiniGPT trial and print its record.")
    add_trial_arguments(parser)
    return run_from_args(parser.parse_args(argv), prog)
