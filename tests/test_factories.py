"""A user's py: factory as a user brings it (issue 44, items 7 and 10): a nanoGPT-like file
(tests/fixtures/nanogpt/model.py) that imports a sibling module, prints its parameter count when built and returns
``(logits, loss)``. Its folder reaches sys.path; its tuple is taken; its print shows once per process."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from trials import SpecError, TrialSpec, run_trial
from trials.models import CWD_ENV, py
from trials.spec import check_model

NANOGPT = Path(__file__).resolve().parent / "fixtures" / "nanogpt" / "model.py"
SHAPE = dict(d_model=32, n_layers=1, n_heads=2, vocab=96, seq_len=16, batch_size=4, device="cpu")
PRINTED = "number of parameters:"


@pytest.fixture
def fresh_process():
    """As in a new process: nothing shown yet, no meta build kept (each is once per process)."""
    py._show_once.cache_clear()
    py.on_meta.cache_clear()
    py.describe.cache_clear()


def test_nanogpt_as_it_is_is_refused_saying_to_return_every_positions_logits():
    """Its sibling import works (the file's folder is on sys.path); its forward without targets gives the last
    position's logits only, which the refusal names and says what to return instead."""
    with pytest.raises(SpecError, match=r"gave logits of shape \(2, 1, 96\); want \(batch, seq, vocab\) = "
                                        r"\(2, 16, 96\); .*last position only .* return the logits of every position"):
        check_model(TrialSpec(model=f"py:{NANOGPT}:build", backend="torch", **SHAPE))


def test_a_tuple_without_logits_first_says_what_to_return(tmp_path):
    (tmp_path / "pair.py").write_text("import torch.nn as nn\n\nclass Pair(nn.Module):\n"
                                      "    def __init__(self):\n        super().__init__()\n"
                                      "        self.head = nn.Linear(4, 96)\n\n"
                                      "    def forward(self, ids):\n        return None, ids\n\n"
                                      "def build(spec):\n    return Pair()\n")
    with pytest.raises(SpecError, match=r"returned a tuple whose first item is a NoneType, not logits; forward\(ids\) "
                                        r"must return the logits tensor \(batch, seq, vocab\) = \(2, 16, 96\), alone, "
                                        r"as the first item of a tuple \(logits, \.\.\.\) or as \.logits"):
        check_model(TrialSpec(model=f"py:{tmp_path / 'pair.py'}:build", backend="torch", **SHAPE))


def test_logits_and_loss_train_and_the_factorys_print_shows_once_per_trial(fresh_process, capsys):
    """The probe, the facts and the trial's own build each run the factory; its print reads once."""
    spec = TrialSpec(model=f"py:{NANOGPT}:build_full", backend="torch", precision="fp32", train_steps=2,
                     warmup_steps=1, bench_steps=1, profile=False, **SHAPE)
    check_model(spec)
    rec = run_trial(spec)
    assert rec["status"] == "ok", rec["error"]
    assert rec["model_class"] == "FullGPT" and rec["n_params"] > 0
    assert capsys.readouterr().out.count(PRINTED) == 1


def test_the_dry_run_shows_the_factorys_print_once(fresh_process, capsys, tmp_path):
    path = tmp_path / "nano.yaml"
    path.write_text(f"name: nano\ngrid: {{precision: [fp32, bf16], d_model: [32]}}\n"
                    f"fixed: {{model: 'py:{NANOGPT}:build_full', backend: torch, n_layers: 1, n_heads: 2, vocab: 96, "
                    f"seq_len: 16, device: cpu}}\n")
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "FullGPT" in out or "build_full" in out
    assert out.count(PRINTED) == 1


def test_a_relative_path_is_read_from_the_folder_juicytalk_ran_in(tmp_path, monkeypatch):
    """Relative to the working directory (``juicytalk trial``, the driver's check), else, in a sweep's trial (run in
    its launcher's folder), to the driver's, which the launcher hands it in CWD_ENV; not found, the one line says
    which folder it was read from and, in a trial, that every node of a cluster needs the file there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=rf"no file at {tmp_path}/nanogpt/model.py \(a relative path is read from the "
                                        rf"folder juicytalk ran in, {tmp_path}\)$"):
        check_model(TrialSpec(model="py:nanogpt/model.py:build", backend="torch", **SHAPE))
    monkeypatch.setenv(CWD_ENV, str(NANOGPT.parent.parent))  # tests/fixtures, as a sweep's driver in it says
    check_model(TrialSpec(model="py:nanogpt/model.py:build_full", backend="torch", **SHAPE))
    monkeypatch.setenv(CWD_ENV, str(tmp_path))
    with pytest.raises(SpecError, match=rf"no file at {tmp_path}/nanogpt/model.py \(a relative path is read from the "
                                        rf"folder juicytalk ran in, {tmp_path}; this trial runs on .*: on a Ray "
                                        r"cluster every node that runs trials needs the file at this same absolute "
                                        r"path"):
        check_model(TrialSpec(model="py:nanogpt/model.py:build", backend="torch", **SHAPE))


def _factory_beside(folder: Path, width: int) -> Path:
    """A factory file in ``folder`` importing its sibling ``layers.py``, whose WIDTH is ``width``."""
    folder.mkdir()
    (folder / "layers.py").write_text(f"WIDTH = {width}\n")
    (folder / "model.py").write_text("from layers import WIDTH\n\ndef build(spec):\n    return WIDTH\n")
    return folder / "model.py"


def test_two_factories_in_two_folders_each_get_their_own_sibling(tmp_path):
    """One process (a trial server) loads both: the second's ``layers`` is its own, not the first's; neither
    folder stays on sys.path."""
    import sys

    a, b = _factory_beside(tmp_path / "a", 1), _factory_beside(tmp_path / "b", 2)
    assert py.factory(f"{a}:build")(None) == 1 and py.factory(f"{b}:build")(None) == 2
    assert str(a.parent) not in sys.path and str(b.parent) not in sys.path and "layers" not in sys.modules


def test_an_edited_factory_file_is_run_again(tmp_path):
    import os

    path = _factory_beside(tmp_path / "a", 1)
    assert py.factory(f"{path}:build")(None) == 1
    path.write_text("def build(spec):\n    return 3\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a clock too coarse to tell
    assert py.factory(f"{path}:build")(None) == 3


def _factory_importing_when_called(folder: Path, width: int) -> Path:
    """A factory file in ``folder`` whose ``build`` imports its sibling ``blocks.py`` only when called; ``blocks``
    and the file both import ``layers.py`` (WIDTH ``width``)."""
    folder.mkdir()
    (folder / "layers.py").write_text(f"WIDTH = {width}\n")
    (folder / "blocks.py").write_text("import layers\n\nclass Block:\n    WIDTH = layers.WIDTH\n")
    (folder / "model.py").write_text("import layers\n\ndef build(spec):\n    from blocks import Block\n"
                                     "    import layers as again\n    return Block.WIDTH, again is layers\n")
    return folder / "model.py"


def test_a_sibling_imported_inside_the_factory_is_found_and_kept_apart(tmp_path):
    """The file's folder and the siblings it imported are in place while its factory is called too, not only while
    the file runs: ``blocks``, imported in ``build``, is found; ``layers`` is the module the file imported, not a
    second copy; two folders' siblings stay apart, call after call; none stays on sys.path or in sys.modules."""
    import sys

    a, b = _factory_importing_when_called(tmp_path / "a", 1), _factory_importing_when_called(tmp_path / "b", 2)
    build_a, build_b = py.factory(f"{a}:build"), py.factory(f"{b}:build")
    assert build_a(None) == (1, True) and build_b(None) == (2, True) and build_a(None) == (1, True)
    assert str(a.parent) not in sys.path and str(b.parent) not in sys.path
    assert not {"layers", "blocks"} & set(sys.modules)


HEAD = "import torch.nn as nn\n\ndef head(d, vocab):\n    return nn.Linear(d, vocab)\n"
LM = ("import torch.nn as nn\n\ndef build(spec):\n    from {parts} import head\n"
      "    return nn.Sequential(nn.Embedding(spec.vocab, 16), head(16, spec.vocab))\n")


def _project(folder: Path, package: str) -> Path:
    """A user's project folder holding package ``package`` (not installed): its ``lm.build`` imports the
    package's ``parts`` only when called."""
    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")
    (folder / package / "parts.py").write_text(HEAD)
    (folder / package / "lm.py").write_text(LM.format(parts=f"{package}.parts"))
    return folder


def test_a_dotted_module_is_imported_from_the_folder_juicytalk_ran_in(tmp_path, monkeypatch):
    """A module of the user's project: found from the working directory (``juicytalk trial``, the driver), and from
    another one with CWD_ENV naming it (a sweep's trial); the folder leaves sys.path after. One that is not there
    is one line saying where it was looked for and what ``model`` takes; in a trial, that every node needs it."""
    import sys

    package = f"jt_user_{tmp_path.name.replace('-', '_')}"  # a name of this test's own: sys.modules keeps it
    project = _project(tmp_path / "project", package)
    monkeypatch.chdir(project)
    try:
        check_model(TrialSpec(model=f"py:{package}.lm:build", backend="torch", **SHAPE))
        for name in [n for n in sys.modules if n.partition(".")[0] == package]:
            del sys.modules[name]  # as in a new process: the trial's
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv(CWD_ENV, str(project))
        check_model(TrialSpec(model=f"py:{package}.lm:build", backend="torch", **SHAPE))
        assert str(project) not in sys.path
        with pytest.raises(SpecError, match=rf"^model: py:{package}.lmm:build: no module {package}.lmm in {project} "
                                            r"\(the folder juicytalk ran in\) nor installed; give a module importable "
                                            rf"from that folder \({package}/lmm.py or {package}/lmm/__init__.py under "
                                            r"it\) or installed, or a .py file by its path "
                                            r"\(py:path/to/file.py:build\); this trial runs on .*: on a Ray cluster "
                                            r"every node that runs trials needs the module at this same absolute "
                                            r"path") as exc:
            check_model(TrialSpec(model=f"py:{package}.lmm:build", backend="torch", **SHAPE))
        assert exc.value.field == "model" and "\n" not in str(exc.value)
    finally:
        for name in [n for n in sys.modules if n.partition(".")[0] == package]:
            del sys.modules[name]


def test_a_missing_import_inside_the_users_module_is_named_as_python_names_it(tmp_path, monkeypatch):
    (tmp_path / "jt_needs_more.py").write_text("import jt_not_installed_anywhere\n\ndef build(spec):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=r"cannot import jt_needs_more: ModuleNotFoundError: No module named "
                                        r"'jt_not_installed_anywhere'$"):
        check_model(TrialSpec(model="py:jt_needs_more:build", backend="torch", **SHAPE))


TRIAL = ("trial", "--backend", "torch", "--precision", "fp32", "--d-model", "16", "--n-layers", "1", "--n-heads", "1",
         "--vocab", "96", "--seq-len", "16", "--batch-size", "4", "--train-steps", "2", "--warmup-steps", "1",
         "--bench-steps", "1", "--no-profile", "--device", "cpu")


def test_the_installed_cli_finds_a_sibling_imported_inside_the_factory(tmp_path):
    """``juicytalk trial --model py:net/model.py:build`` in a new user's shell, in their project folder."""
    from .conftest import installed_juicytalk, user_env

    project = tmp_path / "project"
    (project / "net").mkdir(parents=True)
    (project / "net" / "blocks.py").write_text(HEAD)
    (project / "net" / "model.py").write_text(LM.format(parts="blocks"))
    run = installed_juicytalk(*TRIAL, "--model", "py:net/model.py:build", cwd=project, env=user_env(tmp_path / "home"))
    assert run.returncode == 0 and "status        ok" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_installed_cli_imports_a_dotted_module_of_the_project_in_the_driver_and_the_trials(tmp_path):
    """A new user's shell in their project folder, the installed command (no folder of theirs on sys.path): a
    sweep's dry run finds ``py:mynet.lm:build`` in the driver; a trial run elsewhere with CWD_ENV naming the
    project (what a sweep's trial process is: its launcher's folder, the driver's in CWD_ENV) finds it too; a
    misspelt module is one line naming ``model``, exit 2, before Ray or any results directory."""
    from .conftest import installed_juicytalk, user_env

    project = _project(tmp_path / "project", "mynet")
    env = user_env(tmp_path / "home")
    sweep = ("name: mine\ngrid: {{d_model: [16]}}\nfixed: {{model: 'py:{module}:build', backend: torch, n_layers: 1, "
             "n_heads: 1, vocab: 96, seq_len: 16, batch_size: 4, train_steps: 2, warmup_steps: 1, bench_steps: 1, "
             "device: cpu}}\nresources: {{cpu: 1, gpu: 0}}\n")
    (project / "mine.yaml").write_text(sweep.format(module="mynet.lm"))
    (project / "typo.yaml").write_text(sweep.format(module="mynet.lmm"))

    dry = installed_juicytalk("sweep", "mine.yaml", "--dry-run", "--out", "out", cwd=project, env=env)
    assert dry.returncode == 0 and "1 would run now" in dry.stdout, dry.stdout[-2000:] + dry.stderr[-2000:]
    elsewhere = tmp_path / "launcher"
    elsewhere.mkdir()
    run = installed_juicytalk(*TRIAL, "--model", "py:mynet.lm:build", cwd=elsewhere, env={**env, CWD_ENV: str(project)})
    assert run.returncode == 0 and "status        ok" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]

    typo = installed_juicytalk("sweep", "typo.yaml", "--out", "out", cwd=project, env=env)
    assert typo.returncode == 2, typo.stdout[-2000:] + typo.stderr[-2000:]
    [line] = typo.stderr.strip().splitlines()
    assert line.startswith("juicytalk: error: ") and f"model: py:mynet.lmm:build: no module mynet.lmm in {project} " \
        "(the folder juicytalk ran in) nor installed; give a module importable from that folder" in line, line
    assert typo.stdout == "" and not (project / "out").exists()
