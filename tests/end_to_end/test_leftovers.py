"""Nothing is left behind by calls that end badly (issue 21, defect 8), and `kinetic-prefect cleanup` finds what a
crash of the caller or the worker can still leave."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task


def new_pool(prefix: str) -> str:
    """A kinetic-local pool made through the API (the CLI's own start-up took over 120 s at load average 20)."""
    from prefect.client.schemas.actions import WorkPoolCreate

    from kinetic_prefect.workers.base import load_template

    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(
            WorkPoolCreate(name=name, type="kinetic-local", base_job_template=load_template("kinetic-local"))
        )
    return name


def job_runs(task_name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(interval)


def footprint(root: Path) -> tuple[int, int]:
    """(entries, bytes of files) under ``root``: a left empty folder counts as much as a file."""
    entries = size = 0
    if not root.exists():
        return 0, 0
    for path in root.rglob("*"):
        entries += 1
        if path.is_file():
            size += path.stat().st_size
    return entries, size


def _interrupted_calls(count: int, store_dir: Path, tmp_path: Path, monkeypatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    pool = new_pool("interrupted")
    name = f"interrupted-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, submission="in-process", ship_project=False)
    def body(mode: str, ballast: bytes) -> int:
        import os as _os
        import signal as _signal
        import time as _time

        if mode == "exit":
            _os._exit(9)
        if mode == "kill":
            _os.kill(_os.getpid(), _signal.SIGKILL)
        if mode == "quick":
            return len(ballast)
        _time.sleep(30)  # the task's timeout stops it
        return 0

    modes = ["timeout", "exit", "kill"]
    timed = body.with_options(timeout_seconds=1.5)  # the job sleeps 30 s: stopped by the timeout
    ballast = os.urandom(256 * 1024)

    @flow
    def warm_up():  # the pool, the runner's environment and the store folders exist before measuring
        return body("quick", ballast)

    assert warm_up() == len(ballast)
    watched = {
        "runs": store_dir / "runs",
        "checkpoints": store_dir / "checkpoints",
        "jobs": Path(os.environ["KINETIC_CACHE_DIR"]) / "jobs",
        "TMPDIR": tmp,
    }
    before = {label: footprint(path) for label, path in watched.items()}

    @flow
    def pipeline() -> list[str]:
        ended = []
        for index in range(count):
            mode = modes[index % len(modes)]
            try:
                (timed if mode == "timeout" else body)(mode, ballast)
                ended.append("returned")
            except BaseException as exc:  # noqa: BLE001 - every call is meant to end badly
                ended.append(type(exc).__name__)
        return ended

    ended = pipeline()
    assert "returned" not in ended, ended
    runs = job_runs(name)
    assert 1 < len(runs) <= count + 1  # a timeout can land before the job's run is created
    wait_for(lambda: all(r.state is not None and r.state.is_final() for r in job_runs(name)), 60, "final runs")
    after = {label: footprint(path) for label, path in watched.items()}
    grown = {
        label: (before[label], after[label])
        for label in watched
        if after[label][0] > before[label][0] or after[label][1] > before[label][1]
    }
    assert not grown, f"(entries, bytes) before and after {count} interrupted calls: {grown}; ended as {ended}"


@pytest.mark.slow
def test_interrupted_calls_leave_nothing_in_the_store_or_tmpdir(store_dir, tmp_path, monkeypatch):
    _interrupted_calls(6, store_dir, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.slow_tier  # about 3 minutes
def test_fifty_interrupted_calls_leave_nothing_in_the_store_or_tmpdir(store_dir, tmp_path, monkeypatch):
    _interrupted_calls(50, store_dir, tmp_path, monkeypatch)


SCRIPT = textwrap.dedent("""
    import pathlib, sys
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, POOL, PID_FILE = sys.argv[1:4]

    @kinetic_task(name=NAME, work_pool=POOL, submission="in-process", ship_project=False)
    def body(pid_path: str) -> int:
        import os, pathlib, time
        pathlib.Path(pid_path).write_text(str(os.getpid()))
        time.sleep(60)
        return 1

    @flow(name=NAME + "-flow")
    def pipeline():
        return body(PID_FILE)

    if __name__ == "__main__":
        pipeline()
""")


@pytest.mark.slow
def test_a_killed_in_process_caller_leaves_no_job_folder(tmp_path):
    pool = new_pool("orphan")
    name = f"orphan-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "caller.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / "job.pid"
    proc = subprocess.Popen(
        [sys.executable, str(script), name, pool, str(pid_file)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 120, "the job to start")
    finally:
        proc.kill()
        proc.wait(30)
    [run] = job_runs(name)
    jobs_dir = Path(os.environ["KINETIC_CACHE_DIR"]) / "jobs"
    wait_for(lambda: job_runs(name)[0].state.is_cancelled(), 30, "the job to cancel its own run")
    wait_for(lambda: not (jobs_dir / str(run.id)).exists(), 15, f"{jobs_dir / str(run.id)} to be removed")


def test_cleanup_lists_then_removes_what_a_crash_left(store_dir, tmp_path, monkeypatch, capsys):
    from kinetic_prefect.cli import main

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    store = tmp_path / "store"
    stale_run = store / "runs" / str(uuid.uuid4())
    stale_run.mkdir(parents=True)
    (stale_run / "payload.pkl").write_bytes(b"x" * 1000)
    (stale_run / "payload.pkl.sig").write_text("sig")
    (store / "checkpoints" / "empty-task-run").mkdir(parents=True)
    kept = store / "checkpoints" / "saved" / "ckpt.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"weights")
    orphan_outputs = tmp / "kinetic-outputs-abc123"
    orphan_outputs.mkdir()
    (orphan_outputs / "model.bin").write_bytes(b"y" * 500)
    jobs = Path(os.environ["KINETIC_CACHE_DIR"]) / "jobs"
    dead_job = jobs / str(uuid.uuid4())
    dead_job.mkdir(parents=True)
    (dead_job / "job.json").write_text('{"pid": 999999999, "start_ticks": 1, "owner": "caller", "hosts": []}')
    (dead_job / "job.log").write_text("lines\n")
    old = time.time() - 7200
    for path in (
        stale_run / "payload.pkl",
        stale_run / "payload.pkl.sig",
        orphan_outputs / "model.bin",
        orphan_outputs,
        dead_job / "job.json",
        dead_job / "job.log",
        dead_job,
        store / "checkpoints" / "empty-task-run",
        kept.parent,
    ):
        os.utime(path, (old, old))
    fresh_run = store / "runs" / str(uuid.uuid4())  # a call may still be collecting it
    fresh_run.mkdir()
    (fresh_run / "result.pkl").write_bytes(b"z")

    assert main(["cleanup", "--store", str(store)]) == 0
    listed = capsys.readouterr().out
    for path in (stale_run / "payload.pkl", store / "checkpoints" / "empty-task-run", orphan_outputs, dead_job):
        assert str(path) in listed, listed
        assert path.exists(), "a dry run deleted something"
    assert str(fresh_run) not in listed and str(kept) not in listed
    assert "dry run" in listed and "--yes" in listed

    assert main(["cleanup", "--store", str(store), "--yes"]) == 0
    capsys.readouterr()
    for path in (stale_run, store / "checkpoints" / "empty-task-run", orphan_outputs, dead_job):
        assert not path.exists(), path
    assert kept.read_bytes() == b"weights" and (fresh_run / "result.pkl").exists()


@pytest.mark.slow
def test_cleanup_keeps_a_detached_jobs_result_until_it_is_collected(store_dir, capsys):
    """`cleanup --yes` deleted the payload and result of a finished detached job nobody had collected yet (files
    two hours old), and `jobs result ID` then said "already collected". A result is kept until collected, or until
    the separate `--uncollected-older-than` age. ≈ 10 s: one real detached job, run to its end."""
    from kinetic_prefect import kinetic
    from kinetic_prefect.cli import main
    from kinetic_prefect.contract import Env, RunLayout

    @kinetic.run(accelerator="cpu")
    def answer():
        return 42

    job = answer.run_async()
    assert job.wait(timeout=300) is kinetic.JobStatus.SUCCEEDED
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(uuid.UUID(job.job_id))
    store = Path(flow_run.job_variables["store"])
    layout = RunLayout(flow_run.job_variables["env"][Env.RUN_ID])
    waiting = [p for p in (store / layout.prefix).iterdir() if p.is_file()]
    assert store / layout.result in waiting
    old = time.time() - 7200
    for path in waiting:
        os.utime(path, (old, old))

    assert main(["cleanup", "--store", str(store), "--yes"]) == 0
    assert str(store / layout.result) not in capsys.readouterr().out
    assert all(path.exists() for path in waiting)
    assert main(["cleanup", "--store", str(store), "--uncollected-older-than", "60"]) == 0
    listed = capsys.readouterr().out
    assert str(store / layout.result) in listed and "nobody collected" in listed and "dry run" in listed
    assert kinetic.attach(job.job_id).result(timeout=60) == 42


def _cleanup_now(store: Path, tmp_path: Path, monkeypatch, capsys) -> str:
    """`kinetic-prefect cleanup --older-than 0 --yes` on ``store`` (an old sweep's age, reached at once), its
    temporary-folder rule pointed at an empty folder: other sessions' jobs share the machine's TMPDIR."""
    from kinetic_prefect.cli import main

    empty_tmp = tmp_path / "cleanup-tmp"
    empty_tmp.mkdir(exist_ok=True)
    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(empty_tmp))
        assert main(["cleanup", "--store", str(store), "--older-than", "0", "--yes"]) == 0
    return capsys.readouterr().out


def test_cleanup_during_a_sweep_in_slots_deletes_nothing_it_needs(store_dir, tmp_path, monkeypatch, capsys):
    """Issue 48, defect 1: `cleanup --yes` deleted the payloads of a running sweep's queued inputs (a queued input
    has no job run of its own), which then failed with ObjectNotFound. A map of 8 inputs on 2 slots, each input
    about a second (so inputs are queued for some seconds: ~15 s in all)."""
    from worker_fixture import new_pool as new_local_pool

    from kinetic_prefect.contract import SweepKeys

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")

    name = f"cleanup-sweep-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name,
        work_pool=new_local_pool("cleanup-sweep"),
        submission="in-process",
        job_variables={"keep_warm_seconds": 20},
    )
    def slow_square(i: int) -> int:
        import time as _time

        _time.sleep(1.0)
        return i * i

    @flow
    def sweep() -> list:
        futures = slow_square.map(range(8))
        futures.wait()
        return [f.result(raise_on_failure=False) for f in futures]

    results: list = []
    runner = threading.Thread(target=lambda: results.append(sweep()), daemon=True)
    runner.start()

    def unclaimed_inputs() -> int:
        total = 0
        for sweep_dir in (store_dir / SweepKeys.ROOT).glob("*"):
            keys = SweepKeys(sweep_dir.name)
            queued = {SweepKeys.run_id_of(p.name) for p in (store_dir / keys.queue).glob("*.json")}
            claimed = {p.name for p in (store_dir / keys.claims).glob("*")}
            total += len(queued - claimed)
        return total

    def running_slots() -> int:
        runs = job_runs(name)
        return sum(1 for run in runs if "kinetic-slot" in (run.tags or []) and run.state and run.state.is_running())

    wait_for(lambda: running_slots() == 2 and unclaimed_inputs() >= 3, 120, "inputs queued behind 2 running slots")
    listed = _cleanup_now(store_dir, tmp_path, monkeypatch, capsys)
    runner.join(180)
    assert not runner.is_alive(), "the sweep did not end"
    assert results == [[i * i for i in range(8)]], (results, listed)
    assert "sweep" not in listed, listed  # the live sweep's records were kept whole


@pytest.mark.no_server
def test_cleanup_removes_the_records_of_sweeps_that_are_over_and_keeps_a_live_ones(tmp_path):
    """Issue 48, defect 6: a sweep's records stayed under sweeps/<id>/ for good when `Sweep.close()` failed at the
    interpreter's exit, and cleanup never looked there. Over: closed, or untouched for --older-than with no
    unfinished slot run; live: a slot run unfinished, or touched lately; a live sweep's inputs' payloads stay."""
    from kinetic_prefect.cli.cleanup import Active, find, remove
    from kinetic_prefect.contract import RunLayout, SweepKeys

    store = tmp_path / "store"
    old = time.time() - 7200

    def sweep(closed: bool, age: float | None) -> tuple[Path, Path]:
        keys = SweepKeys(uuid.uuid4().hex[:16])
        run_id = uuid.uuid4().hex
        records = [keys.queued(1, run_id), keys.claim(run_id), keys.log_chunk(run_id, 0)]
        records += [keys.closed] if closed else []
        payload = store / RunLayout(run_id).payload
        for key in [*records, RunLayout(run_id).payload]:
            (store / key).parent.mkdir(parents=True, exist_ok=True)
            (store / key).write_text("{}")
        if age is not None:
            for path in [*(store / keys.prefix).rglob("*"), store / keys.prefix, payload]:
                os.utime(path, (age, age))
        return store / keys.prefix, payload

    closed_dir, _ = sweep(closed=True, age=None)  # its caller closed it and was killed before removing it
    abandoned_dir, abandoned_payload = sweep(closed=False, age=old)  # its caller killed; its slots gone
    busy_dir, busy_payload = sweep(closed=False, age=old)  # inputs waiting long: a slot run is unfinished
    recent_dir, recent_payload = sweep(closed=False, age=None)  # between two slots, touched a moment ago

    active = Active(set(), set(), set(), {busy_dir.name})
    leftovers = find(store, 3600, tmp_dir=tmp_path / "none", cache_dir=tmp_path / "none", active=active)
    listed = {item.path for item in leftovers}
    assert {closed_dir, abandoned_dir, abandoned_payload} <= listed, listed
    assert not {busy_dir, busy_payload, recent_dir, recent_payload} & listed, listed
    remove(leftovers)
    assert not closed_dir.exists() and not abandoned_dir.exists()
    assert busy_payload.exists() and recent_payload.exists() and busy_dir.exists() and recent_dir.exists()
