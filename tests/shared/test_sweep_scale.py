"""A large ``.map()`` on the session's SQLite server (the embedded default's database): every value returned, every
input's task run and every job run final, and the caller's Prefect API client made once per process, not once per
input (issue 33).

Before, a 256-input map failed on SQLite (503 "database is locked" on the job runs' creation after the retries)
and every input started a Prefect client of its own (``GET /csrf-token`` per input). A newcomer's map now rides in
slots (a few job runs, whatever the size); the per-call path (``KINETIC_SWEEP_SLOTS=0``) is measured at 128 inputs.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow

from kinetic_prefect import kinetic_task

CSRF = "GET /csrf-token"


def _all_job_runs(name: str) -> list[Any]:
    """Every job run of ``name`` (the API answers 200 a page)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs: list[Any] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[name])), limit=200, offset=len(runs)
            )
            runs += page
            if len(page) < 200:
                return runs


def _map_of_noops(inputs: int, pool: str | None, submission: str) -> tuple[list[int], str, float]:
    name = f"scale-{inputs}-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, submission=submission, ship_project=False)
    def noop(i: int) -> int:
        return i

    @flow(name=f"{name}-flow")
    def sweep() -> list[int]:
        return noop.map(range(inputs)).result()

    started = time.monotonic()
    values = sweep()
    return values, name, time.monotonic() - started


def _input_task_runs(name: str) -> list[Any]:
    """The task runs of the map's inputs (the task's own, not the job runs' trackers), every page."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        TaskRunFilter,
        TaskRunFilterName,
    )

    from kinetic_prefect.contract import TRACKING_TASK_KEY_PREFIX

    runs: list[Any] = []
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[f"{name}-flow"])))
        ids = [run.id for run in flow_runs]
        while True:
            page = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": ids}),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)),
                limit=200,
                offset=len(runs),
            )
            runs += page
            if len(page) < 200:
                return [run for run in runs if not run.task_key.startswith(TRACKING_TASK_KEY_PREFIX)]


def _assert_every_value_and_run(inputs: int, values: list[int], name: str, slots: bool = True) -> None:
    """Every value, every input's task run Completed; the job runs (one per input, or the slots') all end
    Completed (a slot's run ends a moment after the flow's, once the sweep closed)."""
    assert values == list(range(inputs))
    task_runs = _input_task_runs(name)
    assert len(task_runs) == inputs, len(task_runs)
    assert all(run.state.is_completed() for run in task_runs), [r.state.name for r in task_runs][:10]

    def all_final() -> list[Any] | None:
        runs = _all_job_runs(name)
        return runs if all(run.state.is_final() for run in runs) else None

    runs = _wait(all_final, 60, "every job run final")
    assert all(run.state.is_completed() for run in runs), [(r.name, r.state.name) for r in runs][:10]
    if slots:  # a few slots carried the inputs (an input with no sibling yet may have had its own job run)
        assert len(runs) <= 2 * max(4, 2 * (os.cpu_count() or 1)), len(runs)
    else:
        assert len(runs) == inputs


def _wait(probe: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def request_counts(monkeypatch) -> collections.Counter[str]:
    """Every HTTP request of this process to the API, by method and path (ids as ``{id}``), below Prefect's client
    and its retries (bench/api_calls.py counts the same way)."""
    import re

    import httpx

    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    ids = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    original = httpx.AsyncClient.send

    async def send(self, request, *args, **kwargs):
        with lock:
            counts[f"{request.method} {ids.sub('{id}', request.url.path.split('/api', 1)[-1])}"] += 1
        return await original(self, request, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", send)
    return counts


@pytest.mark.slow
def test_the_calls_of_a_map_share_one_prefect_client(request_counts):
    """32 inputs in-process: a client per input made 32 ``GET /csrf-token`` (one per client start); one client of
    the process makes one, whatever the map's size. In slots (the default), ≈ 20 s."""
    values, name, _took = _map_of_noops(32, None, "in-process")
    # the few clients of the process (the flow engine's, its background senders', the calls' one): not one per input
    assert request_counts[CSRF] <= 4, dict(request_counts.most_common(12))
    _assert_every_value_and_run(32, values, name)


@pytest.mark.slow
@pytest.mark.slow_tier  # 300-510 s in a CI run: over the default run's budget for one test
@pytest.mark.timeout(900)
def test_a_128_input_map_with_a_job_run_per_call_on_the_sqlite_server_returns_every_value(monkeypatch):
    """128 no-op inputs, in-process, slots off (the path of a fan-out slots do not carry): twice the 64 inputs
    that already failed on a loaded machine before (503 "database is locked" on the runs' creation, after the
    retries; 256 failed on a quiet one). It needs its time: 128 task runs, tracking task runs and job runs, each
    with its state changes and artifacts, on one SQLite writer and 2 cores (296 s on 2 cores shared with other
    test sessions)."""
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")
    values, name, _took = _map_of_noops(128, None, "in-process")
    _assert_every_value_and_run(128, values, name, slots=False)


@pytest.mark.slow_tier
@pytest.mark.timeout(900)
def test_a_256_input_map_on_the_sqlite_server_returns_every_value():
    """256 no-op inputs, in-process, in slots (the default): the size that failed on a quiet machine before."""
    values, name, _took = _map_of_noops(256, None, "in-process")
    _assert_every_value_and_run(256, values, name)


@pytest.mark.slow_tier  # ≈ 100 s each
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("submission", ["in-process", "worker"])
def test_a_1000_input_map_on_the_sqlite_server_returns_every_value(submission, worker_factory):
    """1,000 no-op inputs on the SQLite server, in-process and through a polling kinetic-local worker (its pool
    limited to 16 runs at once: a worker claims every Scheduled run it sees otherwise), in slots (the default).
    With a job run per input it made 33 job runs in 4.5 min on a loaded machine (≈ 2 h for 1,000); in slots
    92-102 s on 2 cores."""
    pool = None
    if submission == "worker":
        from prefect import get_client

        worker = worker_factory()
        with get_client(sync_client=True) as client:
            client.update_work_pool(worker.pool, _concurrency(16))
        worker.start()
        pool = worker.pool
    values, name, _took = _map_of_noops(1000, pool, submission)
    _assert_every_value_and_run(1000, values, name)


def _concurrency(limit: int) -> Any:
    from prefect.client.schemas.actions import WorkPoolUpdate

    return WorkPoolUpdate(concurrency_limit=limit)


# --------------------------------------------------------------------------- the shared reader, without a server


class _CountingClient:
    """What FlowRunReader uses of a PrefectClient: a batch read (counted) and a single read (for a missing run)."""

    def __init__(self, known: set[uuid.UUID]):
        self.known, self.batches = known, []

    async def read_flow_runs(self, flow_run_filter: Any, limit: int) -> list[Any]:
        ids = list(flow_run_filter.id.any_)
        self.batches.append(len(ids))
        await asyncio.sleep(0.01)
        return [SimpleNamespace(id=i, state=None) for i in ids if i in self.known][:limit]

    async def read_flow_run(self, flow_run_id: uuid.UUID) -> Any:
        from prefect.exceptions import ObjectNotFound

        raise ObjectNotFound(http_exc=Exception("404"), help_message=f"no flow run {flow_run_id}")


@pytest.mark.no_server
def test_the_waiting_calls_of_a_process_read_their_runs_in_one_request_per_200():
    """300 calls asking at once are answered by 2 requests (pages of 200), each with its own run; a run the API no
    longer has raises Prefect's ObjectNotFound to its caller alone."""
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect.shared.prefect_runs import FlowRunReader

    ids = [uuid.uuid4() for _ in range(300)]
    gone = uuid.uuid4()
    client = _CountingClient(set(ids))

    async def ask_all() -> list[Any]:
        reader = FlowRunReader(client)  # type: ignore[arg-type]  # a stand-in with the two reads it uses
        return await asyncio.gather(*(reader.read(i) for i in [*ids, gone]), return_exceptions=True)

    answers = asyncio.run(ask_all())
    assert sorted(client.batches) == [101, 200]  # 301 ids asked: the missing one is asked in a batch too
    assert [a.id for a in answers[:-1]] == ids
    assert isinstance(answers[-1], ObjectNotFound)


@pytest.mark.no_server
def test_an_interrupt_wakes_every_waiting_call_and_many_waiting_calls_wake_less_often(monkeypatch):
    """1,000 calls waking 5 times a second each starved the event loop they share (the GIL): with 200 waiting, each
    wakes by itself every 0.8 s, and one watcher wakes them all within a look (0.2 s) of the script's interrupt."""
    from kinetic_prefect.shared import sweeps

    interrupted = threading.Event()
    monkeypatch.setattr(sweeps, "caller_interrupted", interrupted.is_set)
    wakes = [threading.Event() for _ in range(200)]
    for wake in wakes:
        sweeps.wake_on_interrupt(wake)
    try:
        assert sweeps.wake_seconds() == pytest.approx(0.8)
        time.sleep(0.5)
        assert not any(wake.is_set() for wake in wakes)  # no interrupt: nobody is woken
        interrupted.set()
        deadline = time.monotonic() + 2 * sweeps.WATCH_SECONDS + 0.5
        while not all(wake.is_set() for wake in wakes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(wake.is_set() for wake in wakes)
    finally:
        for wake in wakes:
            sweeps.stop_waking(wake)
    assert sweeps.wake_seconds() == sweeps.WATCH_SECONDS
