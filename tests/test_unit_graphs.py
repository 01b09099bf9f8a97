"""CUDA-graphed training on every model source and stack (trials/workloads/unit_graphs.py), the parts a CPU can check:
which cells the spec and a sweep take and which they refuse, in what line; how a unit's call becomes a graph's
inputs and back (the dispatcher, here with eager stand-ins where the graphs would be); what cannot be graphed and
the line the record gets; the record's fields; the memory plan's graph pool. The graphs themselves:
tests/test_gpu_graphs.py (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from trials import TrialSpec
from trials.record.fields import FIELDS, empty_record, validate
from trials.spec import SpecError

TINY = dict(d_model=64, n_layers=2, n_heads=4, vocab=96, seq_len=16, batch_size=2)
LLAMA = dict(model="hf:llama", n_kv_heads=2, ffn=128, **TINY)

# every model source and stack; TE both ways it takes a model; compiled units; torchao's FP8
GRAPHED = [dict(backend="te"), dict(backend="te", te_layer="modules", precision="fp8"), dict(backend="torch"),
           dict(backend="torch", compile=True), dict(backend="torchao", precision="fp8", recipe="rowwise"),
           dict(backend="torchao", precision="fp8", recipe="tensorwise", compile=True),
           dict(model="hf:llama", backend="te"), dict(model="hf:llama", backend="te", te_layer="transformer_layer",
                                                      precision="fp8"),
           dict(model="hf:llama", backend="torch", compile=True), dict(model="hf:llama", backend="torchao",
                                                                       precision="fp8", recipe="tensorwise"),
           dict(model="py:tests.fixtures.factories:named_units", backend="torch"),
           dict(model="py:tests.fixtures.factories:named_units", backend="te", grad_accum=2)]


@pytest.mark.parametrize("extra", GRAPHED)
def test_every_source_and_stack_takes_cuda_graphs_for_training(extra):
    """torchao and compiled cells were refused (torchao 'runs with compile: true instead', compile 'not with
    cuda_graphs'), and hf: and py: models graphed their decode only."""
    assert TrialSpec(cuda_graphs=True, device="cuda", **extra).cuda_graphs


@pytest.mark.parametrize("extra,field,line", [
    (dict(device="cpu"), "cuda_graphs", "cuda_graphs: needs a CUDA device"),
    (dict(model="hf:llama", device="cpu"), "cuda_graphs", "cuda_graphs: needs a CUDA device"),
    (dict(parallel="ddp", world_size=2), "cuda_graphs",
     "cuda_graphs: not with parallel ddp or fsdp (graphing collectives is not built)"),
    (dict(model="hf:llama", parallel="fsdp", world_size=2), "cuda_graphs",
     "cuda_graphs: not with parallel ddp or fsdp (graphing collectives is not built)"),
    (dict(activation_checkpointing="full"), "activation_checkpointing",
     "activation_checkpointing: not with cuda_graphs (a captured backward cannot recompute its forward); use one "
     "of them"),
    (dict(workload="infer", backend="torch", compile=True), "compile",
     "compile: infer runs eager or CUDA-graphed decode; use compile: false"),
])
def test_what_cuda_graphs_cannot_train_is_refused_in_one_line(extra, field, line):
    with pytest.raises(SpecError) as exc:
        TrialSpec(cuda_graphs=True, **{"device": "cuda", **extra})
    assert exc.value.field == field and str(exc.value) == line


def test_cuda_graphs_on_the_cpu_is_one_line_and_exit_2(capsys):
    from trials.cli import main

    assert main(["--cuda-graphs", "--device", "cpu", "--model", "hf:llama"]) == 2
    err = capsys.readouterr().err
    assert err == "python -m trials: error: cuda_graphs: needs a CUDA device\n"


def test_a_sweep_makes_graphed_torchao_and_compiled_cells_instead_of_skipping_them(tmp_path):
    """A grid over torchao and compile with cuda_graphs: every combination is a cell (they were skipped: 'runs with
    compile: true, not cuda_graphs', 'two ways to graph the step')."""
    from orchestrator.sweep import load_sweep

    path = tmp_path / "g.yaml"
    path.write_text("name: g\ngrid:\n  - {backend: [torch], compile: [false, true], cuda_graphs: [true]}\n"
                    "  - {backend: [torchao], precision: [fp8], recipe: [tensorwise], compile: [false, true], "
                    "cuda_graphs: [true]}\nfixed: {d_model: 64, n_layers: 2, device: cuda}\n")
    sweep = load_sweep(path)
    assert not sweep.skipped, sweep.skipped
    assert sorted(c.label for c in sweep.cells) == ["d64-L2-torch-bf16-graphs", "d64-L2-torch-bf16-graphs-compiled",
                                                    "d64-L2-torchao-fp8-tensorwise-graphs",
                                                    "d64-L2-torchao-fp8-tensorwise-graphs-compiled"]


def _built(model: str, **extra):
    from trials import models

    spec = TrialSpec(model=model, device="cuda", cuda_graphs=True, **{**TINY, **extra})
    made = models.build(spec, "fp32", "cpu")
    return spec, made.model, made.units


def test_a_units_call_replays_through_its_inputs_and_gives_the_eager_forward_and_gradients():
    """A transformers decoder layer is called with keywords (RoPE's cos and sin as a pair, the position ids, mask and
    cache arguments): the dispatcher hands a graph its tensors alone, in order, and the stand-in puts them back, so
    the model computes what it computes eager, to the bit, gradients too; a call of another shape inside a graphed
    step is refused in words, while outside one (generation, the reads) the units run eager at any shape."""
    from trials.workloads.unit_graphs import Mismatch, UnitGraphs, _Positional, record_calls, refusal

    _, model, units = _built("hf:llama", n_kv_heads=2, ffn=128)
    assert units == ("model.model.layers.0", "model.model.layers.1") and refusal(model, units) == ""
    x = torch.randint(0, 96, (2, 16))
    ran, calls, why = record_calls(model, units, x)
    assert why == "" and ran == units and [len(c.samples) for c in calls] == [4, 4]  # hidden states, cos, sin, ids
    assert [c.samples[0].requires_grad for c in calls] == [True, True] and not calls[0].samples[1].requires_grad
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stand_ins = tuple(_Positional(model.get_submodule(n), c) for n, c in zip(units, calls))
    graphs = UnitGraphs(model, units, calls, stand_ins, cache_weights=False)
    with graphs.replaying(None):
        out = model(x)
    out.sum().backward()
    assert graphs.replayed == {0, 1} and torch.equal(out, eager)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    with pytest.raises(Mismatch, match=r"unit model.model.layers.0: tensors \[\(\(3, 16, 64\)"), graphs.replaying(None):
        model(torch.randint(0, 96, (3, 16)))
    assert model(torch.randint(0, 96, (3, 16))).shape == (3, 16, 96)


def test_units_named_out_of_order_are_captured_in_the_order_the_forward_runs_them():
    """A model source may name its units in any order (a py: factory's ``fsdp_units``); their graphs share one
    memory pool, sound only where they replay in the order they were captured: the capture takes the forward's
    order, each unit with its own call (the first to run is handed the embeddings)."""
    from trials.workloads.unit_graphs import record_calls

    _, model, units = _built("hf:llama", n_kv_heads=2, ffn=128)
    x = torch.randint(0, 96, (2, 16))
    ran, calls, why = record_calls(model, tuple(reversed(units)), x)
    assert why == "" and ran == units
    with torch.no_grad():
        assert torch.equal(calls[0].samples[0], model.model.model.embed_tokens(x))


@pytest.mark.parametrize("factory,why", [
    ("no_units", "the model has no units (decoder layers) to graph one by one"),
    ("moe_units", "unit model.body.0 holds MoE experts (model.body.0.1): its router sends a data-dependent number of "
                  "tokens to each expert, which a CUDA graph cannot replay"),
    ("reused_unit", "unit model.layer runs 2 times in one forward: a graph replays its unit's one call, into one set "
                    "of buffers"),
])
def test_a_model_whose_units_cannot_be_graphed_trains_eager_and_says_why(factory, why):
    """The step's capture returns the line, with nothing graphed (no CUDA touched), and the step trains eager."""
    from trials.workloads.train_step import build_train_step

    spec = TrialSpec(model=f"py:tests.fixtures.factories:{factory}", device="cuda", cuda_graphs=True,
                     backend="torch", d_model=32, vocab=96, n_layers=2, seq_len=16, batch_size=2)
    step = build_train_step(spec, "torch", "fp32", "cpu")
    x = torch.randint(0, 96, (2, 16))
    facts = step.capture(x, whole=spec.source.graphs_whole)
    assert facts.graphs_per_step == 0 and not step.graphed
    assert facts.why.startswith(why) and facts.why.endswith("; the step ran eager")
    record = {**empty_record(), **facts.record()}
    validate(record)
    assert record["cuda_graphs_why"] == facts.why and record["graph_capture_s"] is None
    assert torch.isfinite(step(x, torch.roll(x, -1, 1)))


def test_the_graph_fields_are_declared_once_with_their_types():
    from trials.workloads.unit_graphs import GraphFacts

    types = {f.name: f.type for f in FIELDS}
    assert {k: types[k] for k in ("graphs_per_step", "graph_capture_s", "graph_pool_bytes", "graph_pool_free_bytes",
                                  "est_graph_pool_bytes", "cuda_graphs_why")} == {
        "graphs_per_step": "int", "graph_capture_s": "float", "graph_pool_bytes": "int", "graph_pool_free_bytes": "int",
        "est_graph_pool_bytes": "int", "cuda_graphs_why": "str"}
    validate({**empty_record(), **GraphFacts(64, 1.5, 3 << 30, 1 << 30, "32 units graphed").record()})


@pytest.mark.parametrize("model,extra", [("hf:llama", dict(n_kv_heads=2, ffn=128)),
                                         ("py:tests.fixtures.factories:named_units", {})])
def test_the_memory_plan_of_a_unit_graphed_cell_holds_the_pool(model, extra):
    """The units' saved bytes and gradient buffers move into the graphs' pool, both at once, with each graph's static
    inputs and outputs; what stays eager is the root's. The peak adds the pool, whose gradient buffers are the
    gradients, but under accumulation (kept allocated apart)."""
    from trials.measure import memory_plan

    graphed = TrialSpec(model=model, device="cuda", cuda_graphs=True, backend="torch", **{**TINY, **extra})
    eager = memory_plan.plan(graphed.replace(cuda_graphs=False))
    plan = memory_plan.plan(graphed)
    probe = memory_plan.probe(graphed)
    assert eager.graph_pool == 0 and plan.graph_pool > 0 and not plan.guess
    assert plan.activations == sum(probe.activations.outside.values()) < eager.activations
    # the units' saves and their gradients' buffers are in the pool together (the allocator reuses little of one
    # for the other: H100, Llama-3-8B's shape, measured 0.62-1.03 of the sum and 1.1-2.2x the larger alone)
    assert plan.graph_pool > (eager.activations - plan.activations) + (probe.weight_bytes - probe.outside_weight_bytes)
    assert plan.grads == probe.outside_weight_bytes < eager.grads and plan.logits == eager.logits
    assert plan.total == (plan.weights + plan.optimizer + plan.graph_pool
                          + max(plan.activations + plan.logits, plan.grads))
    split = memory_plan.plan(graphed.replace(grad_accum=2))
    assert split.graph_pool == plan.graph_pool and split.grads == eager.grads
    fields = memory_plan.record_fields(graphed)
    assert fields["est_graph_pool_bytes"] == plan.graph_pool and fields["est_peak_mem_bytes"] == plan.total
    assert memory_plan.record_fields(graphed.replace(cuda_graphs=False))["est_graph_pool_bytes"] is None


def test_the_memory_plan_of_minigpts_whole_graph_holds_its_logits_in_the_pool():
    from trials.measure import memory_plan

    graphed = TrialSpec(device="cuda", cuda_graphs=True, backend="torch", **TINY)
    eager, plan = memory_plan.plan(graphed.replace(cuda_graphs=False)), memory_plan.plan(graphed)
    logits = graphed.batch_size * graphed.seq_len * graphed.vocab
    assert plan.logits == logits * memory_plan.LOGITS_BYTES < eager.logits  # the bf16 logits are the graph's output
    assert plan.graph_pool >= 2 * logits * 2 + eager.grads + eager.activations - plan.activations and plan.grads == 0
    assert plan.activations == memory_plan.loss_saved_bytes(graphed.batch_size, graphed.seq_len, graphed.vocab, 2)


def test_the_graphed_full_depth_studys_dry_run_plans_each_graphed_cell_beside_its_eager_one(tmp_path):
    """examples/full-depth-graphs.yaml's own check, in a new user's shell: its 16 cells, each graphed one's estimate
    above its eager twin's by what its graphs hold (the pool's static buffers), and on this CPU each graphed cell
    recorded as unsupported in the spec's words."""
    from .conftest import juicytalk, user_env

    out = juicytalk("sweep", "examples/full-depth-graphs.yaml", "--dry-run", "--out", str(tmp_path / "out"),
                    env=user_env(tmp_path / "home"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "16 trials" in " ".join(out.stdout.split())
    est = {cells[1].strip(): float(cells[4].split()[0]) for line in out.stdout.splitlines()
           if len(cells := line.split("│")) > 5 and cells[1].strip().startswith("hf:llama")}
    graphed = [label for label in est if "-graphs" in label]
    assert len(graphed) == 8 and all(est[g] > est[g.replace("-graphs", "")] for g in graphed), est
    unsupported = [line for line in out.stdout.splitlines()
                   if line.startswith("unsupported here") and "-graphs" in line]
    assert len(unsupported) == 8 and all("cuda_graphs needs a CUDA device" in line for line in unsupported)
