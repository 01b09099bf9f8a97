"""Issue 45 item 4: every causal LM type transformers builds from a config runs one training step through the hf:
model source (tiny shape, torch fp32, CPU), with the attention implementation the type has (gemma2 and bloom have no
SDPA path: eager, recorded). A type that breaks fails here. Types that cannot be a trial's model are skipped with the
reason; types that break today at the tiny shape are listed with what breaks (strict xfail: a fix shows up as a
failure to update the list). A few representative types run in the default suite; the long tail is marked slow
(about 200 types, ~5-7 minutes on 2 cores): ``pytest -m slow tests/test_hf_types.py``."""

from __future__ import annotations

import pytest
import torch

from trials import TrialSpec, models
from trials.spec import check_model

pytest.importorskip("transformers")

from trials.models.hf import _causal_types  # noqa: E402 - after the importorskip

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, vocab=96, seq_len=16, batch_size=2, device="cpu", backend="torch",
             precision="fp32")
# run in the default suite: the Llama family, the two without SDPA, Falcon's own names, GPT-2 / OPT's MLP names,
# MoE, head_dim-carrying types
FAST = ("llama", "gemma2", "bloom", "falcon", "gpt2", "opt", "mixtral", "qwen2_moe", "qwen3", "gemma3_text")
# cannot be a trial's model (a JuicyTalk trial feeds token ids and reads logits)
SKIP: dict[str, str] = {}
# break today at the tiny shape (d_model 64, 4 heads, 2 layers): what breaks
BROKEN: dict[str, str] = {}


def _has_ffn(model_type: str) -> bool:
    """The type has a feed-forward width the ``ffn`` field sets (BLOOM's is 4 x d_model, fixed)."""
    from transformers import AutoConfig

    from trials.models.hf import _names

    return bool(_names(AutoConfig.for_model(model_type), "ffn"))


def _param(model_type: str) -> object:
    marks = [] if model_type in FAST else [pytest.mark.slow]
    if model_type in SKIP:
        marks.append(pytest.mark.skip(reason=SKIP[model_type]))
    elif model_type in BROKEN:
        marks.append(pytest.mark.xfail(reason=BROKEN[model_type], strict=True))
    return pytest.param(model_type, marks=marks, id=model_type)


@pytest.mark.parametrize("model_type", [_param(t) for t in _causal_types()[1]])
def test_every_causal_lm_type_trains_one_step(model_type):
    spec = TrialSpec(model=f"hf:{model_type}", **SHAPE, ffn=128 if _has_ffn(model_type) else None)
    check_model(spec)
    built = models.build(spec, "fp32", "cpu")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = built.model(ids)  # (2, 16, 96)
    assert logits.shape == (2, 16, 96)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96).float(), ids.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    facts = models.describe(spec)
    assert (facts.shape["d_model"], facts.shape["n_layers"], facts.shape["vocab"]) == (64, 2, 96)
    assert facts.attn_implementation in ("sdpa", "eager", "flash_attention_2", "flex_attention") or \
        facts.attn_implementation is None


def test_gemma2_and_bloom_build_with_eager_attention_and_record_it():
    """transformers has no SDPA path for them: built with eager (main refused them), recorded as a field."""
    for model_type in ("gemma2", "bloom"):
        assert models.describe(TrialSpec(model=f"hf:{model_type}", **SHAPE)).attn_implementation == "eager"
    assert models.describe(TrialSpec(model="hf:llama", **SHAPE)).attn_implementation == "sdpa"


def test_falcon_keeps_the_linear_it_adds_to_in_place_out_of_fp8():
    """Falcon's decoder does mlp_output += attention_output; a torchao float8 matmul's output is a view autograd
    will not let it modify (main: an error record). The model source finds that Linear, torchao leaves it in BF16
    and converts the rest."""
    from trials import run_trial

    spec = TrialSpec(model="hf:falcon", **{**SHAPE, "precision": "fp8", "backend": "torchao", "recipe": "tensorwise",
                                           "train_steps": 2, "warmup_steps": 0, "bench_steps": 1, "profile": False})
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    import json

    skipped = json.loads(rec["fp8_skipped_modules"])
    assert "model.transformer.h.0.mlp.dense_4h_to_h" in skipped and rec["fp8_converted_modules"] == 6
