"""A large ``.map()`` on the session's SQLite server (the embedded default's database): every value returned, every
job run final, and the caller's Prefect API client made once per process, not once per input (issue 33).

Before, a 256-input map failed on SQLite (503 "database is locked" on the job runs' creation after the retries)
and every input started a Prefect client of its own (``GET /csrf-token`` per input).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow
from test_spine import job_runs

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

    @flow
    def sweep() -> list[int]:
        return noop.map(range(inputs)).result()

    started = time.monotonic()
    values = sweep()
    return values, name, time.monotonic() - started


def _assert_every_value_and_run(inputs: int, values: list[int], name: str) -> None:
    assert values == list(range(inputs))
    runs = _all_job_runs(name)
    assert len(runs) == inputs
    not_final = [(run.name, run.state.name) for run in runs if not run.state.is_final()]
    assert not not_final, not_final[:10]
    assert all(run.state.is_completed() for run in runs)


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
    the process makes one, whatever the map's size. 96 s on 2 loaded cores."""
    values, name, _took = _map_of_noops(32, None, "in-process")
    assert values == list(range(32))
    # the few clients of the process (the flow engine's, its background senders', the calls' one): not one per input
    assert request_counts[CSRF] <= 4, dict(request_counts.most_common(12))
    assert len(job_runs(name)) == 32


@pytest.mark.slow
@pytest.mark.slow_tier  # 300-510 s in a CI run: over the default run's budget for one test
@pytest.mark.timeout(900)
def test_a_128_input_map_on_the_sqlite_server_returns_every_value():
    """128 no-op inputs, in-process: twice the 64 inputs that already failed on a loaded machine before (503
    "database is locked" on the runs' creation, after the retries; 256 failed on a quiet one). It needs its time:
    128 task runs, tracking task runs and job runs, each with its state changes and artifacts, on one SQLite
    writer and 2 cores (296 s on 2 cores shared with other test sessions). 256 and 1,000 inputs: the slow tier."""
    values, name, _took = _map_of_noops(128, None, "in-process")
    _assert_every_value_and_run(128, values, name)


@pytest.mark.slow_tier
@pytest.mark.timeout(900)
def test_a_256_input_map_on_the_sqlite_server_returns_every_value():
    """256 no-op inputs, in-process: the size that failed on a quiet machine before. ≈ 2.5-5.5 min."""
    values, name, _took = _map_of_noops(256, None, "in-process")
    _assert_every_value_and_run(256, values, name)


@pytest.mark.scale_goal  # issue 33's target: a job run per input does not reach 1,000 inputs in under an hour
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("submission", ["in-process", "worker"])
def test_a_1000_input_map_on_the_sqlite_server_returns_every_value(submission, worker_factory):
    """1,000 no-op inputs on the SQLite server, in-process and through a polling kinetic-local worker (its pool
    limited to 16 runs at once: a worker claims every Scheduled run it sees otherwise). Issue 33's goal, not met
    yet: with a job run per input it made 33 job runs in 4.5 min on a loaded machine (≈ 2 h for 1,000)."""
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
