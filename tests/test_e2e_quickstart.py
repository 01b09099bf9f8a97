"""The README's first command, end to end, in a new user's shell (no RAY_* variables, an empty HOME):
quickstart sweep through a local embedded Ray, Parquet records, an HTML report that renders in a real
headless Chromium, PNGs, and a resuming rerun."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .conftest import juicytalk, user_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """The environment every command here runs in: a new user's (conftest's Ray settings stripped)."""
    return user_env(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, shell):
    out = tmp_path_factory.mktemp("qs")
    run = juicytalk("sweep", "examples/quickstart.yaml", "--out", str(out), "--no-progress", timeout=900, env=shell)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out / "quickstart", run


def test_quickstart_records(quickstart):
    root, run = quickstart
    table = pq.read_table(root / "results.parquet").to_pylist()
    assert len(table) == 6 and len({(r["cell_id"], r["sample"]) for r in table}) == 6
    by_precision = {}
    for r in table:
        by_precision.setdefault(r["precision"], []).append(r)
    assert all(r["status"] == "ok" for p in ("fp32", "bf16") for r in by_precision[p])
    assert all(r["status"] == "unsupported" and r["error"] for r in by_precision["fp8"])
    ok = [r for r in table if r["status"] == "ok"]
    assert all(r["loss_final"] < r["loss_first"] and r["worker_pid"] and r["node_id"] for r in ok)
    assert all(r["sweep_name"] == "quickstart" and r["ray_version"] for r in table)
    assert (root / "report.html").stat().st_size > 1_000_000  # plotly.js embedded
    assert (root / "sweep.yaml").read_text() == Path("examples/quickstart.yaml").read_text()
    assert "6 trials: 0 already done, 6 run now, 0 failed, 0 missing" in " ".join(run.stdout.split())
    assert len({r["run_id"] for r in table}) == 1 and all(r["run_started_at"] and r["run_gpus"] == 0 for r in table)
    # without GPUs, a trial takes every core of the host: one at a time, never two timing each other
    busy = re.search(r"busy fraction \(no GPU\) (\d+\.\d\d): train\+bench", " ".join(run.stdout.split()))
    assert busy and float(busy.group(1)) <= 1.0
    starts = sorted((r["started_at"], r["finished_at"]) for r in table)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))  # no two trials overlap
    assert "launcher warm" in " ".join(run.stdout.split()) and all(r["launcher"] == "warm" for r in table)
    # TensorBoard event files only where the sweep names that tracker (Tune's own would import torch in the driver)
    assert (root / "ray").is_dir() and not list((root / "ray").rglob("events.out.tfevents.*"))


def test_tune_sees_each_trial_spec_and_metrics(quickstart):
    """The sweep's Tune directory, restored as users do, has every trial's spec and step time."""
    from ray.tune import ExperimentAnalysis

    root, _ = quickstart
    [experiment] = (root / "ray").iterdir()
    analysis = ExperimentAnalysis(str(experiment))
    df = analysis.dataframe()
    records = {(r["cell_id"], r["sample"]): r for r in pq.read_table(root / "results.parquet").to_pylist()}
    assert len(df) == len(records) == 6
    for _, row in df.iterrows():
        rec = records[(row["config/cell_id"], row["config/sample"])]
        assert (row["config/d_model"], row["config/precision"], row["status"]) == (rec["d_model"], rec["precision"],
                                                                                   rec["status"])
        assert row["step_ms_p50"] == rec["step_ms_p50"] or (rec["step_ms_p50"] is None and row["step_ms_p50"] != row["step_ms_p50"])
        assert row["n_params"] == rec["n_params"]  # every numeric field is reported, not only the step time
    assert sorted(str(t) for t in analysis.trials) == sorted(f"{r['cell_label']}-s0" for r in records.values())


def test_rerun_resumes_without_running_anything(quickstart, shell):
    root, _ = quickstart
    before = {p.name: p.stat().st_mtime_ns for p in (root / "trials").iterdir()}
    # Python's import profile (-X importtime) on stderr: a finished sweep's memory plan reads no cell, so its driver
    # never imports torch (~3 CPU-s) nor fake tensors' sympy (~2)
    run = juicytalk("sweep", "examples/quickstart.yaml", "--out", str(root.parent), "--no-progress", "--no-report",
                    env={**shell, "PYTHONPROFILEIMPORTTIME": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "6 already done, 0 run now" in " ".join(run.stdout.split()) and "busy fraction" not in run.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "orchestrator.store" in imported and not imported & {"torch", "sympy"}, sorted(imported & {"torch", "sympy"})
    assert {p.name: p.stat().st_mtime_ns for p in (root / "trials").iterdir()} == before


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_outputs_from_real_sweep(quickstart, tmp_path, shell):
    root, _ = quickstart
    run = juicytalk("report", str(root), "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "png"), env=shell)
    assert run.returncode == 0, run.stderr[-2000:]
    md = (tmp_path / "results.md").read_text()
    assert "Unpaired cells" in md and "te-fp8-delayed is unsupported" in md
    assert "All cells" in md and "torch-bf16" in md and "## Sweep efficiency" in md
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert [p.stem for p in pngs] == sorted(["fp8_speedup", "step_breakdown", "step_time", "throughput", "mfu",
                                             "memory", "loss_curves", "status"])
    assert "## Where the training step goes" in md  # on CPU: aten operators' self time by class
    empty = {"fp8_speedup", "mfu", "memory"}  # on CPU: a short note instead of axes around nothing
    for p in pngs:
        width, height = _png_size(p)
        assert width == 1100 and (height == 220 if p.stem in empty else height >= 300), (p.stem, height)
        assert p.stat().st_size > (3_000 if p.stem in empty else 15_000), p.stem


def test_report_renders_offline_in_chromium(quickstart, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("Debian chromium is required in CI (.ci/run installs it)")
        pytest.skip("needs Debian's chromium")
    root, _ = quickstart
    html = root / "report.html"
    dom, console = render_in_chromium(html, tmp_path)
    charts = re.findall(r'id="chart-([a-z0-9_]+)"', dom)
    assert sorted(charts) == sorted(["fp8_speedup", "step_breakdown", "step_time", "throughput", "mfu", "memory",
                                     "loss_curves", "status"])
    # every chart div holds plotly's rendered SVG
    pieces = re.split(r'id="chart-[a-z0-9_]+"', dom)[1:]
    assert all('class="main-svg"' in piece for piece in pieces)
    errors = [line for line in console if "CONSOLE" in line and re.search(r"error|uncaught", line, re.I)]
    assert not errors, errors
    # the first section answers the question for this run, before any chart: FP8 could not run, and why
    first = re.search(r"<section[^>]*>(.*?)</section>", dom, re.S)
    assert first and "What this run says" in first.group(1), dom[:3000]
    assert ("FP8 could not run on this machine: fp8 on backend auto needs Transformer Engine (no CUDA device); FP8 "
            "that runs here: backend torchao") in first.group(1)
    assert "compare bf16 and fp32" in first.group(1)
    # charts with nothing to show say so instead of drawing axes around nothing
    for name in ("fp8_speedup", "mfu", "memory"):
        piece = dom.split(f'id="chart-{name}"', 1)[1].split("</section>", 1)[0]
        assert 'class="xtick"' not in piece and 'class="ytick"' not in piece, name


def test_compare_without_common_cells_says_so_and_writes_the_report(quickstart, tmp_path):
    root, run = quickstart
    assert "FP8 could not run on this machine" in " ".join(run.stdout.split())  # the sweep's headline too
    other = Path(__file__).resolve().parent.parent / "docs" / "results" / "h200"
    out = juicytalk("report", str(root), "--compare", str(other), "--out", str(tmp_path / "cmp.html"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "share no cells" in out.stderr, out.stderr
    assert (tmp_path / "cmp.html").stat().st_size > 0 and "share no cells" in (tmp_path / "results.md").read_text()


def render_in_chromium(html: Path, tmp: Path) -> tuple[str, list[str]]:
    """DOM after scripts ran, and the console log, from headless Chromium with networking cut off."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000", "--dump-dom", html.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr.splitlines()


def test_chromium_check_catches_a_broken_page(quickstart, tmp_path):
    """The browser check above can fail: a page whose script throws is reported."""
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium")
    root, _ = quickstart
    broken = tmp_path / "broken.html"
    text = (root / "report.html").read_text()
    broken.write_text(text.replace("</body>", "<script>undefinedFunctionCall();</script></body>"))
    _, console = render_in_chromium(broken, tmp_path)
    assert any("CONSOLE" in line and "undefinedFunctionCall" in line for line in console)


def test_collect_rebuilds_results(quickstart, tmp_path, shell):
    root, _ = quickstart
    (root / "results.parquet").unlink()
    run = juicytalk("collect", str(root), env=shell)
    assert run.returncode == 0 and "6 records" in run.stdout
    assert pq.read_table(root / "results.parquet").num_rows == 6
    bad = juicytalk("collect", str(tmp_path))
    assert bad.returncode == 2 and "not a sweep directory" in bad.stderr


def test_doctor_on_cpu(shell):
    run = juicytalk("doctor", env=shell)
    assert run.returncode == 0, run.stderr
    assert "device        cpu" in run.stdout and "ray           2." in run.stdout
    lines = {line.split()[2]: line for line in run.stdout.splitlines() if line.startswith("fp8 ")}
    assert all(f"fp8 te      {recipe:18} no" in lines[recipe] for recipe in ("delayed", "current", "block", "mxfp8", "nvfp4"))
    assert "compute capability 10.0+" in lines["mxfp8"] and "compute capability 8.9+" in lines["delayed"]
    # torchao's FP8 runs on this torch's CPU float8 matmul: each recipe says yes, from the installed torchao
    assert all(f"fp8 torchao {recipe:18} yes" in lines[recipe] for recipe in ("tensorwise", "rowwise"))
    assert "torchao       0." in run.stdout
    assert "power         unknown: NVML unavailable (no NVIDIA driver here)" in run.stdout
    assert "bytecode      present or writable for torch and TE" in run.stdout  # pip leaves bytecode
