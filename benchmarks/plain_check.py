"""The harness against a plain loop of the same model: rounds of one and the other, interleaved, medians compared.

Shared by benchmarks/hf_loop.py (torch and torchao training cells), te_hf_loop.py (TE training cells) and
hf_decode_loop.py (graphed serving cells): each says what its plain loop is; this runs the rounds and prints
one line per cell. The goal every one of them checks: |trial / plain - 1| <= GOAL. The plain graphed decode of
hf_decode_loop.py and decode_loop.py (MiniGPT) is :func:`graphed_ms_per_step`; the plain graphed training step of
hf_loop.py and te_hf_loop.py (``cuda_graphs`` cells) graphs each decoder layer by hand (:func:`graph_layers`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trials import TrialSpec, run_trial
from trials.measure import kernels
from trials.measure.bench import HOST_PROBE_STEPS

GOAL = 0.02
# a sweep's shape fields -> transformers' config keys, for the plain loops' own builds of ``hf:`` models
HF_NAMES = {"vocab": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn": "intermediate_size"}


def hf_model(model_type: str, shape: dict[str, int | None], seq_len: int, seed: int) -> torch.nn.Module:
    """A transformers model as a user writes it, without trials/models/hf.py: ``AutoConfig.for_model`` with the
    ``shape`` fields that are not None (the type's own otherwise), room for ``seq_len`` positions, no KV cache, no
    dropout (a trial trains without: its loss curve is the model's, not the mask's), seeded random init on the
    GPU (a CPU init of 8B weights takes minutes), BF16, SDPA. Shared by every plain loop, so that the TE and the
    torch/torchao checks time one and the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{HF_NAMES[k]: v for k, v in shape.items() if v is not None})
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, seq_len)
    cfg.use_cache = False
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):  # GPT-2 says pdrop
            setattr(cfg, key, 0.0)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").train()


def untimed_steps(spec: TrialSpec) -> int:
    """The steps a trial of ``spec`` runs before its timed ones (training, warm-up, the host-issue probe on GPUs):
    the warm-up a plain loop is given, so that neither side times steps the other had already settled (the
    caching allocator's growth, cuBLAS's and cuDNN's first choices, the clocks). The full-depth checks gave the
    loop 3 against the trial's 16 and read the trial 1-3% faster in every round of seven cells."""
    return spec.train_steps + spec.warmup_steps + (HOST_PROBE_STEPS if spec.device == "cuda" else 0)


@dataclass
class Measured:
    """What a plain loop measured: its median ``ms`` and, where it was profiled (``--kernels``), its step's kernel
    time per class (trials/measure/kernels.CLASSES) and ``gap``, the step less its kernels: the GPU's idle time."""

    ms: float
    kernel_ms: dict[str, float] | None = None


def kernel_classes(run: Callable[[], Any], ms: float, steps: int = 5) -> dict[str, float]:
    """``run``'s step under the profiler the trial uses (trials/measure/kernels.profile): kernel ms per class, and
    the gap to ``ms``, the step's timed median, by the trial's rule (``Breakdown.busy``: overlapping streams once),
    so that the two sides' gaps compare."""
    found = kernels.profile(run, steps, "cuda")
    return {**{c: v for c, v in found.ms().items() if v}, "gap": ms - found.busy}


def _trial_classes(rec: dict[str, Any]) -> dict[str, float] | None:
    if rec.get("kernel_ms_total") is None:
        return None
    return {**{c: rec[f"kernel_ms_{c}"] for c in kernels.CLASSES if rec.get(f"kernel_ms_{c}")},
            "gap": rec["kernel_gap_ms"]}


def compare(label: str, spec: TrialSpec, field: str, plain: Callable[[], float | Measured], rounds: int,
            unit: str = "ms") -> dict[str, Any] | None:
    """``rounds`` times: ``run_trial(spec)[field]``, then ``plain()``; the medians, their ratio and every round,
    or None when the trial did not end ok (said on stdout). Where both sides were profiled (the trial's
    ``profile: true``, the loop's :class:`Measured` kernels), each side's last round per kernel class too: a
    difference in the GEMMs is the GPU's, one in the gap is the host's."""
    trial, loop = [], []
    sides: dict[str, dict[str, float] | None] = {}
    for _ in range(rounds):
        rec = run_trial(spec)
        if rec["status"] != "ok":
            print(f"{label}: trial {rec['status']}: {rec['error']}", flush=True)
            return None
        trial.append(rec[field])
        got = plain()
        got = got if isinstance(got, Measured) else Measured(got)
        loop.append(got.ms)
        sides = {"trial": _trial_classes(rec), "plain": got.kernel_ms}
    t, p = statistics.median(trial), statistics.median(loop)
    print(f"{label}: trial {t:.3f} {unit}  plain {p:.3f} {unit}  trial/plain {t / p:.3f}"
          f"{'' if abs(t / p - 1) <= GOAL else f'  (outside {GOAL:.0%})'}", flush=True)
    row = {"cell": label, "trial_ms": t, "plain_ms": p, "ratio": t / p, "trial_rounds": trial, "plain_rounds": loop}
    if sides and all(sides.values()):
        classes = sorted(set(sides["trial"]) | set(sides["plain"]), key=lambda c: -sides["trial"].get(c, 0.0))
        print("  kernel ms per step, last round (trial / plain): " + ", ".join(
            f"{c} {sides['trial'].get(c, 0.0):.1f} / {sides['plain'].get(c, 0.0):.1f}" for c in classes), flush=True)
        row["kernel_ms"] = sides
    return row


def keep(rows: list[dict[str, Any]], row: dict[str, Any] | None, path: str | None) -> None:
    """Add ``row`` (None: the trial did not end ok) and, with ``path``, write every row so far as JSON: a run cut
    by its device call's limit keeps the cells it finished (they were written only at the end before)."""
    if row is not None:
        rows.append(row)
    if path:
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)


def graphed_ms_per_step(step: Callable[[], None], reset: Callable[[], None], steps: int, repeats: int) -> list[float]:
    """A hand-written server's decode: ``step`` (the whole decode step, the next token fed back and the position
    advanced inside it) run twice on a side stream (kernels chosen, buffers allocated outside the graph), captured
    as one CUDA graph, then per repeat ``reset()`` and ``steps`` replays back to back between two events; the ms
    per step of each repeat."""
    reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out = []
    for _ in range(repeats):
        reset()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(begin.elapsed_time(end) / steps)
    return out


class _Layer(torch.nn.Module):
    """A transformers decoder layer called with tensors only (what ``make_graphed_callables`` takes): the hidden
    states and RoPE's cos and sin; no mask (SDPA's causal kernel, as the model's own root hands it None)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return self.layer(hidden, position_embeddings=(cos, sin), attention_mask=None)


class _Replay(torch.nn.Module):
    """In a decoder layer's place: the model's call of the layer, handed to its graphed :class:`_Layer`."""

    def __init__(self, graphed: torch.nn.Module):
        super().__init__()
        self.graphed = graphed

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, **_: Any) -> Any:
        return self.graphed(hidden_states, *position_embeddings)


def graph_layers(model: torch.nn.Module, batch: int, seq_len: int, te: Any = None, recipe: Any = None) -> None:
    """Each decoder layer of a transformers model as a user graphs it by hand: one forward and one backward graph per
    layer, every layer in one ``make_graphed_callables`` call (one pool), TE's with its recipe (``te``: TE's module;
    ``recipe``: None for BF16), torch's otherwise; the root, the loss and the optimizer stay eager. In place."""
    layers = model.model.layers
    hidden = torch.randn(batch, seq_len, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(seq_len, device="cuda")[None])
    wrapped = tuple(_Layer(layer) for layer in layers)
    samples = tuple((hidden.clone().requires_grad_(), cos.clone(), sin.clone()) for _ in wrapped)
    if te is not None:
        # gradients handed back in the graphs' buffers, not cloned (TE's default clones each: 16 GB more at 8B
        # parameters), as the trial's graphs do (trials/backends/te_compat.py): the two are timed like for like
        graphed = te.make_graphed_callables(wrapped, samples, enabled=recipe is not None, recipe=recipe,
                                            clone_param_grads_on_return=False)
    else:
        graphed = torch.cuda.make_graphed_callables(wrapped, samples)
    for i, g in enumerate(graphed):
        layers[i] = _Replay(g)
