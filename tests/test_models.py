"""Your model, not ours (issue 32): transformers models by config and py: factories on the torch and torchao stacks,
on CPU at one tiny shape; the override mapping, converted and skipped modules, counted FLOPs, every bad input."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from trials import SpecError, TrialSpec, run_trial
from trials import backends, models
from trials.spec import check_model

pytest.importorskip("transformers")

FACTORIES = Path(__file__).resolve().parent / "fixtures" / "factories.py"
# One tiny shape for every test: dims that are multiples of 16 (torchao converts them), GQA (2 heads, 1 K/V head)
SHAPE = dict(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn=128, vocab=96)
RUN = dict(seq_len=16, batch_size=8, train_steps=10, lr=1e-2, warmup_steps=1, bench_steps=2, gen_len=2, prompt_len=4,
           profile=False, device="cpu")


def tiny(model: str, **kw) -> TrialSpec:
    return TrialSpec(model=model, **{**SHAPE, **RUN, **kw})


def falls(curve: list[float]) -> bool:
    """The last three steps' mean loss is clearly below the first three's (it learns the sequences)."""
    return sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.1


@pytest.mark.parametrize("model,backend,precision", [
    ("hf:llama", "torch", "fp32"),
    ("hf:qwen2", "torch", "bf16"),
    ("hf:mistral", "torchao", "fp8"),
])
def test_a_transformers_model_trains_on_each_stack_and_says_what_it_is(model, backend, precision):
    # the FP8 cell on half the rows: torch's CPU float8 matmul is a scalar loop (~36 ns a multiply-add), its cost
    # the GEMMs' size
    fp8 = {"recipe": "tensorwise", "batch_size": 4} if precision == "fp8" else {}
    spec = tiny(model, backend=backend, precision=precision, **fp8)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert (rec["model"], rec["effective_backend"], rec["effective_precision"]) == (model, backend, precision)
    assert rec["model_class"].endswith("ForCausalLM")
    config = json.loads(rec["model_config"])
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (64, 2, 2, 1, 128, 96)
    assert config["use_cache"] is False and config["max_position_embeddings"] >= 16
    assert rec["n_params"] == models.describe(spec).n_params > 0
    assert falls(rec["loss_curve"])
    assert rec["flops_method"] == "counted" and rec["flops_per_step"] > 6 * rec["n_params"] * 0.5 * 64
    if precision == "fp8":  # every block Linear in float8 (q, k, v, o, gate, up, down x 2 layers), the head kept
        assert rec["fp8_converted_modules"] == 14 and json.loads(rec["fp8_skipped_modules"]) == ["model.lm_head"]
        assert "model.model.layers.0.self_attn.q_proj" in json.loads(rec["fp8_converted_names"])
        # teacher-forced against torch-bf16 trained alike: FP8's rounding shows as a KL above 0
        assert 0 < rec["tf_top1_agreement"] <= 1 and rec["tf_kl_mean"] > 0 and rec["tf_s"] > 0
        assert 1 / 96 < rec["tf_bf16_top1_prob"] < 1 and 0 <= rec["tf_decided_share"] <= 1
        assert (rec["tf_top1_agreement_decided"] is None) == (rec["tf_decided_share"] == 0)
        # the per-layer FP8 reads (trials/measure/fp8_layers.py) read every converted Linear, the down projections too
        layers = json.loads(rec["fp8_layers"])
        assert layers["modules"] == json.loads(rec["fp8_converted_names"])
        assert all(math.isfinite(v) for d in ("fwd", "dgrad", "wgrad") for v in layers["sqnr"][d])
        assert "model.model.layers.1.mlp.down_proj" in layers["outliers"]["ratio"]
    else:
        assert rec["tf_top1_agreement"] is None


def test_a_py_factory_trains_and_its_probe_passes():
    spec = tiny("py:examples.my_model:build", n_kv_heads=None, backend="torchao", precision="fp8", recipe="tensorwise")
    check_model(spec)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert rec["model_class"] == "TinyLM" and rec["n_params"] == models.describe(spec).n_params
    # nn.MultiheadAttention's input projection is its own weight (in_proj_weight), not an nn.Linear: it stays BF16
    # and its out_proj is read by weight, never called (kept: models.common.read_by_parent)
    assert sorted(json.loads(rec["fp8_skipped_modules"])) == sorted(
        ["model.lm_head", *(f"model.blocks.{i}.self_attn{end}" for i in range(2) for end in ("", ".out_proj"))])
    assert rec["fp8_converted_modules"] == 4
    assert json.loads(rec["fp8_skipped_why"])["model.blocks.0.self_attn"].startswith("MultiheadAttention is not")
    # what ran in FP8 is counted: fc1 and fc2 of 2 blocks, fwd + dgrad + wgrad
    fp8 = 2 * 6 * 8 * 16 * (2 * 64 * 128)
    assert rec["fp8_flop_share"] * rec["flops_per_step"] == pytest.approx(fp8) and rec["effective_precision"] == "fp8"
    assert falls(rec["loss_curve"])


def test_the_shape_fields_override_the_config_and_the_rest_is_the_configs(tmp_path):
    from trials.models.hf import config

    cfg = config(tiny("hf:llama"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (64, 2, 2, 1, 128, 96, 32)
    # a bare type is transformers' full-size default: shape fields unset in the spec, the config's in the dry run
    bare = TrialSpec(model="hf:llama", backend="torch")
    assert (bare.d_model, bare.n_layers, bare.vocab, bare.n_heads, bare.ffn) == (None,) * 5
    facts = models.describe(bare)
    assert facts.shape["d_model"] == 4096 and facts.shape["n_layers"] == 32 and facts.n_params > 6e9
    from trials.measure import memory_plan

    assert memory_plan.plan(bare).total > 6e9 * 8  # bf16 weights, grads and two moments: over 48 GB before anything runs
    # a local config.json (as on the Hub): its values stand where the spec gives none; positions reach seq_len
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                                    "vocab_size": 128, "max_position_embeddings": 8, "torch_dtype": "bfloat16"}))
    for target in (str(cfg_file), str(tmp_path)):
        spec = TrialSpec(model=f"hf:{target}", backend="torch", seq_len=32, n_layers=2)
        check_model(spec)
        cfg = config(spec)
        assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                cfg.max_position_embeddings) == ("qwen2", 64, 2, 2, 32)
        built = models.build(spec, "fp32", "cpu")
        assert built.vocab == 128 and built.model(torch.zeros(2, 32, dtype=torch.long)).shape == (2, 32, 128)
    with pytest.raises(SpecError, match="BloomConfig has no intermediate_size or ffn_dim") as exc:  # 4 x hidden, fixed
        check_model(TrialSpec(model="hf:bloom", backend="torch", ffn=128))
    assert exc.value.field == "ffn"


def test_the_same_seed_builds_the_same_model_and_the_loss_is_the_harness_own():
    a, b = (models.build(tiny("hf:qwen2"), "fp32", "cpu") for _ in range(2))
    ids = torch.arange(32).view(2, 16) % 96
    assert torch.equal(a.model(ids), b.model(ids))  # seeded init: the FP8 cell and its BF16 partner start alike
    assert a.logits_layer == "model.lm_head"


def test_torchao_converts_the_linears_keeps_the_logits_layer_and_auto_applies_its_own_filter():
    dims = backends.build(tiny("hf:llama", backend="torchao", precision="fp8", recipe="rowwise"), "torchao", "fp8",
                          "cpu")
    assert dims.info["fp8_converted_modules"] == 14
    assert json.loads(dims.info["fp8_skipped_modules"]) == ["model.lm_head"]
    # torchao's own filter for rowwise keeps Linears with N <= 2048: at this size every one
    auto = backends.build(tiny("hf:llama", backend="torchao", precision="fp8", recipe="rowwise", fp8_filter="auto"),
                          "torchao", "fp8", "cpu")
    assert auto.info["fp8_converted_modules"] == 0 and len(json.loads(auto.info["fp8_skipped_modules"])) == 15
    with pytest.raises(SpecError, match="fp8_filter"):
        tiny("hf:llama", backend="torchao", precision="fp8", recipe="rowwise_with_gw_hp", fp8_filter="auto")


def test_teacher_forced_fp8_against_bf16_disagrees_somewhere_and_bf16_against_itself_not_at_all():
    """The same seeded init, as BF16 and as torchao FP8 (tensorwise): at init the next-token distributions are
    nearly flat, so FP8's rounding flips some argmaxes; BF16 read twice agrees everywhere with KL 0. Flat also
    means BF16 is decided nowhere: the agreement then measures rounding noise, and the fields say so."""
    from trials.workloads import teacher_forced

    spec = tiny("hf:llama", backend="torchao", precision="fp8", recipe="tensorwise", seq_len=64)
    held = teacher_forced.held_batch(96, 64, "cpu", spec.seed)
    bf16 = teacher_forced.log_probs(backends.build(spec, "torch", "bf16", "cpu").model, held)
    fp8 = teacher_forced.log_probs(backends.build(spec, "torchao", "fp8", "cpu").model, held)
    same = teacher_forced.compare(bf16, bf16.clone())
    assert (same["tf_top1_agreement"], same["tf_kl_mean"]) == (1.0, 0.0)
    differ = teacher_forced.compare(fp8, bf16)
    assert differ["tf_top1_agreement"] < 1 and differ["tf_kl_mean"] > 0
    assert differ["tf_bf16_top1_prob"] < 2 / 96 and differ["tf_decided_share"] == 0  # untrained: nearly flat
    assert differ["tf_top1_agreement_decided"] is None


def test_a_trained_bf16_partner_is_decided_and_agreement_there_is_fp8s_own():
    """Trained on the arithmetic sequences, BF16 predicts the next term with a clear margin at some positions:
    there the agreement is FP8's, and higher than over all positions, where near-ties flip (what the report
    reads instead of the all-position number when BF16 is undecided at most positions)."""
    from trials.workloads import teacher_forced
    from trials.workloads.data import ArithmeticSequences
    from trials.workloads.train_step import build_train_step, train

    # one layer of 16: torch's CPU float8 matmul is a scalar loop (~36 ns a multiply-add: 9 ms for 256x32x32), so
    # FP8 on CPU costs in proportion to the GEMMs. After 40 steps at lr 3e-2 BF16 is decided at half the
    # positions, agreement 0.875 there and 0.812 over all (one layer of 32, 60 steps at 1e-2: 0.5, 1.0 and 0.875,
    # at ~6x the CPU)
    spec = TrialSpec(d_model=16, n_layers=1, n_heads=2, vocab=96, seq_len=32, batch_size=8, lr=3e-2, train_steps=40,
                     backend="torchao", precision="fp8", recipe="tensorwise", device="cpu")
    held = teacher_forced.held_batch(96, 32, "cpu", spec.seed)
    read = {}
    for backend, precision in (("torch", "bf16"), ("torchao", "fp8")):  # the trial's FP8 cell and its partner
        step = build_train_step(spec, backend, precision, "cpu")
        train(step, ArithmeticSequences(96, 32, "cpu", spec.seed), spec.train_steps, spec.batch_size)
        read[precision] = teacher_forced.log_probs(step.model, held)
    tf = teacher_forced.compare(read["fp8"], read["bf16"])
    assert tf["tf_bf16_top1_prob"] > 0.2 and tf["tf_decided_share"] > 0.2, tf  # at init: ~1/96 and 0
    assert tf["tf_top1_agreement_decided"] >= tf["tf_top1_agreement"], tf


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_counted_flops_equal_the_minigpt_formula(arch):
    """The counter's GEMMs (2*m*n*k each, forward and twice backward) are the formula's 6*N_matmul*tokens exactly:
    both count the same multiply-adds and neither counts norms, softmax or element-wise work. Attention is the
    formula's causal term in both (the counter's own attention figure depends on the kernel, so it is left out),
    so the tolerance is float rounding only (1e-9 relative)."""
    from trials.measure.metrics import counted_flops_per_step, flops_per_step
    from trials.models.minigpt_net import MiniGPT, ModelConfig

    spec = TrialSpec(d_model=64, n_layers=2, n_heads=4, seq_len=16, arch=arch, vocab=96)
    cfg = ModelConfig.from_spec(spec)
    model = MiniGPT(cfg, torch.float32, "cpu")
    ids = torch.zeros(4, 16, dtype=torch.long)
    counted = counted_flops_per_step(model, ids, cfg.n_layers, cfg.d_model)
    assert counted == pytest.approx(flops_per_step(cfg, 4 * 16), rel=1e-9)
    assert all(p.grad is None for p in model.parameters())  # the count leaves no gradients behind


def test_the_flop_count_survives_grouped_query_attention_kernels():
    """torch 2.11's FlopCounterMode SDPA formulas assert on grouped-query shapes (32 query heads, 8 KV heads:
    every hf:llama cell on the H200 failed so); the count leaves attention to the formula, so the attention
    kernels count 0 and are never measured. CUDA's flash/efficient kernels, run on the meta device (the CPU
    kernel is not in the counter's registry; torch 2.13's formulas accept these shapes and count them)."""
    from trials.measure.metrics import gemm_flop_counter

    q, kv = torch.empty(2, 8, 64, 32, device="meta"), torch.empty(2, 2, 64, 32, device="meta")
    w = torch.empty(32, 32, device="meta")
    with gemm_flop_counter() as counter:
        torch.ops.aten._scaled_dot_product_efficient_attention(q, kv, kv, None, False)
        torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv)
        q @ w
    assert counter.get_total_flops() == 2 * 2 * 8 * 64 * 32 * 32  # the GEMM only


@pytest.mark.parametrize("model,field,message", [
    ("hf:lama", "model", "'lama' is not a model type of transformers .*close: hf:llama"),
    ("hf:t5", "model", "'t5' has no causal LM class"),
    ("hf:/nonexistent/config.json", "model", "no config file at /nonexistent/config.json"),
    ("hf:{tmp}/bad.json", "model", "cannot read .*bad.json as JSON"),
    ("py:no_such_module_here:build", "model", "no module no_such_module_here in .* nor installed"),
    ("py:examples.my_model:missing", "model", "has no missing"),
    (f"py:{FACTORIES}:not_callable", "model", "not_callable is a int, not callable"),
    (f"py:{FACTORIES}:returns_no_module", "model", "returned a dict, not an nn.Module"),
    (f"py:{FACTORIES}:raises", "model", "the factory raised RuntimeError: no weights for you"),
    (f"py:{FACTORIES}:wrong_shape", "model", r"gave logits of shape \(32, 96\); want \(batch, seq, vocab\)"),
    (f"py:{FACTORIES}:wrong_vocab", "model", r"gave logits of shape \(2, 16, 50\); want .* = \(2, 16, 96\)"),
    (f"py:{FACTORIES}:reads_ahead", "model", r"the model reads ahead: .* positions 0-7 moved by up to .* position 8"),
])
def test_a_model_that_cannot_be_built_is_one_line_naming_the_field(tmp_path, model, field, message):
    (tmp_path / "bad.json").write_text("{not json")
    spec = TrialSpec(model=model.replace("{tmp}", str(tmp_path)), backend="torch", vocab=96, seq_len=16)
    with pytest.raises(SpecError, match=message) as exc:
        check_model(spec)
    assert exc.value.field == field and "\n" not in str(exc.value)


@pytest.mark.parametrize("values,field,message", [
    (dict(model="llama"), "model", "must be minigpt, hf:<model_type>"),
    (dict(model="py:examples.my_model"), "model", "py: needs <module>:<callable>"),
    (dict(model="hf:llama", backend="te", te_layer="modules"), "te_layer",
     "model hf:llama takes swap or transformer_layer"),
    (dict(te_layer="swap"), "te_layer", "model minigpt takes transformer_layer or modules"),
    (dict(model="hf:llama", arch="llama"), "arch", "MiniGPT's architecture"),
])
def test_what_a_model_source_does_not_support_is_refused_by_the_spec(values, field, message):
    with pytest.raises(SpecError, match=message) as exc:
        TrialSpec(**values)
    assert exc.value.field == field


def test_without_transformers_the_cli_names_the_extra_in_one_line_and_exits_2(monkeypatch, capsys):
    """transformers made unimportable (``sys.modules`` entry None: import raises ImportError), the CLI's check."""
    from trials.cli import main
    from trials.models import hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    for cached in (hf._causal_types, hf._base, hf._config, hf._describe):
        cached.cache_clear()
    assert main(["--model", "hf:llama", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "model: hf: models need transformers, which is not installed: pip install 'juicytalk[hf]'" in err


def test_a_sweep_over_model_and_d_model_pairs_each_fp8_cell_with_its_own_models_bf16(ray_cluster, tmp_path):
    """The grid the issue names, through the real CLI and a real Ray cluster, tiny: the report pairs by structured
    fields, so hf:llama's FP8 cell meets hf:llama's BF16 cell of its d_model, never hf:qwen2's."""
    import pandas as pd

    from orchestrator.report.analysis import pair_cells, prepare
    from orchestrator.store import Store

    from .conftest import juicytalk

    sweep = tmp_path / "mine.yaml"
    sweep.write_text("""name: mine
grid: {model: [hf:llama, hf:qwen2], d_model: [32, 64], backend: [torch, torchao], precision: [bf16, fp8]}
fixed: {recipe: tensorwise, n_layers: 1, n_heads: 2, n_kv_heads: 1, ffn: 64, vocab: 96, seq_len: 16, batch_size: 2,
        train_steps: 2, warmup_steps: 1, bench_steps: 2, gen_len: 2, prompt_len: 4, profile: false, device: cpu}
resources: {cpu: 1, gpu: 0}
max_concurrent: 1
""")  # one trial at a time: one Tune worker and one trial process (transformers imported once), not one per node
    run = juicytalk("sweep", str(sweep), "--out", str(tmp_path), "--address", ray_cluster, "--no-progress")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "hf:llama: torchao-fp8-tensorwise vs torch-bf16" in run.stdout  # the model's name, not an emoji code
    records = Store(str(tmp_path), "mine").read_records().to_pylist()
    assert len(records) == 8 and all(r["status"] == "ok" for r in records), [r["error"] for r in records]
    pairs = pair_cells(prepare(pd.DataFrame(records)))
    speedups = pairs.rows[pairs.rows["kind"] == "fp8_speedup"]
    assert sorted(zip(speedups["model"], speedups["d_model"])) == [("hf:llama", 32), ("hf:llama", 64),
                                                                   ("hf:qwen2", 32), ("hf:qwen2", 64)]
    assert pairs.unpaired.empty
    assert (tmp_path / "mine" / "report.html").exists()


def test_an_fp8_cell_whose_stack_converted_nothing_is_recorded_as_bf16(caplog):
    """hf:gpt2's GEMMs are Conv1D, which torchao does not swap: nothing converts, no FLOP runs in FP8, so the cell
    is not an FP8 result: effective_precision bf16 (no recipe), a warning, and every Conv1D kept with why."""
    spec = tiny("hf:gpt2", n_kv_heads=None, ffn=None, n_layers=1, backend="torchao", precision="fp8",
                recipe="tensorwise", train_steps=2)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert (rec["effective_precision"], rec["effective_recipe"]) == ("bf16", None)
    assert rec["fp8_converted_modules"] == 0 and rec["fp8_flop_share"] == 0.0
    why = json.loads(rec["fp8_skipped_why"])
    assert list(why) == json.loads(rec["fp8_skipped_modules"])
    assert why["model.transformer.h.0.mlp.c_fc"].startswith("Conv1D is not an nn.Linear") and len(why) == 5
    assert any("ran in FP8" in r.message and "ran BF16" in r.message for r in caplog.records)
    # a BF16 result has no FP8 numerics: neither the per-layer reads and outlier samples nor the teacher-forced read
    assert rec["fp8_layers"] is None and rec["fp8_layers_s"] is None and rec["outliers_s"] is None
    assert rec["tf_top1_agreement"] is None


def test_moe_experts_grouped_gemms_are_counted_and_listed_as_kept_with_why():
    """hf:mixtral: transformers 5 runs its experts as aten._grouped_mm (torch 2.13, CPU too). The counter counts
    them (2*t*k*n forward, as much again for each of dgrad and wgrad), torchao keeps them in BF16 and says why
    (its float8 grouped GEMM needs token groups padded to 16 rows, which transformers' MoE does not do; and it is
    rowwise only), the routers too, and the share of FLOPs in FP8 is the attention projections' alone."""
    from trials.measure.metrics import count_flops

    spec = tiny("hf:mixtral", n_heads=4, n_kv_heads=2, ffn=256, backend="torchao", precision="fp8",
                recipe="tensorwise")
    built = backends.build(spec, "torchao", "fp8", "cpu")
    why = json.loads(built.info["fp8_skipped_why"])
    experts = [n for n in why if n.endswith("mlp.experts")]
    assert len(experts) == 2 and "rowwise recipe only" in why[experts[0]]
    assert "padded to a multiple of 16 rows" in why[experts[0]] and "transformers' MoE does not" in why[experts[0]]
    assert why["model.model.layers.0.mlp.gate"].startswith("MixtralTopKRouter is not an nn.Linear")
    assert built.info["fp8_converted_modules"] == 8  # q, k, v, o x 2 layers
    counted = count_flops(spec, built.model, 96, "cpu", 1)
    tokens, top_k = 8 * 16, 2
    grouped = 2 * 6 * tokens * top_k * (64 * 2 * 256 + 256 * 64)  # 2 layers, gate_up and down, fwd + dgrad + wgrad
    projections = 2 * 6 * tokens * 64 * (64 + 32 + 32 + 64)  # q, k, v, o x 2 layers: the FP8 GEMMs
    assert counted["flops_per_step"] > grouped + projections
    assert counted["fp8_flop_share"] == pytest.approx(projections / counted["flops_per_step"], rel=1e-9)


def test_grouped_gemms_count_as_gemms():
    """aten._grouped_mm (2D x 3D forward, 2D x 3D dgrad, 2D x 2D wgrad into 3D) is a GEMM for the counter and the
    kernel table alike; its FP8 form counts as an FP8 GEMM."""
    from trials.measure.kernels import classify
    from trials.measure.metrics import gemm_flop_counter

    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    offs = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
    with gemm_flop_counter() as counter:
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(32, 8))
    assert counter.get_total_flops() == 3 * 2 * 32 * 16 * 8
    assert (classify("aten::_grouped_mm"), classify("aten::_scaled_grouped_mm")) == ("gemm_bf16", "gemm_fp8")


def test_a_compiled_fp8_cells_bf16_partner_is_compiled_too():
    """Compiled kernels round differently from eager ones: an eager partner of a compiled torchao cell would
    credit compile's effect on the loss path to FP8 (teacher-forced KL, agreement). The partner compiles where
    its stack does; TE (which does not) and eager cells keep an eager partner."""
    from trials.workloads.teacher_forced import partner_spec

    cell = TrialSpec(backend="torchao", precision="fp8", recipe="rowwise", compile=True, device="cpu")
    assert partner_spec(cell, "torch").compile and partner_spec(cell, "torch").precision == "bf16"
    assert not partner_spec(cell.replace(compile=False), "torch").compile
    assert partner_spec(cell, "torch") == partner_spec(cell.replace(recipe="tensorwise"), "torch")  # one partner
