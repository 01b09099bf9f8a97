"""Results on object storage (issue 45 item 5), against a real S3 server: moto's, started here on 127.0.0.1.

One sweep run (``--out s3://...``) is shared by the checks. Before it, the bucket holds what a crashed earlier run
of the same sweep left there: one cell's record (a real trial's, so the run resumes past it), another cell's record
file cut short (quarantined, the cell runs again) and the lock object of a driver that is gone (taken over). The
endpoint reaches pyarrow (the store, and Ray Tune's storage_path) through ``AWS_ENDPOINT_URL``, as for any
S3-compatible store.
"""

from __future__ import annotations

import importlib.util
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from trials.runtime.environ import environ

from .conftest import REPO, _free_port, cli_env, wait_for

# moto of this interpreter (the version pyproject's dev extra installed), never a moto_server found on PATH: another
# Python's moto 5.2.1 answered pyarrow 26's CompleteMultipartUpload with a 200 and an empty body, which the AWS SDK
# reads as an error, and every record write failed
MOTO = importlib.util.find_spec("moto") and importlib.util.find_spec("moto.server")
pytestmark = [pytest.mark.skipif(not MOTO, reason="moto[server] not installed (pip install -e '.[dev]')"),
              pytest.mark.slow]  # one sweep with Ray's start: ~30 s on 2 cores

BUCKET = "juicytalk-results"
SWEEP = """name: objs
grid: {precision: [fp32, bf16]}
fixed: {d_model: 32, n_layers: 1, seq_len: 16, batch_size: 4, train_steps: 3, bench_steps: 1, warmup_steps: 1,
        repeats: 1, gen_len: 1, device: cpu, profile: false, backend: torch}
resources: {cpu: 1, gpu: 0}
max_concurrent: 1
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free port, its bucket, and the environment that points pyarrow at it (set in this
    process for the module, and given to the CLI's)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return urllib.request.urlopen(endpoint, timeout=2).status == 200
        except OSError:
            return False

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}
    try:
        with environ(**env):
            wait_for(up, timeout=60)
            pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True).create_dir(BUCKET)
            yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_sweep(s3, tmp_path_factory):
    """(sweep file, storage URI, the store, the CLI run, the keys: resumed, quarantined): one run, read by all."""
    from orchestrator.lock import LEASE_S, lock_path
    from orchestrator.store import Store
    from orchestrator.sweep import load_sweep
    from orchestrator.runner import work_items
    from trials import TrialSpec
    from trials.trial import run_trial

    here = tmp_path_factory.mktemp("s3sweep")
    (here / "objs.yaml").write_text(SWEEP)
    storage = f"s3://{BUCKET}/sweeps"
    store = Store(storage, "objs")
    store.ensure()
    kept, cut = work_items(load_sweep(here / "objs.yaml"))
    rec = run_trial(TrialSpec.from_dict(kept.spec))  # what an earlier run of this sweep recorded for one cell
    assert rec["status"] == "ok", rec["error"]
    store.write_record({**rec, "cell_id": kept.cell_id, "cell_label": kept.label, "sample": kept.sample})
    with store.fs.open_output_stream(store.path("trials", cut.key + ".parquet")) as out:
        out.write(b"PAR1 cut short by a crash")
    with store.fs.open_output_stream(lock_path(store)) as out:  # its driver died LEASE_S + 1 s ago
        out.write(f'{{"host": "gone", "pid": 1, "heartbeat": {time.time() - LEASE_S - 1}}}'.encode())
    # two drivers started at once (issue 54 item 10), both finding the gone driver's lock: exactly one runs the sweep
    # and the other is refused in one line, exit 2 (the checks below: no record lost or doubled). Both plan from the
    # store before either holds the lock; only the one holding it moves the file cut short aside (and says so, once)
    drivers = [subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", str(here / "objs.yaml"), "--out",
                                 storage, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=cli_env(**s3), cwd=REPO) for _ in range(2)]
    outputs = [d.communicate(timeout=600) for d in drivers]
    run, refused = sorted((subprocess.CompletedProcess(d.args, d.returncode, *out) for d, out in zip(drivers, outputs)),
                          key=lambda r: r.returncode)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = refused.stderr.splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "is in use by another juicytalk sweep" in lines[0], \
        refused.stdout + refused.stderr
    assert "unreadable record file" in run.stderr
    return here / "objs.yaml", storage, store, run, kept.key, cut.key


def test_a_sweep_on_s3_resumes_quarantines_and_takes_over_a_gone_drivers_lock(s3_sweep):
    from orchestrator.lock import lock_path

    _, storage, store, run, kept, cut = s3_sweep
    out = " ".join(run.stdout.split())
    assert "2 trials: 1 already done, 1 run now, 0 failed, 0 missing" in out, out
    statuses = store.statuses()
    assert statuses == {kept: "ok", cut: "ok"}
    assert [i.base_name for i in store._list("series", ".parquet")] == sorted([f"{kept}.parquet", f"{cut}.parquet"])
    assert store.read_text("sweep.yaml") == SWEEP and store.exists("logs", f"{cut}.log")
    quarantined = store.fs.get_file_info(pafs.FileSelector(store.path("quarantine")))
    assert [i.base_name.startswith(f"{cut}.parquet.") for i in quarantined] == [True]
    assert "took over the lock of a driver that is gone (host gone, pid 1" in run.stderr
    assert store.fs.get_file_info(lock_path(store)).type == pafs.FileType.NotFound  # released: gone
    assert f"results: {storage}/objs/results.parquet" in out and store.exists("results.parquet")


def test_the_report_of_a_sweep_on_s3_is_written_there_and_reads_from_there(s3_sweep, tmp_path):
    from orchestrator.report import build_report

    _, storage, store, run, *_ = s3_sweep
    assert f"report: {storage}/objs/report.html" in " ".join(run.stdout.split())
    assert "torch-bf16 vs torch-fp32" in store.read_text("results.md")
    assert store.read_text("report.html").startswith("<!DOCTYPE html>") or "<html" in store.read_text("report.html")
    local = build_report(f"{storage}/objs", out_html=str(tmp_path / "r.html"))  # juicytalk report s3://... --out
    assert Path(local.html_path).is_file() and "torch-bf16 vs torch-fp32" in Path(local.md_path).read_text()


def test_a_second_driver_on_the_same_s3_sweep_is_refused(s3_sweep):
    from orchestrator.lock import SweepLocked, lock_path, sweep_lock
    from orchestrator.runner import run_sweep
    from orchestrator.sweep import load_sweep

    path, storage, store, *_ = s3_sweep
    with sweep_lock(store):  # a live driver: the second is refused before Ray or any trial starts
        with pytest.raises(SweepLocked, match=f"sweep directory {storage}/objs is in use by another juicytalk sweep"):
            run_sweep(load_sweep(path), storage)
    assert store.fs.get_file_info(lock_path(store)).type == pafs.FileType.NotFound


def test_collect_on_s3(s3_sweep):
    from orchestrator.cli import main

    _, storage, store, *_ = s3_sweep
    store.fs.delete_file(store.path("results.parquet"))
    assert main(["collect", f"{storage}/objs"]) == 0
    assert store.exists("results.parquet")


def test_restart_of_an_s3_sweep_is_refused_in_one_line(s3_sweep):
    from orchestrator.runner import SweepInputError, run_sweep
    from orchestrator.sweep import load_sweep

    path, storage, store, *_ = s3_sweep
    with pytest.raises(SweepInputError, match=r"^--restart: s3://\S+/objs is on object storage, where results are "
                                              "not moved aside; give the sweep a new --out prefix instead$"):
        run_sweep(load_sweep(path), storage, restart=True)
    assert store.statuses()  # nothing moved or deleted


def test_a_driver_whose_lock_was_taken_over_stops_and_leaves_it_to_its_new_holder(s3, monkeypatch):
    """After a write outage longer than LEASE_S a second driver takes the lock over; the first, when the store
    answers again, must see that at its next heartbeat instead of overwriting the new holder's lock (both would
    then run the same cells), stop its trials (the runner's Tune stopper) and end in one line, leaving the lock."""
    import json

    from orchestrator import lock
    from orchestrator.lock import heartbeat
    from orchestrator.runner import _stopper
    from orchestrator.store import Store

    # the take-over lands before the first heartbeat (a second after the lock is taken), as after an outage it lands
    # between two
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 1.0)
    store = Store(f"s3://{BUCKET}/taken", "s")
    path = lock.lock_path(store)
    other = {"host": "other", "pid": 2, "started_at": "now", "token": "theirs"}
    _stopper(None)  # Tune imported before the lock is taken, so that the take-over is done within its first second
    with pytest.raises(lock.SweepLocked, match=r"^sweep lock lost: s3://\S+/taken/s: another driver took it over "
                                               r"\(host other, pid 2, started now\)"):
        with lock.sweep_lock(store) as lease:
            stopper = _stopper(lease)
            assert lease.lost is None and not stopper.stop_all()
            with store.fs.open_output_stream(path) as out:  # the second driver's take-over, while this one could not
                out.write(json.dumps({**other, "heartbeat": time.time()}).encode())  # write
            wait_for(lambda: lease.lost, timeout=30, interval=0.02)
            assert json.loads(store.read_at(path))["token"] == "theirs"  # the heartbeat did not write it back
            assert stopper.stop_all()
    assert json.loads(store.read_at(path))["token"] == "theirs"  # released without deleting the holder's lock


# A driver, as far as the lock goes: for each "take <storage> <sweep>" line it takes that sweep's lock and says
# "holds" or the one line that refused it, and on the next line lets go ("free").
DRIVER = """
import sys
from orchestrator.lock import SweepLocked, sweep_lock
from orchestrator.store import Store
print("ready", flush=True)
while line := sys.stdin.readline():
    _, storage, name = line.split()
    try:
        with sweep_lock(Store(storage, name)):
            print("holds", flush=True)
            sys.stdin.readline()
    except SweepLocked as exc:
        print(exc, flush=True)
        sys.stdin.readline()
    print("free", flush=True)
"""


class _Driver:
    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=REPO)
        self.pid = self.proc.pid
        assert self.said() == "ready"

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def said(self, timeout: float = 60) -> str:
        assert select.select([self.proc.stdout], [], [], timeout)[0], f"driver {self.pid} said nothing in {timeout} s"
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@contextmanager
def _stalling_link(port: int):
    """A TCP link to 127.0.0.1:``port`` that holds the first PUT request it carries (a write stalled in flight: a
    congested link, a paused VM) until ``release`` is set. Yields (its port, ``stalled``: set once it holds one,
    ``release``)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stalled, release = threading.Event(), threading.Event()

    def pump(src: socket.socket, dst: socket.socket, hold: bool) -> None:
        try:
            while data := src.recv(65536):
                if hold and data.startswith(b"PUT ") and not release.is_set():
                    stalled.set()
                    release.wait(60)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            for args in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], stalled, release
    finally:
        release.set()
        listener.close()


ROUNDS = 3  # the stalled round below is the one the old lock failed; these check take and release


def test_of_two_drivers_taking_an_s3_sweeps_lock_at_once_exactly_one_holds_it(s3):
    """Issue 54 item 10. Two drivers take the lock at once, a few times over: exactly one holds it, the other is
    refused in the one line naming it, and the holder's release leaves nothing behind for the next round. Then one
    driver's write stalls in flight (held by a link) while the other takes the lock: when it lands it must not win
    too. The lock written without a condition (write, wait a second, read the write back) let both hold it there."""
    storage = f"s3://{BUCKET}/race"
    with _stalling_link(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])) as (port, stalled, release):
        a, b = drivers = [_Driver(cli_env(**s3)) for _ in range(2)]
        try:
            for i in range(ROUNDS):
                for d in drivers:
                    d.send(f"take {storage} r")
                said = {d.pid: d.said() for d in drivers}
                holders = [pid for pid, line in said.items() if line == "holds"]
                assert len(holders) == 1, (i, said)
                refused = next(line for pid, line in said.items() if pid != holders[0])
                assert re.fullmatch(rf"sweep directory {storage}/r is in use by another juicytalk sweep \(host \S+, "
                                    rf"pid {holders[0]}, started \S+\); wait for it or stop it", refused), (i, said)
                for d in drivers:
                    d.send("let go")
                assert [d.said() for d in drivers] == ["free", "free"]
            b.send(f"take {storage}?endpoint_override=127.0.0.1:{port}&scheme=http r")  # b's write stalls
            assert stalled.wait(60)
            a.send(f"take {storage} r")
            first = a.said()
            release.set()
            second = b.said()
            assert first == "holds" and f"in use by another juicytalk sweep (host" in second, (first, second)
            assert f"pid {a.pid}," in second
        finally:
            for d in drivers:
                d.close()


def test_a_sweep_into_a_bucket_that_does_not_exist_is_one_line_before_ray(s3, tmp_path, capsys):
    """The sweep's first write there (its lock) was a 29-line traceback, exit 1. The dry run says the same, naming the
    sweep file's ``storage`` where no --out is given."""
    from orchestrator.cli import main

    (tmp_path / "objs.yaml").write_text(SWEEP)
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", str(tmp_path / "objs.yaml"), "--out",
                          "s3://no-such-bucket/sweeps", "--no-progress"], capture_output=True, text=True, cwd=tmp_path,
                         env=cli_env(**s3, RAY_TMPDIR=str(tmp_path / "ray")), timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr[-3000:]
    assert run.stderr == ("juicytalk: error: --out: bucket 'no-such-bucket' does not exist; create it first "
                          "(aws s3 mb s3://no-such-bucket) or name an existing bucket\n")
    assert not (tmp_path / "ray").exists()  # no Ray started
    (tmp_path / "stored.yaml").write_text(SWEEP + "storage: s3://no-such-bucket/sweeps\n")
    assert main(["sweep", str(tmp_path / "stored.yaml"), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("juicytalk: error: storage: bucket 'no-such-bucket' does not exist")
