"""Serving a transformers causal LM through transformers' own KV cache, on the torch, torchao and te stacks.

Which models: every ``hf:`` model, and a ``py:`` factory's module when it is a transformers causal LM (a
``PreTrainedModel`` with ``GenerationMixin``: its forward takes a cache and ``use_cache``, and says where
the next token's position is from the cache's length). Any other ``py:`` module is ``unsupported``: a module
that maps ids to logits has no way to be handed a cache, so there is nothing to decode with but recomputing
the prefix, which is not serving.

The generation is what ``model.generate`` does greedily, without its host-side machinery (logits processors,
stopping criteria), so the timed steps hold the model and its cache only, as MiniGPT's Generator does:
prefill ``prompt_len`` tokens keeping only the last position's logits (``logits_to_keep=1``), then one token
per decode step, each fed the previous argmax. Two caches:

    eager (cuda_graphs false)  :class:`HFGenerator`: a fresh ``DynamicCache`` per generation (made before the
                               clock starts), grown by concatenation (transformers' default for eager decoding);
                               positions come from the cache's length. ``kv_cache_bytes`` is its size after a
                               generation (prompt_len + gen_len - 1 positions).
    static (cuda_graphs true)  :class:`StaticGenerator`: one ``StaticCache`` of ``max_len`` positions for
                               ``rows`` rows, reset (zeroed in place) before each generation; the prefill runs
                               eager into it, and the decode step (static token (rows, 1) and position (1, 1)
                               buffers in, argmax into a static ``next`` buffer) is captured once as a CUDA graph
                               after warm-up steps on a side stream, and replayed. ``kv_cache_bytes`` counts
                               its preallocated buffers, as MiniGPT's does.

Why the static cache can be graphed: its layers write at, and the causal mask starts from, a length each layer
keeps on the device (``cumulative_length``, advanced in place by every replay); the rotary positions come from
the static position buffer (``position_ids``: transformers 5.x takes no ``cache_position``). Sliding-window
layers (mistral) keep their length on the host instead (a Python int a graph would freeze), so this cache
holds them as full-length static layers too: the model's sliding-window mask, built from the device-side
length, keeps each query to its window, the same attention as DynamicCache's window-sized layers.
``StaticGenerator(capture=False)`` runs the same cache and buffers without capturing (CPU tests compare
it with the DynamicCache path); the teacher-forced read (``forced``) is eager on either cache (it needs every
position's logits, a graphed step keeps only its argmax).

The stacks: torch serves the model as built; torchao quantizes its Linears for serving as it does MiniGPT's
(``quantize_for_serving``: the layer that makes the logits and Linears with a dimension not a multiple of
16 stay BF16); te converts it as training did (``te_layer: swap``: te.Linear and te.RMSNorm inside
transformers' own attention and MLP modules, so transformers' cache still works) and runs every forward
under ``te.autocast`` with the cell's recipe (a graphed step captures the autocast, as MiniGPT's Generator
does); ``weights: fp8`` converts under ``quantized_model_init`` and loads the calibrated weights as MiniGPT's
FP8-weight model does. ``te_layer: transformer_layer`` does not serve (te.TransformerLayer keeps no
transformers cache; see ``Source.te_unsupported``). Training graphs these models too, one decoder layer per graph
(trials/workloads/unit_graphs.py); the source table's ``Source.graphs`` (trials/models) says so.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.nn as nn

from ... import models
from ...backends import te_compat
from ..decode import Clock, Generation, timed_generation
from ..graph_capture import sound_after_failure
from ...models.common import Logits, logits_of
from ..teacher_forced import host_log_probs

NOT_SERVABLE = ("serving a py: model needs a transformers causal LM (a PreTrainedModel with GenerationMixin, "
                "whose forward takes a KV cache); {name} maps ids to logits only")


def _lm(model: nn.Module) -> nn.Module:
    """The transformers model inside the harness's logits adapter."""
    return model.model if isinstance(model, Logits) else model


def refusal(model: nn.Module) -> str:
    lm = _lm(model)
    try:
        from transformers import GenerationMixin, PreTrainedModel
    except ImportError:
        return NOT_SERVABLE.format(name=type(lm).__name__)
    if isinstance(lm, PreTrainedModel) and isinstance(lm, GenerationMixin):
        return ""
    return NOT_SERVABLE.format(name=type(lm).__name__)


def load(spec: Any, state: dict, dtype: torch.dtype, device: str, te: Any, fp8_recipe: Any = None) -> nn.Module:
    """The spec's model as its source builds it, converted as the trained one was (te: ``te_layer``; with
    ``fp8_recipe`` under ``quantized_model_init``, its te.Linear weights FP8 only), holding ``state``."""
    made = models.build(spec, "fp32" if dtype == torch.float32 else "bf16", device)
    model = made.model
    if te is not None:
        from ...backends import te_convert

        fp8_init = te_compat.quantized_model_init(te, fp8_recipe) if fp8_recipe is not None else contextlib.nullcontext()
        with fp8_init:
            te_convert.convert(model, te, spec.te_layer, made.logits_layer)
        model.backend = "te"  # generation runs it under te.autocast
    model.eval()
    if fp8_recipe is not None:
        from ...backends.te import load_fp8_weights

        load_fp8_weights(model, state)
    else:
        with te_compat.own_extra_state():  # a TE module's (empty) FP8 metadata, from this process
            model.load_state_dict(state)
    return model


def logits_layer(model: nn.Module) -> str | None:
    from ...backends.te_convert import find_logits_layer

    return find_logits_layer(model)


def generator(model: nn.Module, rows: int, max_len: int, te: Any = None, recipe: Any = None,
              graphs: bool = False) -> "HFGenerator":
    """``graphs``: the static cache with its decode step captured; else the eager DynamicCache path."""
    if graphs:
        return StaticGenerator(model, rows, max_len, te, recipe, capture=True)
    return HFGenerator(model, te, recipe)


class HFGenerator:
    """Greedy generation through the model's forward and a fresh ``DynamicCache`` per generation."""

    def __init__(self, model: nn.Module, te: Any = None, recipe: Any = None):
        self.lm = _lm(model)
        self.te = te if getattr(model, "backend", "torch") == "te" else None
        self.recipe = recipe
        self.device = next(self.lm.parameters()).device
        params = inspect.signature(self.lm.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renames it
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache: Any = None

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.lm.config)  # sliding-window layers keep only their window
        except TypeError:
            return DynamicCache()

    def _forward(self, ids: torch.Tensor, last: bool, positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids (rows, t) through the cache -> logits (rows, vocab) at the last position, or (rows, t, vocab).
        ``positions`` (1, t): the tokens' positions; None: transformers counts them from the cache's length."""
        at = {} if positions is None else {"position_ids": positions}
        with te_compat.autocast(self.te, self.recipe):
            out = self.lm(input_ids=ids, use_cache=True, **{self.cache_kw: self.cache}, **at,
                          **(self.last_only if last else {}))
        logits = logits_of(out)
        return logits[:, -1] if last else logits

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, gen_len: int) -> Generation:
        """prompts (rows, prompt_len) -> the next ``gen_len`` greedy tokens and their timings."""
        out = torch.empty(prompts.shape[0], gen_len, dtype=torch.long, device=self.device)
        self._fresh_cache()
        clock = Clock(self.device.type == "cuda")
        clock.start()
        out[:, 0] = self._forward(prompts, last=True).argmax(-1)
        clock.stop()
        for j in range(1, gen_len):
            clock.start()
            out[:, j] = self._forward(out[:, j - 1:j], last=True).argmax(-1)
            clock.stop()
        times = clock.read()
        return Generation(out, times[0], times[1:])

    def _fresh_cache(self) -> None:
        """An empty cache for a generation or a teacher-forced read: a new DynamicCache."""
        self.cache = self._new_cache()

    def _positions(self, start: int, t: int) -> torch.Tensor | None:
        """The positions of ``t`` tokens from ``start``, (1, t); None: transformers counts them from the cache."""
        return None

    @torch.no_grad()
    def forced(self, prompts: torch.Tensor, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        prompt_len = prompts.shape[1]
        self._fresh_cache()
        out = [host_log_probs(self._forward(prompts, last=False, positions=self._positions(0, prompt_len))[:keep])]
        for j in range(tokens.shape[1]):  # (keep, 1, vocab) each, fed column j through the cache
            at = self._positions(prompt_len + j, 1)
            out.append(host_log_probs(self._forward(tokens[:, j:j + 1], last=False, positions=at)[:keep]))
        return torch.cat(out, dim=1)  # (keep, prompt_len + n, vocab)

    @property
    def cache_bytes(self) -> int:
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


class StaticGenerator(HFGenerator):
    """Greedy generation for ``rows`` prompts through one ``StaticCache`` of ``max_len`` positions; with
    ``capture`` (a CUDA device) the decode step is a CUDA graph, replayed once per token."""

    def __init__(self, model: nn.Module, rows: int, max_len: int, te: Any = None, recipe: Any = None,
                 capture: bool = False):
        super().__init__(model, te, recipe)
        self.rows, self.max_len = rows, max_len
        self.cache = self._new_cache()
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=self.device)  # (rows, 1) decode input
        self.position = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # (1, 1) its position
        self.next = torch.zeros(rows, dtype=torch.long, device=self.device)  # (rows,) its argmax
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            self._capture()

    def _new_cache(self) -> Any:
        """transformers' StaticCache for the config, its sliding-window layers made full-length static layers
        (their host-side length would be frozen by a graph; the model's sliding mask keeps the window)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cache = StaticCache(config=self.lm.config, max_cache_len=self.max_len)
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "is_sliding", False):
                cache.layers[i] = StaticLayer(max_cache_len=self.max_len)
        return cache

    def _fresh_cache(self) -> None:
        """The one static cache, zeroed in place (a graph holds its buffers); the teacher-forced read (base
        class) runs eager through it: it needs every position's logits, a graphed step keeps only its argmax."""
        self.cache.reset()

    def _positions(self, start: int, t: int) -> torch.Tensor:
        """(1, t) positions from ``start``: a static cache's length says nothing the rotary embedding can read."""
        return torch.arange(start, start + t, device=self.device).unsqueeze(0)

    def _begin_decode(self) -> None:
        """Nothing to begin: each static layer advances its own length on the device, inside the step."""

    @torch.no_grad()
    def _decode(self) -> torch.Tensor:
        """One decode step on the static buffers: the token at the position -> the next token of every row."""
        self.next.copy_(self._forward(self.token, last=True, positions=self.position).argmax(-1))
        return self.next

    def _capture(self) -> None:
        """Capture the decode step after two warm-up steps on a side stream (they allocate the cache's buffers
        and choose kernels); what they and the capture wrote, a reset zeroes."""
        self.cache.reset()
        self.token.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for step in range(2):
                self.position.fill_(step)
                self._decode()
        torch.cuda.current_stream().wait_stream(side)
        self.cache.reset()
        self.position.fill_(0)
        self.graph = torch.cuda.CUDAGraph()
        with sound_after_failure(), torch.cuda.graph(self.graph):
            self._decode()
        self.cache.reset()
        torch.cuda.synchronize()

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, gen_len: int) -> Generation:
        """prompts (rows, prompt_len) -> the next ``gen_len`` greedy tokens and their timings."""
        def prefill(p: torch.Tensor) -> torch.Tensor:  # (rows, prompt_len) -> first tokens (rows,)
            return self._forward(p, last=True, positions=self._positions(0, p.shape[1])).argmax(-1)

        return timed_generation(self, prompts, gen_len, prefill)
