"""Every bad input to the CLI is one line naming the flag or field, exit 2, and nothing started.

In-process (``orchestrator.cli.main``): these answer before Ray, torch-heavy imports or any trial.
"""

import importlib.util

import pytest

from orchestrator.cli import main

from .conftest import REPO, _free_port, juicytalk, user_env


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_spec_json_that_is_not_json_names_the_flag(capsys):
    assert one_line_error(capsys, ["trial", "--spec-json", "not json"]).startswith(
        "juicytalk trial: error: --spec-json: not JSON")
    assert "--spec-json: must be a JSON object" in one_line_error(capsys, ["trial", "--spec-json", "[1]"])


def test_collect_of_a_missing_directory_says_it_does_not_exist(capsys, tmp_path):
    line = one_line_error(capsys, ["collect", str(tmp_path / "nope")])
    assert line.endswith("nope does not exist")


def test_report_png_that_is_a_file_is_one_line(capsys, tmp_path):
    png = tmp_path / "chart.png"
    png.write_text("")
    seed = REPO / "docs" / "results" / "h200" / "seed" / "results.parquet"  # a real report's input
    line = one_line_error(capsys, ["report", str(seed), "--out", str(tmp_path / "r.html"), "--png", str(png)])
    assert f"--png: {png} is a file" in line


def test_report_png_without_a_browser_says_what_to_install_before_the_report(tmp_path):
    """kaleido's traceback (30 lines) came after the report's charts were built. No browser here: an empty PATH, a
    new HOME (no browser kaleido downloaded) and BROWSER_PATH, which kaleido's lookup takes before its usual install
    paths (a CI host has /usr/bin/chromium), naming a file that is not there."""
    (tmp_path / "bin").mkdir()
    env = user_env(tmp_path / "home", PATH=str(tmp_path / "bin"), BROWSER_PATH=str(tmp_path / "no-chromium"),
                   PYTHONPATH=str(REPO))
    seed = REPO / "docs" / "results" / "h200" / "seed" / "results.parquet"
    run = juicytalk("report", str(seed), "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "png"), env=env)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr[-3000:]
    assert run.stderr.startswith("juicytalk: error: --png: no Chrome or Chromium for kaleido") and \
        "apt-get install chromium" in run.stderr and "plotly_get_chrome" in run.stderr, run.stderr
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "png").exists()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs the mlflow extra")
def test_export_to_an_mlflow_server_that_does_not_answer_is_one_line(capsys, tmp_path):
    """MLflow's client retries for minutes and then raises; a TCP probe answers in seconds."""
    uri = f"http://127.0.0.1:{_free_port()}"
    line = one_line_error(capsys, ["export", str(tmp_path), "--mlflow", uri])
    assert f"--mlflow: nothing answers at {uri}" in line


def test_dry_run_of_a_finished_sweep_says_none_would_run(capsys, tmp_path):
    from orchestrator.store import Store
    from orchestrator.sweep import load_sweep
    from trials.record.fields import empty_record

    path = tmp_path / "done.yaml"
    path.write_text("name: done\ngrid: {d_model: [32, 64]}\nfixed: {device: cpu}\n")
    store = Store(str(tmp_path / "out"), "done")
    store.ensure()
    [first, second] = load_sweep(path).cells
    store.write_record({**empty_record(), "cell_id": first.cell_id, "sample": 0, "status": "ok"})
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "2 trials: 1 have a final record, 1 would run now" in " ".join(capsys.readouterr().out.split())
    store.write_record({**empty_record(), "cell_id": second.cell_id, "sample": 0, "status": "unsupported"})
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "2 trials: 2 have a final record, 0 would run now" in " ".join(capsys.readouterr().out.split())


def test_doctor_says_what_it_knows_in_words(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device ") and "ray " in out
    assert "None" not in out and "{" not in out, out


def test_trial_quiet_prints_nothing_not_even_third_party_noise():
    """torchao's 'Failed to load ..._C_mxfp8...so', torch's _pytree warning and Kineto's 'USDT: profiler_start'
    are not the user's business: a torchao cell with the profiler on, under -q, prints nothing."""
    import subprocess
    import sys

    from .conftest import cli_env

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao")
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "trial", "-q", "--device", "cpu",
                          "--backend", "torchao", "--precision", "fp8", "--recipe", "tensorwise", "--d-model", "32",
                          "--n-layers", "1", "--seq-len", "16", "--batch-size", "2", "--train-steps", "2",
                          "--bench-steps", "2", "--warmup-steps", "0", "--profile"],
                         capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stdout[-2000:] + out.stderr[-2000:]


def test_the_guides_usage_lines_show_every_flag_and_every_flag_has_help():
    import argparse

    from orchestrator.cli import build_parser

    page = (REPO / "docs" / "guide" / "commands.md").read_text()
    usage = page.split("## Using it", 1)[1].split("\n* ", 1)[0]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("sweep", "doctor", "report", "export", "collect"):
        line = next(ln for ln in usage.split("    juicytalk ")[1:] if ln.startswith(command + " "))
        for action in sub.choices[command]._actions:
            flags = [f for f in action.option_strings if f not in ("-h", "--help")]
            if flags:
                assert any(f in line for f in flags), (command, flags)
                assert action.help, (command, flags)


@pytest.mark.parametrize("argv,flag", [
    (["--out", "bogus://x"], "--out: "), (["--out", "s3://"], "--out: "),
    (["--gpu-memory", "nan"], "--gpu-memory: "), (["--gpu-memory", "inf"], "--gpu-memory: "),
])
def test_sweep_flags_that_name_nothing_usable_are_one_line(capsys, tmp_path, argv, flag):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\ngrid: {d_model: [64]}\nfixed: {device: cpu}\n")
    assert flag in one_line_error(capsys, ["sweep", str(path), "--dry-run", *argv])


def test_collect_of_a_uri_pyarrow_does_not_know_is_one_line(capsys):
    assert one_line_error(capsys, ["collect", "bogus://x/y"]).startswith("juicytalk: error: DIR: ")


@pytest.mark.parametrize("argv, flag", [(["report", "bogus://x/y"], "DIR"),
                                        (["report", "results.parquet", "--compare", "s3://"], "--compare")])
def test_a_report_of_a_uri_pyarrow_does_not_know_is_one_line(capsys, argv, flag):
    assert one_line_error(capsys, argv).startswith(f"juicytalk: error: {flag}: ")


def test_bad_sweep_files_exit_2_with_one_line_before_anything_starts(tmp_path):
    """End to end, as a user runs it: tracebacks (exit 1) once, for a NaN GPU count and a Latin-1 byte."""
    from .conftest import juicytalk

    (tmp_path / "nan.yaml").write_text("name: t\ngrid: {d_model: [64]}\nresources: {gpu: .nan}\n")
    (tmp_path / "latin1.yaml").write_bytes(b"name: t\ngrid: {d_model: [64]}\n# caf\xe9\n")
    for name, key in (("nan.yaml", "resources.gpu"), ("latin1.yaml", "file")):
        out = juicytalk("sweep", str(tmp_path / name), "--dry-run", "--out", str(tmp_path / "out"), timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and f": {key}: " in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "out").exists()
