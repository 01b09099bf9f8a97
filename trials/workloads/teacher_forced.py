"""Teacher-forced FP8 numerics: does the FP8 model predict what its BF16 partner predicts, at every position?

Greedy generation compared token by token (``gen_match_rate``) is ruined by one early divergence: after it,
the two models read different tokens. Here both read the same held sequence (seeded apart from the training
data), and at every position we compare their next-token distributions:

    tf_top1_agreement          share of positions where argmax FP8 == argmax BF16
    tf_kl_mean                 mean over positions of KL(FP8 || BF16) = sum_v p8(v) (log p8(v) - log p16(v)), nats
    tf_bf16_top1_prob          BF16's own confidence: mean over positions of the probability of its argmax
    tf_decided_share           share of positions where BF16 is decided: its top-1 log-probability exceeds the
                               runner-up's by DECIDED_MARGIN nats or more
    tf_top1_agreement_decided  the top-1 agreement over those positions only (None where there are none)

Why the last three: a model trained a few steps on a 128k vocabulary predicts a nearly flat distribution
(top-1 p ~ 3e-4); its argmax is then decided by rounding noise, so FP8 and BF16 disagree almost everywhere
(agreement ~ 0) although KL is modest. Agreement means something only where BF16 itself is decided; KL
always does. The report says which case a cell is in (orchestrator/report/analysis.py).

The held sequence is one row of HELD_LEN positions. The BF16 partner is the cell's ``bf16_partner`` stack
(torchao: torch; te: te, the same te_layer), built from the same seeded init and trained on the same batches
for the same steps, compiled where the cell is: a cell of its own, :func:`partner_spec`. The FP8 cells of one model (delayed and
current scaling, tensorwise and rowwise) share that partner, so a process that runs trials one after another
trains it once and keeps its read (:class:`Partners`, held by trials/server.py). The FP8 side is read right
after its training, before the benchmark trains it further, and the read must leave the model as it was, so
later timing and losses are those of a trial without it: torchao's tensorwise and rowwise recipes keep no
state a forward pass changes; TE's delayed scaling does, and the read runs inside its numerics seam's
``read_context`` (trials/backends/te_numerics.py: ``te_compat.fp8_meta_kept``), which restores it exactly.

Inference cells (trials/workloads/inference.py) compare the measured model with the BF16 reference it was
loaded from (the same trained weights), through the KV cache as they serve: every prefill position of the
served prompts, then each decode step fed the reference's own greedy token, over as many prompt rows as fit
in HELD_LEN positions (at least one; :func:`served_rows`). The reference is read before the measured model
is built, the measured model after every timed and profiled generation, so neither read moves a timed number.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from .data import ArithmeticSequences
from ..backends import STACKS
from ..spec import TrialSpec, defaults_for, only_fields

log = logging.getLogger(__name__)

HELD_ROWS = 1  # one sequence, every position of its first HELD_LEN (fp32 log-probs: 131 MB at a 128k vocabulary)
HELD_LEN = 256
HELD_SEED_OFFSET = 3  # the held sequence's generator: seed + 3 (training uses seed, generation seed + 1)
# BF16 is "decided" at a position when its top-1 log-probability exceeds the runner-up's by this much (nats): the
# top-1 token is at least e times as likely as any other: a real preference, not a near-tie any rounding can flip.
DECIDED_MARGIN = 1.0


def held_pair(vocab: int, seq_len: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, next ids), each (HELD_ROWS, min(seq_len, HELD_LEN)): a sequence no training step has seen and its
    targets; the teacher-forced read uses the ids, the per-layer FP8 read (trials/measure/fp8_layers.py) both."""
    return ArithmeticSequences(vocab, min(seq_len, HELD_LEN), device, seed + HELD_SEED_OFFSET).batch(HELD_ROWS)


def held_batch(vocab: int, seq_len: int, device: str, seed: int) -> torch.Tensor:
    """(HELD_ROWS, min(seq_len, HELD_LEN)) token ids no training step has seen: :func:`held_pair`'s ids."""
    return held_pair(vocab, seq_len, device, seed)[0]


def partner_spec(spec: TrialSpec, stack: str) -> TrialSpec:
    """The BF16 partner of the FP8 cell ``spec`` as a cell of its own: ``stack`` (the cell's ``bf16_partner``),
    bf16, compiled as the cell is where the partner's stack compiles (compiled kernels round differently: on the
    H200 compiling alone moved torchao's loss path by about as much as FP8 did, docs/results/h200/ranks, so an
    eager partner would credit compile's effect to FP8), and every field that means something only for FP8 at
    its default. Two FP8 cells with one partner spec compare against the same model, trained the same way."""
    fp8_only = only_fields("fp8", "te-fp8", "te-delayed", "fp8-filter")
    values = {**spec.to_dict(), "backend": stack, "precision": "bf16",
              "compile": spec.compile and STACKS[stack].compiles}
    defaults = defaults_for(values)
    return TrialSpec.from_dict({**values, **{name: defaults[name] for name in fp8_only}})


@dataclass
class Partners:
    """The last BF16 partner read in this process: its spec, device and held-sequence log-probabilities.

    A process that runs trials one after another (a warm trial server) keeps one, so the next FP8 cell with the
    same partner takes the read instead of training the partner again (on the H200's seed sweep, 1.2-1.4 s a
    cell; seconds more for a large model). One entry, on the host: HELD_ROWS x HELD_LEN x vocab fp32 (98 KB for
    MiniGPT, 131 MB at a 128k vocabulary), which later trials' ``peak_rss_bytes`` include."""

    spec: TrialSpec | None = None
    device: str | None = None
    log_probs: torch.Tensor | None = None

    def get(self, spec: TrialSpec, device: str) -> torch.Tensor | None:
        return self.log_probs if (spec, device) == (self.spec, self.device) else None

    def keep(self, spec: TrialSpec, device: str, log_probs: torch.Tensor) -> None:
        self.spec, self.device, self.log_probs = spec, device, log_probs


def served_rows(batch_size: int, positions: int) -> int:
    """Prompt rows an inference cell compares: as many as fit in HELD_LEN positions, at least one."""
    return max(1, min(batch_size, HELD_LEN // positions))


def host_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """(rows, t, vocab) logits -> fp32 log-probabilities on the host (they wait there, out of device memory)."""
    return logits.float().log_softmax(-1).cpu()


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor, context: Callable[[], ContextManager] = contextlib.nullcontext
              ) -> torch.Tensor:
    """(rows, t) ids -> (rows, t, vocab) fp32 next-token log-probabilities on the host (they wait there while the
    cell is timed, out of its device memory), the model in eval mode meanwhile. ``context``: what the forward
    runs inside (TE's FP8 autocast for a TE FP8 model; nothing for the others)."""
    was_training = model.training
    model.eval()
    try:
        with context():
            logits = model(ids)
        return host_log_probs(logits)
    finally:
        model.train(was_training)


def compare(fp8: torch.Tensor, bf16: torch.Tensor) -> dict[str, float | None]:
    """Top-1 agreement and mean KL(FP8 || BF16) of two (rows, t, vocab) log-probability tensors, and how decided
    BF16 itself is (the module docstring's fields)."""
    top1 = fp8.argmax(-1) == bf16.argmax(-1)  # (rows, t)
    kl = (fp8.exp() * (fp8 - bf16)).sum(-1).clamp_min(0).mean()  # rounding can make a zero KL slightly negative
    best = bf16.topk(2, dim=-1).values  # (rows, t, 2) BF16's top-1 and runner-up log-probabilities
    decided = best[..., 0] - best[..., 1] >= DECIDED_MARGIN  # (rows, t)
    return {"tf_top1_agreement": float(top1.float().mean()), "tf_kl_mean": float(kl),
            "tf_bf16_top1_prob": float(best[..., 0].exp().mean()), "tf_decided_share": float(decided.float().mean()),
            "tf_top1_agreement_decided": float(top1[decided].float().mean()) if decided.any() else None}
