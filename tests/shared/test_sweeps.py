"""Sweeps with a job run per call: stopping a whole ``.map()`` / ``.submit()`` fan-out from the calling script, and
fail-fast.

Each stop test runs a real calling script (its own process, a terminal's Ctrl-C or a SIGTERM), on both submission
paths, and asserts that every job's process is gone within 10 s of the signal and every job's run ends Cancelled.
These are the rows of a fan-out that slots do not carry (``KINETIC_SWEEP_SLOTS=0``, a pool with its own command, a
fallback list, a budget …): slots are off in this module, except where a test says so. The same rows in slots are
in ``test_slots.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from test_lifecycle import (
    STOP_WITHIN_SECONDS,
    _as_from_a_terminal,
    alive,
    final_job_run,
    route,
    task_run_of,
    wait_for,
)
from test_spine import job_runs

from kinetic_prefect import kinetic_task

__all__ = ["route"]  # the fixture: both submission paths

JOBS = 4


@pytest.fixture(autouse=True)
def a_job_run_per_call(monkeypatch):
    """Slots off: the calling scripts inherit it."""
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")


SWEEP_SCRIPT = textwrap.dedent("""
    import pathlib, sys
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, POOL, SUBMISSION, PID_DIR, HOW = sys.argv[1:6]

    @kinetic_task(name=NAME, work_pool=POOL, submission=SUBMISSION)
    def sleepy(pid_path: str) -> int:
        import os, pathlib, time
        pathlib.Path(pid_path).write_text(str(os.getpid()))
        time.sleep(60)
        return 42

    @flow(name=NAME + "-flow")
    def sweep():
        paths = [str(pathlib.Path(PID_DIR) / f"{i}.pid") for i in range(JOBS)]
        if HOW == "map":
            return sweep_results(sleepy.map(paths))
        return sweep_results([sleepy.submit(p) for p in paths])

    def sweep_results(futures):
        return [f.result() for f in futures]

    if __name__ == "__main__":
        print("VALUES", sweep(), flush=True)
""").replace("JOBS", str(JOBS))


def read_pids(pid_dir: Path, count: int, timeout: float = 120.0) -> list[int]:
    def ready() -> list[int] | None:
        files = [pid_dir / f"{i}.pid" for i in range(count)]
        texts = [f.read_text().strip() if f.exists() else "" for f in files]
        return [int(t) for t in texts] if all(texts) else None

    return wait_for(ready, timeout, f"{count} jobs to start")


@pytest.mark.parametrize(
    "how,sig", [("map", signal.SIGINT), ("submit", signal.SIGTERM)], ids=["map-ctrl-c", "submit-sigterm"]
)
@pytest.mark.slow
def test_stopping_the_calling_script_stops_every_job_of_the_sweep(route, tmp_path, how, sig):
    pool, submission = route
    name = f"sweep-stop-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), name, pool, submission, str(pid_dir), how],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        pids = read_pids(pid_dir, JOBS)
        signalled = time.time()
        proc.send_signal(sig)
        deadline = signalled + STOP_WITHIN_SECONDS
        while any(alive(pid) for pid in pids) and time.time() < deadline:
            time.sleep(0.2)
        left = [pid for pid in pids if alive(pid)]
        took = time.time() - signalled
        proc.wait(60)  # every job stopped: the script has nothing left to wait for
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    assert not left, f"{len(left)} of {JOBS} jobs still ran {took:.1f}s after the signal:\n{output[-3000:]}"
    assert proc.returncode != 0, output[-3000:]
    runs = final_job_run(name)
    assert len(runs) == JOBS
    assert all(run.state.is_cancelled() for run in runs), [(run.name, run.state.name) for run in runs]
    callers = [wait_for(lambda r=run: (t := task_run_of(r)).state.is_final() and t, 30, "the task run") for run in runs]
    assert {t.state.name for t in callers} == {"Crashed"}, [t.state.name for t in callers]  # the script ended


@pytest.mark.slow
def test_fail_fast_stops_the_rest_of_the_sweep_after_the_first_failure(route, tmp_path):
    from kinetic_prefect import fail_fast

    pool, submission = route
    name = f"fail-fast-{uuid.uuid4().hex[:6]}"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    @kinetic_task(name=name, work_pool=pool, submission=submission, retries=1)
    def trial(i: int, pid_dir: str, others: int) -> int:
        import os as _os
        import pathlib
        import time as _time

        folder = pathlib.Path(pid_dir)
        if i == 0:  # fails once every other trial runs
            deadline = _time.time() + 60
            while len(list(folder.glob("*.pid"))) < others and _time.time() < deadline:
                _time.sleep(0.1)
            raise ValueError("trial 0 diverged")
        (folder / f"{i}.pid").write_text(str(_os.getpid()))
        _time.sleep(120)
        return i

    @flow
    def sweep():
        return fail_fast(trial.map(range(JOBS), pid_dir=str(pid_dir), others=JOBS - 1))

    started = time.time()
    with pytest.raises(ValueError, match="trial 0 diverged"):
        sweep()
    ended = time.time()
    pids = [int((pid_dir / f"{i}.pid").read_text()) for i in range(1, JOBS)]
    assert not [pid for pid in pids if alive(pid)], "jobs of the rest of the sweep still run"
    # Counted from when the last of the rest was running (its pid file), not from the start: job starts on a loaded
    # machine take what they take, and so do trial 0's retry and the stops on a polling worker (53 s here once,
    # serially). A sweep whose rest was not stopped ends at least 120 s after that.
    all_running = max((pid_dir / f"{i}.pid").stat().st_mtime for i in range(1, JOBS))
    took = ended - all_running
    assert took < 95, (
        f"the sweep ended {took:.0f}s after the rest were all running ({ended - started:.0f}s in all): "
        "the rest was not stopped (each sleeps 120 s)"
    )
    runs = final_job_run(name)
    by_state = sorted(run.state.name for run in runs)
    # trial 0 failed twice (retries=1); the others were stopped once, and not retried
    assert by_state == ["Cancelled"] * (JOBS - 1) + ["Failed"] * 2, by_state
    stopped = [task_run_of(run) for run in runs if run.state.is_cancelled()]
    assert [t.state.name for t in stopped] == ["Cancelled"] * (JOBS - 1)  # not retried


@pytest.mark.slow
@pytest.mark.parametrize("slots", ["0", "2"], ids=["a-job-run-per-call", "in-slots"])
def test_job_runs_a_killed_in_process_sweep_never_started_can_be_cancelled(tmp_path, capsys, monkeypatch, slots):
    """`kill -9` of an in-process sweep: the job that ran cancels its own run (its owner died), but the runs still
    queued for an in-process slot stay Pending, and `jobs cancel` left them Cancelling for good (no worker would
    ever act). Their flow runs carry their owner (Prefect labels), so `jobs cancel` sees it gone and ends them.
    In slots the same holds for the slot jobs: a running one cancels its own run, one never started, if any, is
    cancelled by `jobs cancel`. ≈ 18 s each: a sweep script's start and the owner watch of the job that ran."""
    from worker_fixture import new_pool

    from kinetic_prefect.cli import main as cli

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", slots)
    pool, name = new_pool("inproc"), f"sweep-kill-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), name, pool, "in-process", str(pid_dir), "map"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "KINETIC_IN_PROCESS_CONCURRENCY": "1"},  # one runs, the rest queue
    )
    try:
        wait_for(lambda: any(p.read_text().strip() for p in pid_dir.glob("*.pid")) or None, 120, "a job to start")
        wait_for(lambda: len(job_runs(name)) >= 2 or None, 60, "a second job run, queued")
    finally:
        proc.kill()
        proc.wait(30)
    runs = wait_for(
        lambda: (rs := job_runs(name)) and not any(r.state.is_running() for r in rs) and rs, 30, "the owner watch"
    )
    assert any(run.state.is_cancelled() for run in runs), [(r.name, r.state.name) for r in runs]
    stranded = [run for run in runs if not run.state.is_final()]
    assert all(run.state.is_pending() for run in stranded), [(r.name, r.state.name) for r in runs]
    assert stranded or slots != "0"  # a job run per call: the queued ones are left Pending by the kill
    for run in stranded:
        assert cli(["jobs", "cancel", str(run.id)]) == 0
    capsys.readouterr()
    assert all(run.state.is_cancelled() for run in job_runs(name)), [(r.name, r.state.name) for r in job_runs(name)]


def test_a_job_run_that_cannot_be_created_leaves_no_pending_tracking_task_run(monkeypatch):
    """A 256-input map on the embedded server that failed with 503 left 27 tracking task runs Pending: each was
    created, then its job's flow run was not. A tracker whose job run cannot be created now ends Cancelled."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from kinetic_prefect.shared import prefect_runs

    async def refused(*args, **kwargs):
        raise RuntimeError("the server refused the flow run")

    monkeypatch.setattr(prefect_runs, "_create_flow_run", refused)
    name = f"no-job-run-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(RuntimeError, match="refused"):
        pipeline()
    with get_client(sync_client=True) as client:
        trackers = [
            t
            for t in client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
            if "kinetic" in (t.tags or [])
        ]
    assert trackers and all(t.state.is_cancelled() for t in trackers), [(t.name, t.state.name) for t in trackers]
