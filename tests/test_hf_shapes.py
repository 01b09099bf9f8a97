"""Issue 44 (items 3, 4, 8): a transformers model's shape fields are the model's. Each type's own name for a shape
field is set (OPT's ffn_dim, GPT-2's n_inner, MoE expert sizes) or the field is refused in one line; what follows
from the given shape follows (head_dim, KV heads); the record reads the shape back from the built config; values
that came from transformers' defaults, not the sweep or the config file, are recorded and shown in the dry run."""

from __future__ import annotations

import json

import pytest

from trials import SpecError, TrialSpec, models, run_trial
from trials.spec import check_model

pytest.importorskip("transformers")

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, vocab=96, seq_len=32, batch_size=8, device="cpu", backend="torch")


def spec(model: str, **kw) -> TrialSpec:
    return TrialSpec(model=model, **{**SHAPE, **kw})


@pytest.mark.parametrize("model,names", [
    ("hf:opt", ("ffn_dim",)),
    ("hf:gpt2", ("n_inner",)),
    ("hf:falcon", ("ffn_hidden_size",)),
    ("hf:mixtral", ("intermediate_size",)),  # each expert's MLP
    ("hf:qwen2_moe", ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")),
])
def test_ffn_sets_the_types_own_names_and_the_shape_is_read_back(model, names):
    from trials.models.hf import config

    s = spec(model, ffn=256)
    check_model(s)
    cfg = config(s)
    assert {n: getattr(cfg, n) for n in names} == {n: 256 for n in names}
    facts = models.describe(s)
    assert facts.shape["ffn"] == 256 and facts.shape["d_model"] == 64 and facts.shape["head_dim"] == 16


@pytest.mark.parametrize("model", ["hf:qwen3", "hf:gemma3_text"])
def test_head_dim_follows_d_model_and_n_heads(model):
    """qwen3 and gemma3_text keep a head_dim of their own (128, 256): at d_model 64 with 4 heads it is 16."""
    from trials.models.hf import config

    s = spec(model, ffn=128)
    assert config(s).head_dim == 16 and models.describe(s).shape["head_dim"] == 16
    assert models.describe(s).attn_width == 64


def test_kv_heads_keep_the_configs_ratio_when_only_the_heads_are_given():
    """gemma2's 8 heads share 4 KV heads: at 4 heads, 2 (the default 4 would not divide... nor exceed the heads)."""
    facts = models.describe(spec("hf:gemma2", ffn=128))
    assert (facts.shape["n_heads"], facts.shape["n_kv_heads"]) == (4, 2)
    assert models.describe(spec("hf:qwen3", ffn=128)).shape["n_kv_heads"] == 4  # MHA stays MHA (32 of 32)


@pytest.mark.parametrize("model,field,message", [
    ("hf:bloom", "ffn", "BloomConfig has no intermediate_size or ffn_dim .* so ffn cannot set it"),
    # Falcon without new_decoder_architecture is multi-query: one KV head whatever num_kv_heads says
    ("hf:falcon", "n_kv_heads", "n_kv_heads=2 does not reach the model: FalconConfig keeps num_key_value_heads=1"),
])
def test_a_field_the_type_cannot_take_is_one_line(model, field, message):
    with pytest.raises(SpecError, match=message) as exc:
        check_model(spec(model, **{field: 2 if field == "n_kv_heads" else 128}))
    assert exc.value.field == field and "\n" not in str(exc.value)


def test_a_bare_type_says_which_sizes_are_transformers_defaults():
    """Item 8: qwen2_moe's 60 experts of 1408 and its 5632-wide MLPs came from transformers, not the sweep."""
    facts = models.describe(spec("hf:qwen2_moe"))
    assert facts.defaults == {"intermediate_size": 5632, "moe_intermediate_size": 1408,
                              "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4}
    assert models.describe(spec("hf:llama", ffn=128)).defaults == {}
    assert models.describe(TrialSpec(model="minigpt")).defaults is None


def test_the_record_is_the_models_shape_and_names_the_defaults(tmp_path):
    """A local config.json without vocab_size (item 4) and an OPT-style ffn name: the record says 32000 came from
    transformers' defaults, and its ffn / head_dim are what the model has."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 4, "ffn_dim": 128, "vocab_size": 96}))
    (tmp_path / "novocab").mkdir()
    (tmp_path / "novocab" / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64,
                                                                  "ffn_dim": 128}))
    run = dict(vocab=None, d_model=None, n_heads=None, n_layers=None, seq_len=16, batch_size=2, train_steps=1,
               warmup_steps=0, bench_steps=1, profile=False)
    rec = run_trial(spec(f"hf:{tmp_path}", **run, ffn=256))
    assert rec["status"] == "ok", rec["error"]
    built = json.loads(rec["model_config"])
    assert (rec["ffn"], rec["d_model"], rec["n_layers"], rec["n_heads"], rec["head_dim"], rec["vocab"]) == \
        (built["ffn_dim"], 64, 1, 4, 16, 96) == (256, 64, 1, 4, 16, 96)
    assert json.loads(rec["config_defaults"]) == {} and rec["attn_implementation"] == "sdpa"
    facts = models.describe(spec(f"hf:{tmp_path / 'novocab'}", vocab=None, n_layers=1))
    assert facts.defaults == {"vocab_size": 50272} and facts.shape["vocab"] == 50272


def test_the_dry_run_shows_the_defaults_beside_what_the_sweep_set(tmp_path, capsys):
    """...and, for a type with experts, what the built model has: DeepSeek-V3's first 3 layers are dense, so at 2
    layers its 256 experts are built nowhere."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: shapes\nsamples: 1\nfixed: {device: cpu, backend: torch, precision: fp32, seq_len: 32,"
                     " n_layers: 2, n_heads: 4, vocab: 96}\n"
                     "grid: {model: [hf:llama, hf:qwen2_moe, hf:deepseek_v3], d_model: [64]}\n")
    from orchestrator.cli import main

    assert main(["sweep", str(sweep), "--dry-run", "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    text = " ".join(out.out.split())
    assert "hf:llama: the sweep set vocab=96 d_model=64 n_layers=2 n_heads=4; transformers' defaults: " \
           "intermediate_size=11008" in text
    assert "hf:qwen2_moe: the sweep set vocab=96 d_model=64 n_layers=2 n_heads=4; transformers' defaults: " \
           "intermediate_size=5632 moe_intermediate_size=1408 shared_expert_intermediate_size=5632 num_experts=60 " \
           "num_experts_per_tok=4" in text
    assert "num_experts_per_tok=4; as built: 2 MoE layers (decoder_sparse_step=1 mlp_only_layers=[])" in text
    line = next(line for line in out.out.splitlines() if "hf:deepseek_v3:" in line)
    assert "n_routed_experts=256" in line
    assert line.endswith("; as built: 2 dense layers, no MoE layer (first_k_dense_replace=3)"), line
    assert "intermediate_size=11008\n" in out.out  # a model without experts says nothing more


def test_the_built_models_moe_layers_are_counted_from_its_modules():
    """Past first_k_dense_replace the layers hold experts (a 3-D weight each): counted on the model built on the
    meta device, not read off the config."""
    facts = models.describe(spec("hf:deepseek_v3", d_model=64, n_heads=4, vocab=96, n_layers=4))
    assert facts.moe_layers == "3 dense layers, 1 MoE layer (first_k_dense_replace=3)"
    assert models.describe(spec("hf:mixtral", d_model=64, n_heads=4, vocab=96, n_layers=2)).moe_layers == "2 MoE layers"


def test_the_head_dim_rule_reads_the_models_head_dim(tmp_path):
    """A config.json whose own head_dim is 12 (d_model / n_heads unset in the spec, so the spec cannot see it)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "head_dim": 12,
                                                      "num_attention_heads": 4, "num_key_value_heads": 4,
                                                      "intermediate_size": 128, "num_hidden_layers": 1}))
    with pytest.raises(SpecError, match="the model's head dim must be a multiple of 8, got 12") as exc:
        check_model(TrialSpec(model=f"hf:{tmp_path}", backend="torch", vocab=96, seq_len=16))
    assert exc.value.field == "model"


def test_a_vocab_the_lm_head_does_not_take_is_one_line():
    """inkling2_text's LM head makes 200058 logits whatever vocab_size says (main: the trial ran on them)."""
    with pytest.raises(SpecError, match="vocab=96 does not reach the model: its LM head .* makes 200058 logits") as exc:
        check_model(spec("hf:inkling2_text", ffn=128))
    assert exc.value.field == "vocab" and "\n" not in str(exc.value)
