"""The orchestrator in the fault matrix: the Prefect API goes away during a job and comes back.

The calling script and the polling worker reach the server through an ``ApiGate`` that the test cuts (every
connection refused or reset, as when the server process stops) and restores. On both submission paths the job
must finish, the caller must get its value, every line the job printed must reach the caller's terminal and the
job run's Prefect logs exactly once, and every run must end terminal. The short outage spans the middle of the
job; in the long one the job ends while the API is still away, so its final state waits for the API too.

What makes an outage long is Prefect's own client retries (``PREFECT_CLIENT_MAX_RETRIES``, 5 by default: waits of
2, 4, 8, 16 and 32 s, about a minute), after which Prefect's background log sender drops a batch and its state
writes raise. The long-outage test lowers them to 2 (about 6 s) in every process it starts, so a 25 s outage
outlasts them four times over: the code paths of a 4-minute outage under the defaults, in a fraction of the time.
A 5-minute outage under Prefect's default retries runs with ``KINETIC_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from api_gate import ApiGate
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from test_lifecycle import final_job_run, read_pid, task_run_of

SCRIPT = textwrap.dedent("""
    import sys
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, POOL, SUBMISSION, PID_FILE, LINES, PERIOD = sys.argv[1:7]

    @kinetic_task(name=NAME, work_pool=POOL, submission=SUBMISSION)
    def chatty(pid_path: str, lines: int, period: float) -> int:
        import os, pathlib, time
        pathlib.Path(pid_path).write_text(str(os.getpid()))
        for i in range(lines):
            print(f"line-{i:05d}", flush=True)
            time.sleep(period)
        return lines

    @flow(name=NAME + "-flow")
    def pipeline():
        return chatty(PID_FILE, int(LINES), float(PERIOD))

    if __name__ == "__main__":
        print("VALUE", pipeline(), flush=True)
""")


@pytest.fixture
def gate(prefect_server):
    port = int(re.search(r":(\d+)/api", prefect_server).group(1))
    gate = ApiGate(port)
    yield gate
    gate.close()


def _job_log_lines(run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        messages: list[str] = []
        offset = 0
        while True:
            page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200, offset=offset)
            messages += [log.message for log in page]
            offset += len(page)
            if len(page) < 200:
                break
    return [line for message in messages for line in message.splitlines() if line.startswith("line-")]


def _around(output: str, missing: list[str]) -> str:
    """The caller's output from a few lines before the first missing line to a few after it: what came instead."""
    if not missing:
        return ""
    before = f"line-{int(missing[0][5:]) - 1:05d}"
    rows = output.splitlines()
    at = next((i for i, row in enumerate(rows) if before in row), 0)
    return "\n".join(rows[max(0, at - 2) : at + 12])


@dataclass
class Caller:
    """One calling script going through the outage on one submission path."""

    submission: str
    name: str
    proc: subprocess.Popen
    pid_file: Path
    out_path: Path


def run_through_outage(
    tmp_path: Path,
    gate: ApiGate,
    worker_factory,
    outage_s: float,
    job_s: float,
    cut_after_s: float,
    lines: int = 0,
    client_retries: int | None = None,
    submissions: tuple[str, ...] = ("in-process", "worker"),
) -> None:
    """Both submission paths side by side through one outage: each row holds on each path on its own (separate
    callers, pools and jobs), and one outage costs half of two."""
    extra = {"PREFECT_API_URL": gate.url}
    if client_retries is not None:  # Prefect's own retry window, shrunk so a short outage outlasts it
        extra["PREFECT_CLIENT_MAX_RETRIES"] = str(client_retries)
    env = {**os.environ, **extra}
    lines = lines or int(job_s * 5)
    pools = {
        # the default pool is created on first use (no CLI start at a high load average)
        submission: worker_factory(env=extra).start().pool if submission == "worker" else "kinetic-local"
        for submission in submissions
    }
    callers: list[Caller] = []
    for submission in submissions:
        folder = tmp_path / submission
        folder.mkdir()
        name = f"outage-{int(outage_s)}-{submission[:2]}-{uuid.uuid4().hex[:6]}"
        script = folder / "caller.py"
        script.write_text(SCRIPT)
        pid_file, out_path = folder / "job.pid", folder / "caller.out"
        argv = [sys.executable, str(script), name, pools[submission], submission, str(pid_file), str(lines)]
        with open(out_path, "w") as out:
            proc = subprocess.Popen(
                [*argv, str(job_s / lines)], cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        callers.append(Caller(submission, name, proc, pid_file, out_path))
    try:
        for caller in callers:
            read_pid(caller.pid_file, timeout=180)
        time.sleep(cut_after_s)
        gate.cut()
        time.sleep(outage_s)
        gate.restore()
        for caller in callers:
            caller.proc.wait(timeout=job_s + outage_s + 240)
    finally:
        for caller in callers:
            if caller.proc.poll() is None:
                caller.proc.kill()
    for caller in callers:
        _check_caller(caller, lines)
    print(f"{', '.join(submissions)}: API away {gate.outages[-1]:.1f} s; {lines} lines each, all arrived once")


def _check_caller(caller: Caller, lines: int) -> None:
    output = caller.out_path.read_text()
    where = f"[{caller.submission}] "
    assert caller.proc.returncode == 0, where + output[-4000:]
    assert f"VALUE {lines}" in output, where + output[-4000:]
    expected = [f"line-{i:05d}" for i in range(lines)]
    printed = re.findall(r"line-\d{5}", output)
    missing = sorted(set(expected) - set(printed))
    assert sorted(printed) == expected, (
        f"{where}the caller's terminal: {len(missing)} lines missing, {len(printed) - len(set(printed))} repeated; "
        f"around the first gap:\n{_around(output, missing)}"
    )
    [run] = final_job_run(caller.name, timeout=60)
    assert run.state.is_completed(), (caller.submission, run.state)
    assert task_run_of(run).state.is_completed(), (caller.submission, task_run_of(run).state)
    stored = _job_log_lines(run.id)
    assert stored == expected, (
        f"{where}the job run's logs: {len(set(expected) - set(stored))} lines missing, "
        f"{len(stored) - len(set(stored))} repeated"
    )
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(task_run_of(run).flow_run_id)
    assert parent.state.is_completed(), (caller.submission, parent.state)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's server start (minutes at a high load average) counts in the first test
def test_an_outage_in_the_middle_of_a_job(tmp_path, gate, worker_factory):
    run_through_outage(tmp_path, gate, worker_factory, outage_s=12, job_s=20, cut_after_s=4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_outage_longer_than_prefects_retries_the_job_ends_while_the_api_is_away(tmp_path, gate, worker_factory):
    """25 s away with Prefect's client retries at 2 (≈ 6 s): the jobs end 8 s (or less) into the outage.

    Needs ≈ 70 s: two callers and a worker start, the 25 s outage itself, and the retried state writes after it."""
    run_through_outage(tmp_path, gate, worker_factory, outage_s=25, job_s=12, cut_after_s=4, client_retries=2)


@pytest.mark.slow
@pytest.mark.slow_tier  # a 5-minute outage under Prefect's default client retries
@pytest.mark.timeout(1200)
def test_a_5_minute_outage(tmp_path, gate, worker_factory):
    run_through_outage(tmp_path, gate, worker_factory, outage_s=300, job_s=60, cut_after_s=10)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_server_process_restarts_during_a_job(tmp_path, prefect_server_process, worker_factory):
    """Not a cut connection but the server itself: `prefect server start` is stopped 4 s into the jobs and started
    again on the same database (SQLite here, PostgreSQL in the PostgreSQL session of .ci/run).

    Needs ≈ 80 s: most of it is `prefect server start` coming back (migrations checked, services started) while
    both jobs run on; no shorter stand-in restarts the real process."""
    run_through_outage(tmp_path, prefect_server_process, worker_factory, outage_s=8, job_s=20, cut_after_s=4)


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_the_worker_and_the_server_both_restart(tmp_path, gate, worker_factory):
    """The API goes away, the polling worker is killed while it is away, and both come back: the restarted worker
    reattaches to the job that ran on meanwhile, the caller gets its value and every line arrives once."""
    worker = worker_factory(env={"PREFECT_API_URL": gate.url}).start()
    name = f"both-{uuid.uuid4().hex[:6]}"
    lines, job_s = 150, 30.0  # the job still runs when the restarted worker (≈ 10 s to start) reattaches
    script = tmp_path / "caller.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / "job.pid"
    out_path = tmp_path / "caller.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), name, worker.pool, "worker", str(pid_file), str(lines), str(job_s / lines)],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PREFECT_API_URL": gate.url},
        )
    try:
        read_pid(pid_file, timeout=180)
        time.sleep(4)
        gate.cut()
        time.sleep(2)
        worker.kill()
        time.sleep(8)
        gate.restore()
        worker.start()
        proc.wait(timeout=job_s + 240)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = out_path.read_text()
    assert proc.returncode == 0 and f"VALUE {lines}" in output, output[-4000:]
    assert "Reattach" in worker.log_path.read_text()
    expected = [f"line-{i:05d}" for i in range(lines)]
    assert sorted(re.findall(r"line-\d{5}", output)) == expected
    [run] = final_job_run(name, timeout=60)
    assert run.state.is_completed(), run.state
    assert _job_log_lines(run.id) == expected


BUDGET_SCRIPT = textwrap.dedent("""
    import sys
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, PID_FILE = sys.argv[1:3]

    # $360/h is $0.10 a second: the $1 budget holds 10 s, the body takes 3
    @kinetic_task(
        name=NAME, submission="in-process", max_cost_usd=1.0,
        job_variables={"prices": {"cpu": {"on_demand": 360, "source": "test"}}},
    )
    def short(pid_path: str) -> str:
        import os, pathlib, time
        pathlib.Path(pid_path).write_text(str(os.getpid()))
        time.sleep(3)
        return "kept"

    @flow(name=NAME + "-flow")
    def pipeline():
        return short(PID_FILE)

    if __name__ == "__main__":
        print("VALUE", pipeline(), flush=True)
""")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_job_that_ends_during_an_outage_is_billed_to_its_own_end_and_keeps_its_value(tmp_path, gate):
    """The follow loop is blocked while the API is away, so it sees a job that ended meanwhile only afterwards.
    Billed to then, a 3 s job behind a 14 s outage went over its 10 s budget and lost its value (Failed,
    BudgetExceeded, its result deleted). The job is billed to the runner's own exit record, and a job that has
    ended is never stopped for its budget. ≈ 27 s: the outage itself (14 s) and a caller script's start."""
    from test_cost import artifacts, table

    from kinetic_prefect.contract import JOB_COST_ARTIFACT_KEY

    name = f"outage-bill-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "caller.py"
    script.write_text(BUDGET_SCRIPT)
    pid_file = tmp_path / "job.pid"
    proc = subprocess.Popen(
        [sys.executable, str(script), name, str(pid_file)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PREFECT_API_URL": gate.url},
    )
    try:
        read_pid(pid_file, timeout=180)
        time.sleep(1)
        gate.cut()
        time.sleep(14)
        gate.restore()
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "VALUE kept" in output, output[-4000:]
    [run] = final_job_run(name, timeout=60)
    assert run.state.is_completed(), run.state
    [row] = table(artifacts(run.id, JOB_COST_ARTIFACT_KEY)[-1])
    assert row["minutes"] * 60 < 8, row  # the body's 3 s and the runner's start, not the 15 s until the API was back
