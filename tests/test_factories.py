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
