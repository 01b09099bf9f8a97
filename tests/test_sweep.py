"""Sweep files: expansion, collapse/skip, and one clear error (key and line) for bad input."""

import textwrap

import pytest

from orchestrator.sweep import SweepError, cell_id, parse_sweep
from trials import TrialSpec

from .conftest import REPO, _free_port, juicytalk


def sweep(text: str):
    return parse_sweep(textwrap.dedent(text), source="s.yaml")


def test_expansion_collapses_and_skips_explicitly():
    s = sweep("""
        name: seed
        grid:
          backend: [te, torch]
          precision: [bf16, fp8]
          recipe: [delayed, current]
        fixed: {d_model: 256}
        samples: 2
    """)
    labels = sorted(c.label for c in s.cells)
    assert labels == ["d256-L4-te-bf16", "d256-L4-te-fp8-current", "d256-L4-te-fp8-delayed", "d256-L4-torch-bf16"]
    assert len(s.skipped) == 2 and all("torch" in why for _, why in s.skipped)
    assert len(s.collapsed) == 2 and all("recipe" in why for _, why in s.collapsed)
    assert s.samples == 2 and len({c.cell_id for c in s.cells}) == 4


def test_list_of_grids_is_a_union_without_duplicates():
    s = sweep("""
        name: u
        grid:
          - {d_model: [64, 128], precision: [bf16]}
          - {d_model: [128, 256], precision: [bf16]}
    """)
    assert sorted(c.spec.d_model for c in s.cells) == [64, 128, 256]
    assert len(s.collapsed) == 1


def test_cell_id_is_stable_and_complete():
    a = TrialSpec(d_model=256)
    assert cell_id(a) == cell_id(TrialSpec.from_dict(a.to_dict()))
    assert cell_id(a) != cell_id(a.replace(seed=1))


@pytest.mark.parametrize("text,key,line", [
    ("name: x\ngrid: {d_model: [64]}\nsampels: 2\n", "sampels", 3),
    ("name: x\ngrid:\n  d_modle: [64]\n", "grid.d_modle", 3),
    ("name: x\ngrid:\n  d_model: 64\n", "grid.d_model", 3),
    ("name: x\ngrid:\n  d_model: ['big']\n", "grid.d_model", 3),
    ("name: x\ngrid:\n  precision: [bf16, fp4]\n", "grid.precision", 3),
    ("name: x\ngrid: {d_model: [64]}\nfixed:\n  n_layers: [2, 4]\n", "fixed.n_layers", 4),
    ("name: x\ngrid: {d_model: [64]}\nresources: {gpu: 0.5}\n", "resources.gpu", 3),
    ("name: x\ngrid: {d_model: [64]}\nresources: {gpu: 2}\n", "resources.gpu", 3),  # one GPU per trial
    ("name: x\ngrid: {d_model: [64]}\nsamples: 0\n", "samples", 3),
    ("name: ../../etc\ngrid: {d_model: [64]}\n", "name", 1),
    ("name: x\ngrid: {d_model: [64]}\nname: y\n", "name", 3),
    ("name: x\ngrid:\n  d_model: [100, 128]\n  precision: [fp8]\n", "grid.d_model", 3),
    ("name: x\ngrid: {d_model: [64]}\nmax_concurrent: -1\n", "max_concurrent", 3),
    ("name: x\ngrid: [d_model\n", "yaml", 3),
    ("name: x\ngrid:\n  - d_model: [64]\n    precision: [bf16, fp4]\n", "grid.0.precision", 4),
    ("name: x\ngrid:\n  - {d_model: [64]}\n  - d_model: [100, 128]\n    precision: [fp8]\n", "grid.1.d_model", 4),
    ("name: x\ngrid:\n  precision: [fp8]\n  weights: [bf16, fp8]\n", "grid.weights", 4),  # fp8 weights, training
    ("name: x\ngrid:\n  gen_len: [8, 300]\nfixed:\n  workload: infer\n", "grid.gen_len", 3),
    ("name: x\ngrid:\n  arch: [llama]\n  n_kv_heads: [5]\nfixed:\n  n_heads: 12\n", "grid.n_kv_heads", 4),
    # a recipe no stack has is a typo, never a skipped cell; a grid whose every combination is skipped is bad too
    ("name: x\ngrid:\n  backend: [te]\n  precision: [fp8]\n  recipe: [delayd]\n", "grid.recipe", 5),
    ("name: x\ngrid: {backend: [te], precision: [fp8]}\nfixed:\n  recipe: delayd\n", "fixed.recipe", 4),
    ("name: x\ngrid:\n  - {d_model: [64]}\n  - {backend: [te], precision: [fp8], recipe: [tensorwise]}\n", "grid.1", 4),
])
def test_errors_name_key_and_line(text, key, line):
    with pytest.raises(SweepError) as info:
        parse_sweep(text, source="s.yaml")
    assert info.value.key == key, str(info.value)
    assert info.value.line == line, str(info.value)
    assert str(info.value).startswith(f"s.yaml, line {line}: {key}: ")


def test_recipe_typos_name_close_matches_and_other_stacks_recipes_collapse():
    with pytest.raises(SweepError, match=r"'delayd' is no stack's FP8 recipe \(did you mean delayed\?\)"):
        sweep("""
            name: typo
            grid: {backend: [te], precision: [fp8], recipe: [delayd]}
        """)
    with pytest.raises(SweepError, match="leaves no cell to run: backend=te precision=fp8 recipe=tensorwise: recipe "
                       "tensorwise is a torchao recipe, not te's"):
        sweep("""
            name: cross
            grid: {backend: [te], precision: [fp8], recipe: [tensorwise]}
        """)
    s = sweep("""
        name: mixed
        grid: {backend: [te, torchao], precision: [fp8], recipe: [delayed, tensorwise]}
    """)
    assert sorted(c.label for c in s.cells) == ["d768-L4-te-fp8-delayed", "d768-L4-torchao-fp8-tensorwise"]
    assert len(s.skipped) == 2


def test_yaml_exponent_floats_and_named_name_errors():
    """YAML 1.1 reads 1e-3 as a string; a sweep file reads it as the number every user means."""
    s = sweep("""
        name: lrs
        grid: {lr: [1e-3, 2.5E-4, 1.0e-2]}
    """)
    assert sorted(c.spec.lr for c in s.cells) == [0.00025, 0.001, 0.01]
    with pytest.raises(SweepError, match=r"name: 'my sweep' has ' ' in it"):
        sweep("""
            name: my sweep
            grid: {d_model: [64]}
        """)


def test_nothing_from_the_file_is_executed():
    with pytest.raises(SweepError):
        parse_sweep("name: x\ngrid: !!python/object/apply:os.system ['touch /tmp/pwned']\n")


def test_cli_bad_sweep_exits_2_with_one_line_and_starts_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ngrid:\n  d_model: [64]\n  precision: [bf16, fp16]\n")
    out = juicytalk("sweep", str(bad), "--out", str(tmp_path / "out"), timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 4" in lines[0] and "grid.precision" in lines[0] and "fp16" in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_sweep_at_an_address_where_no_ray_answers_is_one_line(tmp_path):
    """Ray itself retries a GCS that does not answer for many minutes; a stopped cluster is bad input."""
    address = f"127.0.0.1:{_free_port()}"
    out = juicytalk("sweep", "examples/quickstart.yaml", "--out", str(tmp_path), "--no-progress", "--address", address,
                    timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert f"--address {address}: no Ray cluster answers there" in lines[0]
    assert not list(tmp_path.rglob("*.parquet"))


def test_cli_ray_client_address_without_ray_client_is_one_line_before_any_folder(tmp_path):
    import importlib.util

    if importlib.util.find_spec("grpc") is not None:
        pytest.skip("ray[client] is installed here")
    out = juicytalk("sweep", "examples/quickstart.yaml", "--out", str(tmp_path / "out"), "--no-progress",
                    "--address", "ray://127.0.0.1:10001", timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "ray://127.0.0.1:10001" in lines[0] and "pip install 'ray[client]'" in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_dry_run_lists_cells_sizes_and_skips(tmp_path):
    out = juicytalk("sweep", "examples/seed.yaml", "--dry-run", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "d768-L4-te-fp8-delayed" in text and "28.7M" in text and "skipped" in text and "collapsed" in text
    assert "4 trials" in text
    # on this CPU machine every te cell would be recorded unsupported: the plan says so, with the reason
    unsupported = [line for line in out.stdout.splitlines() if line.startswith("unsupported here")]
    assert len(unsupported) == 3 and all("backend te: no CUDA device" in line for line in unsupported), unsupported
    assert not (tmp_path / "seed").exists()


def test_cli_dry_run_flags_cells_expected_to_oom(tmp_path):
    out = juicytalk("sweep", "examples/llama-shapes.yaml", "--dry-run", "--gpu-memory", "48", "--out", str(tmp_path),
                    timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    # what the published H200 run measured (docs/results/h200/llama-shapes, peak allocated): the 70B layers 49.5-60.7
    # GiB, the 8B layers at depth 4 47.4-48.1 GiB: over 48 GiB, or at it; at depth 2 and the 1B layers: well under
    flagged = [line for line in out.stdout.splitlines() if line.startswith(("expected OOM", "will not fit"))]
    assert len(flagged) == 9 and all("> 48 GiB" in line and "fits with" in line for line in flagged), flagged
    # the 70B layers at depth 2 (measured 60.7 GiB) are estimated at 68.9-72.1 GiB: over 1.4 x 48 GiB, beyond the
    # plan's error, so a real sweep refuses them; the rest (estimates 54.7-59.6 GiB) may fit and run
    assert {line.split(":")[0] for line in flagged} == {
        f"{'will not fit' if shape == 'd8192-L2' else 'expected OOM'} llama-{shape}-te-{v}"
        for shape in ("d8192-L1", "d8192-L2", "d4096-L4") for v in ("bf16", "fp8-delayed", "fp8-current")}
    assert "GPU memory 48 GiB" in text


def test_cell_ids_of_published_results_are_stable():
    """Ids from docs/results/h200 (made before axes were declared) still come out the same, so old
    results resume and --compare; a field added later with its default leaves every id alone."""
    from orchestrator.sweep import _DEFAULTS, cell_id, spec_id
    from trials.spec import TrialSpec

    pinned = {  # id in the study -> the fields that differ between its cells
        "c472abb3ebfc": dict(d_model=2048, backend="te", precision="bf16"),
        "0657341db4b1": dict(d_model=2048, backend="te", precision="fp8", recipe="delayed"),
        "bbff8232dcc4": dict(d_model=2048, backend="te", precision="fp8", recipe="current"),
    }
    study = dict(n_layers=4, train_steps=20, warmup_steps=5, bench_steps=10, repeats=3, gen_len=8)
    for expected, fields in pinned.items():
        assert cell_id(TrialSpec(**study, **fields)) == expected
    values = TrialSpec(**study, d_model=2048, backend="te").to_dict()
    assert spec_id({**values, "te_layer": "transformer_layer"}, {**_DEFAULTS, "te_layer": "transformer_layer"}) \
        == spec_id(values, _DEFAULTS) == "c472abb3ebfc"
    assert spec_id({**values, "te_layer": "modules"}, {**_DEFAULTS, "te_layer": "transformer_layer"}) != "c472abb3ebfc"


def test_fp8_settings_name_their_own_cells():
    s = sweep("""
        name: knobs
        grid:
          precision: [fp8]
          fp8_format: [hybrid, e4m3]
          amax_history_len: [16, 1024]
    """)
    assert sorted(c.label for c in s.cells) == ["d768-L4-auto-fp8-delayed", "d768-L4-auto-fp8-delayed-e4m3",
                                                "d768-L4-auto-fp8-delayed-e4m3-hist1024",
                                                "d768-L4-auto-fp8-delayed-hist1024"]


def test_the_amax_history_names_delayed_scaling_cells_only():
    """Current scaling (and block, MX) reads no amax history: a current cell at hist1024 ran the very recipe of
    the one at 16, so it is collapsed into it, not recorded as a setting whose differences are noise."""
    s = sweep("""
        name: knobs
        grid:
          precision: [fp8]
          recipe: [delayed, current]
          amax_history_len: [16, 1024]
    """)
    assert sorted(c.label for c in s.cells) == ["d768-L4-auto-fp8-current", "d768-L4-auto-fp8-delayed",
                                                "d768-L4-auto-fp8-delayed-hist1024"]
    assert [why for asked, why in s.collapsed if asked["recipe"] == "current"], s.collapsed


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_every_example_sweep_validates(path):
    from orchestrator.sweep import load_sweep

    loaded = load_sweep(REPO / "examples" / path)
    assert loaded.cells or loaded.search  # a grid, or a search block (examples/crossover.yaml)
    labels = [c.label for c in loaded.cells]
    assert len(set(labels)) == len(labels)  # a label tells its cell apart


def test_labels_show_every_axis_that_tells_cells_apart():
    """examples/inference.yaml has two d2048-L4-te-bf16-graphs cells (batch 1 and 32): each label says which,
    and a worker rebuilding the item from its Tune config gets the same label."""
    from orchestrator.sweep import load_sweep
    from orchestrator.work import WorkItem, grid_items

    s = load_sweep(REPO / "examples" / "inference.yaml")
    labels = [c.label for c in s.cells]
    assert "d2048-L4-te-bf16-graphs-b1" in labels and "d2048-L4-te-bf16-graphs-b32" in labels
    for item in grid_items(s.cells, 1):
        assert WorkItem.from_config(item.config()).label == item.label
    plain = sweep("""
        name: plain
        grid: {d_model: [64, 128], precision: [bf16, fp32]}
        fixed: {batch_size: 8, seq_len: 64}
    """)  # fixed fields and the axes cell_label already shows add nothing
    assert sorted(c.label for c in plain.cells) == ["d128-L4-auto-bf16", "d128-L4-auto-fp32", "d64-L4-auto-bf16",
                                                    "d64-L4-auto-fp32"]


def test_te_layer_applies_to_te_cells_only_and_arch_labels_cells():
    s = sweep("""
        name: layers
        grid:
          arch: [gpt, llama]
          backend: [te, torch]
          te_layer: [transformer_layer, modules]
        fixed: {d_model: 512, n_heads: 8}
    """)
    labels = sorted(c.label for c in s.cells)
    assert labels == ["d512-L4-te-bf16", "d512-L4-te-bf16-modules", "d512-L4-torch-bf16",
                      "llama-d512-L4-te-bf16", "llama-d512-L4-te-bf16-modules", "llama-d512-L4-torch-bf16"]
    assert len(s.collapsed) == 2 and all("te_layer" in why for _, why in s.collapsed)


def test_two_fp8_stacks_expand_to_their_own_recipes_and_compile_where_it_applies():
    """te and torchao recipes never cross; torchao without FP8 is the twin; compile collapses on te."""
    s = sweep("""
        name: stacks
        grid:
          backend: [te, torch, torchao]
          precision: [bf16, fp8]
          recipe: [delayed, tensorwise]
          compile: [false, true]
        fixed: {d_model: 256}
    """)
    labels = sorted(c.label for c in s.cells)
    assert labels == ["d256-L4-te-bf16", "d256-L4-te-fp8-delayed", "d256-L4-torch-bf16", "d256-L4-torch-bf16-compiled",
                      "d256-L4-torchao-fp8-tensorwise", "d256-L4-torchao-fp8-tensorwise-compiled"]
    reasons = [why for _, why in s.skipped]
    assert "recipe tensorwise is a torchao recipe, not te's" in reasons
    assert "recipe delayed is a te recipe, not torchao's" in reasons
    assert any("torch has no FP8 path" in why for why in reasons)
    te = [c for c in s.cells if c.spec.backend == "te"]
    assert all(not c.spec.compile for c in te)  # compile means nothing on te: collapsed, never run twice
    assert all(c.spec.backend != "torchao" or c.spec.precision == "fp8" for c in s.cells)


def test_plan_and_summary_tables_keep_labels_whole_in_80_columns(tmp_path):
    """Short labels stay a table, never folded or cut with '…'; labels too long for a table of 80 columns
    come as plain lines, each label whole."""
    import io

    from rich.console import Console

    from orchestrator.plan import plan_rows, plan_table
    from orchestrator.progress import summary_table
    from orchestrator.store import Store
    from orchestrator.sweep import load_sweep
    from orchestrator.tables import print_table
    from orchestrator.work import grid_items

    for example, boxed in (("quickstart.yaml", True), ("multi-gpu.yaml", False)):
        s = load_sweep(REPO / "examples" / example)
        items = grid_items(s.cells, 1)
        console = Console(width=80, file=io.StringIO())
        print_table(console, plan_table(s, plan_rows(s, Store(str(tmp_path), s.name)), 80 * 2**30))
        print_table(console, summary_table(items, {it.key: "error" for it in items}))
        text = console.file.getvalue()
        assert all(text.count(c.label + " ") >= 2 for c in s.cells), text
        assert ("┃" in text) == boxed


def test_cpu_cells_are_checked_against_host_memory_and_pace(tmp_path):
    """On a machine without a GPU a cell runs on CPU: its estimate is held against the host's RAM, and a
    cell needing hours even at the host's best matmul pace says so."""
    from orchestrator.plan import expected_ooms, plan_rows, plan_table, slow_on_cpu
    from orchestrator.store import Store

    s = sweep("""
        name: big
        grid: {d_model: [256, 8192], backend: [torch]}
    """)
    rows = plan_rows(s, Store(str(tmp_path), s.name), cpu_here=True)
    gib = 2**30
    assert expected_ooms(rows, None, 24 * gib) == ["d8192-L4-torch-bf16: estimated 26.3 GiB > 24 GiB of host memory"]
    slow = slow_on_cpu(rows, flops_per_s=100e9)
    assert len(slow) == 1 and slow[0].startswith("d8192-L4-torch-bf16: at least ")
    assert "host memory 24 GiB" in plan_table(s, rows, None, 24 * gib).title
    on_gpu = plan_rows(s, Store(str(tmp_path), s.name), cpu_here=False)  # a GPU machine: the GPU's memory counts
    assert expected_ooms(on_gpu, 80 * gib, 24 * gib) == [] and slow_on_cpu(on_gpu, 100e9) == []


def test_a_fixed_field_that_applies_to_no_cell_is_refused_and_one_that_applies_to_some_is_listed():
    """fixed: {compile: true} on cells of backend auto (TE's) ran them eager and exit 0; TrialSpec alone refuses it."""
    with pytest.raises(SweepError) as info:
        sweep("""
            name: c
            fixed: {compile: true}
            grid: {d_model: [256, 512]}
        """)
    assert info.value.key == "fixed.compile" and "torch.compile applies to backend torch or torchao" in str(info.value)
    with pytest.raises(SweepError) as info:  # no spec rule refuses these: the field's scope says why
        sweep("""
            name: c
            fixed: {fp8_format: e4m3, amax_history_len: 1024}
            grid: {d_model: [256]}
        """)
    assert info.value.key == "fixed.fp8_format" and "fp8 cells" in str(info.value)
    with pytest.raises(SweepError) as info:  # a grid key none of its cells takes is the same mistake
        sweep("""
            name: c
            grid: {precision: [bf16], fp8_format: [hybrid, e4m3]}
        """)
    assert info.value.key == "grid.fp8_format"
    s = sweep("""
        name: c
        fixed: {recipe: current, compile: false}
        grid: {precision: [bf16, fp8], backend: [te]}
    """)  # recipe means something on the fp8 cell only (the design); compile: false is every te cell's default
    assert sorted(c.label for c in s.cells) == ["d768-L4-te-bf16", "d768-L4-te-fp8-current"]
    assert [key for key, _ in s.not_applied] == ["fixed.recipe=current"]
    assert "1 of 2 cells" in s.not_applied[0][1] and "d768-L4-te-bf16" in s.not_applied[0][1]


def test_one_trial_is_one_cell_whatever_way_it_is_written():
    """lr 1 and 1.0, batch_size 4 and tokens_per_step 1024 (seq_len 256), n_kv_heads null and n_heads: one trial
    each."""
    one = sweep("name: a\ngrid: {lr: [1]}\n").cells[0]
    assert one.cell_id == sweep("name: a\ngrid: {lr: [1.0]}\n").cells[0].cell_id and one.label == "d768-L4-auto-bf16"
    with pytest.raises(SweepError, match="grid.lr: has repeated values"):
        sweep("name: a\ngrid: {lr: [1, 1.0]}\n")
    with pytest.raises(SweepError) as info:  # batch_size: 32 is its default, but it was given
        sweep("name: a\nfixed: {batch_size: 32, tokens_per_step: 1024}\ngrid: {d_model: [256]}\n")
    assert info.value.key == "fixed.tokens_per_step" and "not both" in str(info.value)
    by_batch = sweep("name: a\ngrid: {batch_size: [4]}\n").cells[0]
    s = sweep("name: a\ngrid:\n  - {batch_size: [4]}\n  - {tokens_per_step: [1024]}\n")
    assert [c.cell_id for c in s.cells] == [by_batch.cell_id]  # the first way it was written keeps its id
    [(asked, why)] = s.collapsed
    assert asked == {"tokens_per_step": 1024} and "the same trial as batch_size=4" in why
    s = sweep("name: a\nfixed: {arch: llama}\ngrid: {n_kv_heads: [null, 12]}\n")
    assert len(s.cells) == 1 and s.cells[0].spec.n_kv_heads is None and len(s.collapsed) == 1
    assert cell_id(TrialSpec(arch="llama", n_kv_heads=12)) == cell_id(TrialSpec(arch="llama"))
    assert cell_id(TrialSpec(arch="llama", n_kv_heads=4)) != cell_id(TrialSpec(arch="llama"))


def test_seed_on_the_grid_with_samples_that_would_run_one_seed_twice_is_refused():
    with pytest.raises(SweepError) as info:  # seed 1234's sample 1 is seed 1235: one trial under two keys
        sweep("name: a\ngrid: {seed: [1234, 1235]}\nsamples: 2\n")
    assert info.value.key == "grid.seed" and "samples" in str(info.value)
    assert len(sweep("name: a\ngrid: {seed: [1234, 1236]}\nsamples: 2\n").cells) == 2


def test_an_error_names_the_key_the_user_wrote():
    """prompt_len (not written) is refused for seq_len 4 (written): the error names grid.seq_len."""
    with pytest.raises(SweepError) as info:
        sweep("name: a\ngrid: {seq_len: [4, 256]}\n")
    assert info.value.key == "grid.seq_len" and info.value.line == 2 and "prompt_len" in str(info.value)
    with pytest.raises(SweepError) as info:
        sweep("name: a\ngrid: {precision: [fp8], backend: [te], seq_len: [24], batch_size: [1]}\n")
    assert info.value.key in ("grid.seq_len", "grid.batch_size") and info.value.line == 2


def test_an_hf_config_that_transformers_refuses_is_one_line_naming_the_shape_field():
    pytest.importorskip("transformers")
    with pytest.raises(SweepError) as info:
        sweep("""
            name: a
            fixed: {model: "hf:llama", d_model: 100}
            grid: {n_layers: [1]}
        """)
    assert info.value.key == "fixed.d_model" and "\n" not in str(info.value), str(info.value)


def test_leading_zeros_read_as_decimal_as_yaml_1_2_reads_them():
    """YAML 1.1 reads 0640 as octal (416) and 0999 as a string."""
    s = sweep("name: a\ngrid: {d_model: [0640, 01024]}\nfixed: {n_layers: 02}\n")
    assert sorted(c.spec.d_model for c in s.cells) == [640, 1024] and s.cells[0].spec.n_layers == 2
    assert sweep("name: a\ngrid: {lr: [0.001]}\n").cells[0].spec.lr == 0.001
    for base60 in ("1:30", "1:30.5"):  # YAML 1.1's sexagesimal numbers (90, 90.5): a string, refused by its field
        with pytest.raises(SweepError, match=f"grid.d_model.*{base60}"):
            sweep(f"name: a\ngrid: {{d_model: [{base60}]}}\n")


@pytest.mark.parametrize("text,key,allowed", [
    ("name: x\ngrid: {d_model: [64]}\nresources: {gpu: .nan}\n", "resources.gpu", "finite"),
    ("name: x\ngrid: {d_model: [64]}\nresources: {gpu: .inf}\n", "resources.gpu", "finite"),
    ("name: x\ngrid: {d_model: [64]}\nresources: {cpu: .nan}\n", "resources.cpu", "finite"),
    ("name: x\ngrid: {d_model: [64]}\ntrial_timeout_s: .nan\n", "trial_timeout_s", "finite"),
    ("name: x\ngrid: {d_model: [64]}\ntrial_timeout_s: .inf\n", "trial_timeout_s", "finite"),
    ("name: x\ngrid: {d_model: [64]}\nlauncher: [warm]\n", "launcher", "warm"),
    ("name: x\ngrid: {backend: [[te]]}\n", "grid.backend", "single values"),
    ("name: x\ngrid: {d_model: [2020-01-01]}\n", "grid.d_model", "date"),
    ("name: x\ngrid: {d_model: [64]}\nfixed: {model: 2020-01-01}\n", "fixed.model", "date"),
    ("name: x\ngrid: {d_model: [64]}\nstorage: 'bogus://x'\n", "storage", "bogus"),
    ("name: x\ngrid: {d_model: [64]}\nstorage: 's3://'\n", "storage", "bucket"),
    ('name: "t\\n"\ngrid: {d_model: [64]}\n', "name", "letters"),
    ("name: 123\ngrid: {d_model: [64]}\n", "name", "a string"),
    ("name: on\ngrid: {d_model: [64]}\n", "name", "a string"),
    ("name: x\ngrid: {d_model: [64]}\nfixed: []\n", "fixed", "mapping"),
    ("name: x\ngrid: {d_model: [64]}\nresources: 0\n", "resources", "mapping"),
    ("name: x\ngrid: {d_model: [64]}\ntrackers: [{tensorboard: []}]\n", "trackers.0.tensorboard", "mapping"),
])
def test_bad_values_are_one_line_naming_the_key_and_what_is_allowed(text, key, allowed):
    with pytest.raises(SweepError) as info:
        parse_sweep(text, source="s.yaml")
    message = str(info.value)
    assert info.value.key == key and allowed in message and "\n" not in message, message


def test_a_file_that_is_not_utf8_says_so_with_its_line(tmp_path):
    from orchestrator.sweep import load_sweep

    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: t\ngrid: {d_model: [256]}\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(SweepError) as info:
        load_sweep(path)
    assert info.value.key == "file" and info.value.line == 3 and "UTF-8" in str(info.value)


def test_published_results_resume_every_recorded_cell():
    """Every cell id recorded in a published grid sweep's results.parquet comes out of its sweep file(s) again, so a
    rerun resumes instead of running its cells anew (a cell id is the store's key)."""
    import pyarrow.parquet as pq

    from orchestrator.sweep import load_sweep

    checked = 0
    for results in sorted((REPO / "docs" / "results").rglob("results.parquet")):
        sweeps = [load_sweep(p) for p in sorted(results.parent.glob("sweep*.yaml"))]
        if not sweeps or any(s.search is not None for s in sweeps):
            continue  # a search's cells are chosen as results arrive (tests/test_search.py)
        recorded = set(pq.read_table(results, columns=["cell_id"]).column("cell_id").to_pylist())
        produced = {c.cell_id for s in sweeps for c in s.cells}
        assert recorded == produced, results
        checked += 1
    assert checked >= 15
