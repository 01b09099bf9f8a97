"""KV-cached greedy generation: prefill a prompt, then one token per step, each timed on the device.

TE models keep their cache in TE's ``InferenceParams``: every ``te.TransformerLayer`` appends the
step's keys and values and attends over the cache (``padding_causal`` mask, as TE requires for KV
caching). The twin keeps a plain (rows, max_len, kv_heads, head_dim) cache per layer and attends
with SDPA under a position mask. With ``graphs`` the decode step (embedding, every layer, LM head,
argmax) is captured once as a CUDA graph and replayed; the prefill stays eager.

A decode step's time runs from an event recorded before the step's host work (TE's cache
bookkeeping included) to one after its argmax: the per-token latency a serving loop sees.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..backends import te_compat
from ..models.minigpt_net import MiniGPT, rope_freqs
from .graph_capture import sound_after_failure
from .teacher_forced import host_log_probs

KV_LEN_MULTIPLE = 64  # TE's non-paged KV cache is sized in multiples of 64 tokens


@dataclass
class Generation:
    tokens: torch.Tensor  # (rows, gen_len) greedy continuation
    prefill_ms: float
    decode_ms: list[float] = field(default_factory=list)  # one per decode step (gen_len - 1)


class TwinCache:
    """Per-layer K/V buffers for the pure-PyTorch model."""

    def __init__(self, model: MiniGPT, rows: int, max_len: int):
        cfg, p = model.cfg, next(model.parameters())
        shape = (rows, max_len, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layers)]
        self.rope = model.rope
        self.positions: torch.Tensor | None = None

    def start(self, positions: torch.Tensor) -> None:
        self.positions = positions  # (t,) absolute positions of the tokens about to run

    def reset(self) -> None:
        """Nothing to clear: the position mask hides whatever an earlier generation left."""

    def block_kwargs(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"kv": (self.k[i], self.v[i]), "positions": self.positions}
        if self.rope is not None:
            out["rotary_pos_emb"] = self.rope[self.positions]  # (t, 1, 1, hd)
        return out

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class TECache:
    """TE's InferenceParams, advanced by ``start(step_len)`` before each forward (host-side bookkeeping)."""

    def __init__(self, model: MiniGPT, te: Any, rows: int, max_len: int, dtype: torch.dtype):
        cfg = model.cfg
        self.rows, self.max_len = rows, max_len
        self.params = te.InferenceParams(max_batch_size=rows, max_sequence_length=max_len,
                                         num_heads_kv=cfg.kv_heads, head_dim_k=cfg.head_dim,
                                         dtype=dtype, qkv_format="bshd")
        self.rope = rope_freqs(max_len, cfg.head_dim, "cuda") if cfg.llama else None  # TE offsets into it
        self.step_len = 0
        self.cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device="cuda")

    def start(self, step_len: int) -> None:
        self.params.pre_step(OrderedDict((i, step_len) for i in range(self.rows)))
        if step_len != self.step_len:
            self.cu_seqlens.copy_(torch.arange(self.rows + 1, dtype=torch.int32) * step_len)
            self.step_len = step_len

    def reset(self) -> None:
        self.params.reset()

    def block_kwargs(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {"inference_params": self.params, "self_attn_mask_type": "padding_causal",
                               "cu_seqlens_q": self.cu_seqlens, "cu_seqlens_kv": self.cu_seqlens,
                               "max_seqlen_q": self.step_len, "max_seqlen_kv": self.max_len}
        if self.rope is not None:
            out["rotary_pos_emb"] = self.rope
        return out

    @property
    def bytes(self) -> int:
        total = 0
        for entry in self.params.cache_manager.cache.values():
            total += sum(t.numel() * t.element_size() for t in entry if isinstance(t, torch.Tensor))
        return total


def timed_generation(gen: Any, prompts: torch.Tensor, gen_len: int,
                     prefill: Callable[[torch.Tensor], torch.Tensor]) -> Generation:
    """The timed greedy generation every static-buffer generator shares (MiniGPT's here, a transformers model's
    StaticGenerator in trials/workloads/serving/hf.py): ``gen.cache`` reset, then ``prefill(prompts)`` -> the first token of
    every row (rows,), then each decode step copies the previous token into ``gen.token``, sets ``gen.position``,
    lets the cache begin (``gen._begin_decode()``), replays ``gen.graph`` (or runs ``gen._decode()`` uncaptured)
    and reads ``gen.next``. prompts (rows, prompt_len) -> ``gen_len`` tokens per row and one time per step."""
    prompt_len = prompts.shape[1]
    out = torch.empty(prompts.shape[0], gen_len, dtype=torch.long, device=gen.device)
    gen.cache.reset()  # before the clock, as an eager generator makes its cache
    clock = Clock(gen.device.type == "cuda")
    clock.start()
    out[:, 0] = prefill(prompts)
    clock.stop()
    for j in range(1, gen_len):
        clock.start()
        gen.token.copy_(out[:, j - 1:j])
        gen.position.fill_(prompt_len + j - 1)
        gen._begin_decode()
        if gen.graph is not None:
            gen.graph.replay()
        else:
            gen._decode()
        out[:, j] = gen.next
        clock.stop()
    times = clock.read()
    return Generation(out, times[0], times[1:])


class Generator:
    """Greedy generation for ``rows`` prompts with a KV cache of ``max_len`` positions."""

    def __init__(self, model: MiniGPT, rows: int, max_len: int, te: Any = None, recipe: Any = None,
                 graphs: bool = False):
        self.model = model
        self.te = te if model.backend == "te" else None
        self.recipe = recipe
        self.device = model.positions.device
        self.max_len = math.ceil(max_len / KV_LEN_MULTIPLE) * KV_LEN_MULTIPLE
        dtype = model.tok.weight.dtype
        self.cache = (TECache(model, self.te, rows, self.max_len, dtype) if self.te is not None
                      else TwinCache(model, rows, self.max_len))
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=self.device)  # (rows, 1) decode input
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,) its position
        self.next = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graphs:
            self._capture()

    def _prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """prompts (rows, prompt_len) through a reset cache -> hidden states (rows, prompt_len, d_model)."""
        positions = torch.arange(prompts.shape[1], device=self.device)
        self.cache.start(prompts.shape[1] if self.te is not None else positions)
        with te_compat.autocast(self.te, self.recipe):
            return self.model.features(prompts, positions, self.cache)

    def _step_features(self) -> torch.Tensor:
        """The static token buffer at the static position, through the cache -> hidden (rows, 1, d_model)."""
        with te_compat.autocast(self.te, self.recipe):
            return self.model.features(self.token, self.position, self.cache)

    @torch.no_grad()
    def _decode(self) -> torch.Tensor:
        """One decode step on the static buffers -> the next token of every row, (rows,)."""
        hidden = self._step_features()  # (rows, 1, d_model)
        self.next.copy_(self.model.head(hidden[:, -1]).argmax(-1))
        return self.next

    def _begin_decode(self) -> None:
        self.cache.start(1 if self.te is not None else self.position)

    def _capture(self) -> None:
        """Capture the decode step; the warm-up steps it needs write cache positions a reset forgets."""
        self.cache.reset()
        self.position.fill_(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._begin_decode()
                self._decode()
        torch.cuda.current_stream().wait_stream(side)
        self._begin_decode()
        self.graph = torch.cuda.CUDAGraph()
        with sound_after_failure(), torch.cuda.graph(self.graph):
            self._decode()
        self.cache.reset()

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, gen_len: int) -> Generation:
        """prompts (rows, prompt_len) -> the next ``gen_len`` greedy tokens and their timings."""
        return timed_generation(self, prompts, gen_len,
                                lambda p: self.model.head(self._prefill(p)[:, -1]).argmax(-1))

    @torch.no_grad()
    def forced(self, prompts: torch.Tensor, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        """Teacher-forced log-probabilities through the cache, untimed and eager (a graphed decode step keeps
        only its argmax): every prefill position, then one decode step per column of ``tokens`` (rows, n), fed
        that token -> (keep, prompt_len + n, vocab) fp32 on the host, the first ``keep`` rows."""
        prompt_len = prompts.shape[1]
        self.cache.reset()
        out = [host_log_probs(self.model.head(self._prefill(prompts)[:keep]))]  # every prefill position
        for j in range(tokens.shape[1]):
            self.token.copy_(tokens[:, j:j + 1])
            self.position.fill_(prompt_len + j)
            self._begin_decode()
            out.append(host_log_probs(self.model.head(self._step_features()[:keep])))
        return torch.cat(out, dim=1)

    @property
    def cache_bytes(self) -> int:
        return self.cache.bytes


class Clock:
    """Intervals on the device (CUDA events, read once at the end) or on the host (CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[Any] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append([self._mark(), None])

    def stop(self) -> None:
        self.marks[-1][1] = self._mark()

    def read(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1000.0 for a, b in self.marks]

