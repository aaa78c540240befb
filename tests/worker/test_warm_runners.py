"""Warm runners on kinetic-local: a runner process that finished a call takes the next call of its environment.

Every call keeps its own job run (state, logs, value), a stopped call stops its runner, the user's project modules
are imported afresh per call, idle runners leave after the pool's keep-warm time, and ``min_warm`` keep some ready.
"""

from __future__ import annotations

import time
import uuid

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.states import Cancelling
from test_lifecycle import alive, final_job_run, job_runs, wait_for
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task


def warm_task(name: str, pool: str, submission: str = "in-process", keep_warm: float = 20, min_warm: int = 0):
    import warm_state  # a project module: imported by the job from the shipped project

    @kinetic_task(
        name=name,
        work_pool=pool,
        submission=submission,
        job_variables={"keep_warm_seconds": keep_warm, "min_warm": min_warm},
    )
    def call(i: int, sleep: float = 0.0) -> tuple[int, list[int]]:
        import os
        import time as _time

        warm_state.CALLS.append(i)
        print(f"warm call {i} in {os.getpid()}", flush=True)
        _time.sleep(sleep)
        return os.getpid(), list(warm_state.CALLS)

    return call


def log_lines(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


@pytest.mark.slow
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_sweep_reuses_runners_and_every_call_keeps_its_own_run_and_logs(monkeypatch, signed):
    """Signed: every call after a runner's first comes through a signed hand-over that carries the call's own
    keys (the runner verifies its payload and signs its result with them)."""
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")  # a job run per call; the same map in slots: test_slots.py
    if signed:
        monkeypatch.setenv("KINETIC_SIGNING_KEY", "warm-" + uuid.uuid4().hex)
    name = f"warm-{uuid.uuid4().hex[:6]}"
    call = warm_task(name, new_pool("warm"), keep_warm=20)

    @flow
    def sweep(n: int):
        return call.map(range(n), sleep=0.5).result()

    first = sweep(8)
    pids = {pid for pid, _ in first}
    # 8 calls, at most 4 at a time in-process (KINETIC_IN_PROCESS_CONCURRENCY on 2 cores): runners were reused.
    assert len(pids) < 8, first
    # Fresh import of the project module per call: its state never carries over from an earlier call.
    assert [calls for _, calls in first] == [[i] for i in range(8)], first
    runs = final_job_run(name)
    assert len(runs) == 8 and all(r.state.is_completed() for r in runs), [r.state.name for r in runs]
    for run in runs:  # each call's output reached its own run only
        mine = [line for line in log_lines(run.id) if line.startswith("warm call")]
        assert len(mine) == 1, (run.name, mine)
    second = sweep(2)  # a sweep right after: the idle runners take it
    assert {pid for pid, _ in second} <= pids, (pids, second)


@pytest.mark.slow
def test_idle_runners_leave_after_the_keep_warm_time_and_min_warm_stay(monkeypatch):
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")  # warm runners of single job runs (slots have no floor)
    name = f"warm-idle-{uuid.uuid4().hex[:6]}"
    pool = new_pool("warm")
    short = warm_task(name, pool, keep_warm=1)
    kept = warm_task(f"{name}-min", pool, keep_warm=1, min_warm=1)

    @flow
    def sweeps():
        return short.map(range(3)).result(), kept.map(range(3), sleep=0.3).result()

    # Both tasks have one environment, so the second sweep may take runners the first one warmed; one of them then
    # joins the floor (on PostgreSQL, where the calls come faster, min_warm was left with none).
    gone, stays = sweeps()
    pids = {p for p, _ in gone} | {p for p, _ in stays}
    wait_for(lambda: sum(alive(p) for p in pids) <= 1 or None, 30, "idle runners to leave")
    time.sleep(2)
    assert sum(alive(p) for p in pids) == 1, "min_warm=1 keeps exactly one runner of that environment"
    assert any(alive(p) for p in {p for p, _ in stays}), "the floor runner is one that served the min_warm task"


@pytest.mark.slow
def test_stopping_a_call_stops_its_runner_and_the_next_call_gets_a_fresh_one(tmp_path):
    name = f"warm-stop-{uuid.uuid4().hex[:6]}"
    call = warm_task(name, new_pool("warm"), keep_warm=20)

    @flow
    def one(i: int, sleep: float):
        return call(i, sleep, return_state=True)

    pid, _ = one(0, 0.0).result()
    from test_lifecycle import in_thread

    thread, box = in_thread(lambda: one(1, 60.0, return_state=True))
    running = wait_for(lambda: [r for r in job_runs(name) if r.state.is_running()], 60, "the second call to run")
    wait_for(lambda: any(line.startswith("warm call 1") for line in log_lines(running[0].id)), 30, "its output")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(running[0].id, Cancelling(message="stop it"), force=True)
    thread.join(60)
    assert box["value"].is_cancelled(), box  # the flow that waited for it ends Cancelled too
    assert not alive(pid), "the stopped call's runner (the one the first call warmed) is gone"
    fresh, calls = one(2, 0.0).result()
    assert fresh != pid and calls == [2]


@pytest.mark.slow
def test_a_call_that_leaves_a_thread_running_does_not_write_into_the_next_calls_logs():
    """A thread started by a warm call went on printing into the job-run logs of the calls after it (the runner's
    stdout is each call's log in turn), and `sys.setrecursionlimit` carried over. A runner whose call left a
    thread running leaves after that call; the recursion limit is restored after every call. ≈ 12 s: three
    calls, one of them on a fresh runner, and the runner's 1 s grace for a call's threads."""
    name = f"warm-thread-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=new_pool("warm"), job_variables={"keep_warm_seconds": 20})
    def call(i: int, leave_a_thread: bool) -> tuple[int, int]:
        import os
        import sys
        import threading
        import time as _time

        if leave_a_thread:
            sys.setrecursionlimit(50_000)

            def chatter() -> None:
                while True:
                    print("stray line from call 0", flush=True)
                    _time.sleep(0.2)

            threading.Thread(target=chatter, name="chatter", daemon=True).start()
            _time.sleep(0.5)
        return os.getpid(), sys.getrecursionlimit()

    @flow
    def calls():
        first = call(0, True)
        return first, call(1, False), call(2, False)

    (pid0, _), (pid1, limit1), (pid2, limit2) = calls()
    assert pid1 != pid0, "the runner whose call left a thread was reused"
    assert pid2 == pid1, "a runner whose call left nothing is reused as before"
    assert limit1 == limit2 != 50_000
    for run in sorted(final_job_run(name), key=lambda r: r.created)[1:]:  # calls 1 and 2
        assert not [line for line in log_lines(run.id) if "stray line" in line], run.name


@pytest.mark.slow
def test_warm_list_shows_the_floor_warm_down_ends_it_and_bills_its_idle_time_to_the_pool(capsys):
    """`min_warm` runners never ended but by a kill, and their idle time was billed to no one. `warm list` shows
    the floor runner (pool, calls, floor, idle cost at the pool's price), `warm down` ends it and publishes its idle
    time as the pool's cost; a pool's `warm_floor_idle_seconds` lets a floor runner leave by itself. ≈ 15 s: two
    real warm calls and their runners' lives."""
    from test_cost import CPU_PER_HOUR, events, priced_pool
    from test_lifecycle import alive

    from kinetic_prefect.cli import main

    pool = priced_pool(keep_warm_seconds=30, min_warm=1)
    limited = priced_pool(keep_warm_seconds=30, min_warm=1, warm_floor_idle_seconds=1)
    floor = warm_task(f"floor-{uuid.uuid4().hex[:6]}", pool, keep_warm=30, min_warm=1)
    leaves = warm_task(f"floor-idle-{uuid.uuid4().hex[:6]}", limited, keep_warm=30, min_warm=1)

    @flow
    def call(task):
        return task(1)

    # one environment: the limited floor runner leaves first, then the other pool's call starts a runner of its own
    limited_pid, _ = call(leaves)
    wait_for(lambda: not alive(limited_pid) or None, 20, "the floor runner with an idle limit to leave")
    kept_pid, _ = call(floor)
    time.sleep(1.0)
    assert main(["warm", "list", "--pool", pool]) in (0, None)
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith(pool)]
    assert len(listed) == 1 and str(kept_pid) in listed[0], out
    assert " yes " in listed[0] and "$0.0" in listed[0], listed[0]  # a floor runner, priced at the pool's cpu price
    assert main(["warm", "down", "--pool", pool, "--yes"]) in (0, None)
    out = capsys.readouterr().out
    assert f"ended runner {kept_pid}" in out and "pool-set POOL min_warm=0" in out, out
    wait_for(lambda: not alive(kept_pid) or None, 10, "warm down to end the floor runner")
    with get_client(sync_client=True) as client:
        pool_id = client.read_work_pool(pool).id
    [event] = events("kinetic.work-pool.warm-idle", f"prefect.work-pool.{pool_id}", until=bool)
    assert event["payload"]["hosts"] == 1 and event["payload"]["usd_per_hour"] == CPU_PER_HOUR
    assert event["payload"]["usd"] > 0 and event["payload"]["minutes"] > 0.01, event["payload"]


@pytest.mark.slow
def test_a_floor_runner_leaving_by_its_idle_limit_bills_its_idle_time_to_the_pool():
    """A floor runner that left by its pool's `warm_floor_idle_seconds` billed its idle time to no one (only `warm
    down` published it). Its launcher now publishes it as the pool's cost: `kinetic.work-pool.warm-idle` on the
    work pool, floor, ≈ the 2 s idle limit at the pool's price. ≈ 10 s: one warm call and the runner's idle limit."""
    from test_cost import CPU_PER_HOUR, events, priced_pool

    from kinetic_prefect.contract import WARM_IDLE_EVENT

    pool = priced_pool(keep_warm_seconds=30, min_warm=1, warm_floor_idle_seconds=2)
    task = warm_task(f"floor-left-{uuid.uuid4().hex[:6]}", pool, keep_warm=30, min_warm=1)

    @flow
    def call():
        return task(1)

    pid, _ = call()
    wait_for(lambda: not alive(pid) or None, 20, "the floor runner to leave by its idle limit")
    with get_client(sync_client=True) as client:
        pool_id = client.read_work_pool(pool).id
    [event] = events(WARM_IDLE_EVENT, f"prefect.work-pool.{pool_id}", until=bool)
    payload = event["payload"]
    assert payload["floor"] is True and payload["runner"] == str(pid) and payload["calls"] == 1, payload
    assert payload["hosts"] == 1 and payload["accelerator"] == "cpu" and payload["usd_per_hour"] == CPU_PER_HOUR
    assert 1.9 <= payload["minutes"] * 60 < 6, payload  # the idle limit, and the runner's poll and exit after it
    assert payload["usd"] == pytest.approx(payload["minutes"] / 60 * CPU_PER_HOUR, rel=0.01), payload


@pytest.mark.no_server
def test_a_launcher_bills_only_a_floor_runner_that_left_by_its_idle_limit(tmp_path, monkeypatch):
    """The launcher's half of the test above, without a server: what a runner wrote as it left decides whether its
    idle time is the pool's cost. A floor runner at its idle limit is billed (from its idle start to its leaving);
    a keep-warm runner, a floor runner that left because its launcher was gone, and one stopped (no record, `warm
    down` bills those it ends) are not."""
    import json
    import subprocess
    import sys

    from kinetic_prefect.contract import WarmRunnerFiles
    from kinetic_prefect.shared import warm_idle
    from kinetic_prefect.workers.local import warm

    published = []
    monkeypatch.setattr(warm_idle, "pool_prices", lambda pool: (None, {}))
    monkeypatch.setattr(
        warm_idle, "publish_idle", lambda who, idle, work_pool, drain=False: published.append((who, idle))
    )

    def leaves(floor: bool, why: str | None) -> warm.WarmRunner:
        control = tmp_path / uuid.uuid4().hex
        control.mkdir()
        if why is not None:
            record = {"idle_since": 100.0, "left_at": 130.0, "calls": 3, "why": why}
            (control / WarmRunnerFiles.LEFT).write_text(json.dumps(record))
        process = subprocess.Popen([sys.executable, "-c", "pass"])
        runner = warm.WarmRunner(process, control, "key", floor, pool="p", accelerator="cpu")
        warm._bill_idle_floor_on_leaving(runner)  # returns once the process has ended
        return runner

    billed = leaves(True, WarmRunnerFiles.LEFT_IDLE_LIMIT)
    leaves(False, WarmRunnerFiles.LEFT_IDLE_LIMIT)
    leaves(True, WarmRunnerFiles.LEFT_LAUNCHER_GONE)
    leaves(True, None)
    [(who, idle)] = published
    assert who == warm_idle.IdleRunner(str(billed.process.pid), "p", "cpu", True, 3)
    assert idle.accelerator == "cpu" and idle.hosts == 1 and idle.minutes == pytest.approx(0.5), idle
