"""Serving a trained model: prefill, then KV-cached greedy decode; one module per way a model keeps its KV cache.

    minigpt  MiniGPT's own blocks (trials/workloads/decode.py's Generator): the twin's per-layer K/V buffers, or TE's
             InferenceParams inside te.TransformerLayer blocks
    hf       a transformers causal LM (an ``hf:`` model, or a ``py:`` factory's module that is one): transformers'
             own cache (``DynamicCache``) through the model's forward, whichever stack changed its Linears
             (torch: none; torchao's ``quantize_``; TE's swapped te.Linear / te.RMSNorm, under ``te.autocast``)

Which module serves a model is its source's table entry (``Source.server``, trials/models); the inference
workload (trials/workloads/inference.py) speaks only this interface, so it never asks which model it runs:

    refusal(model) -> str           why the trained model (a stack's Built.model) cannot be served, '' if it can
    load(spec, state, dtype, device, te, fp8_recipe=None) -> nn.Module
                                    a fresh inference model (eval mode) holding ``state``, the trained weights;
                                    with ``fp8_recipe`` its TE weights exist only in FP8 (``quantized_model_init``)
    logits_layer(model) -> str      the qualified name of the layer that makes the logits (stays BF16 when
                                    torchao quantizes the rest for serving)
    generator(model, rows, max_len, te, recipe, graphs) -> Generator

A Generator (the :class:`Generator` protocol below) times greedy generations and reads teacher-forced
next-token log-probabilities through the same cache (``forced``), untimed, after the timed runs.
Importing this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Protocol


class Generator(Protocol):
    """Greedy generation for a fixed number of prompt rows with a KV cache; see trials/workloads/decode.py."""

    def generate(self, prompts: Any, gen_len: int) -> Any:
        """prompts (rows, prompt_len) -> ``decode.Generation``: ``gen_len`` greedy tokens per row, the prefill's
        time and one time per decode step (CUDA events on GPUs, perf_counter on CPU)."""

    def forced(self, prompts: Any, tokens: Any, keep: int) -> Any:
        """Teacher-forced: fp32 next-token log-probabilities (keep, prompt_len + n, vocab) on the host, for the
        first ``keep`` rows: every prefill position, then one decode step per column of ``tokens`` (rows, n),
        each fed that column's token through the cache."""

    @property
    def cache_bytes(self) -> int:
        """The KV cache's bytes (after a generation)."""


def of(spec: Any) -> ModuleType:
    """The serving module for ``spec``'s model source (its table entry's ``server``)."""
    return importlib.import_module(f"{__name__}.{spec.source.server}")
