"""``async def`` kinetic tasks behave as Prefect async tasks: the call is awaitable, ``.submit()`` works, and the
flow's event loop stays free while the job runs (a ticker on that loop keeps ticking)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prefect import flow

from kinetic_prefect import kinetic_task
from kinetic_prefect.errors import KineticJobCancelled

JOB_SECONDS = 4.0
TICK_SECONDS = 0.05
# The session server's start (minutes at a high load average) counts in the first test's time.
pytestmark = pytest.mark.timeout(900)


def _sleeper(name: str):
    @kinetic_task(name=name, submission="in-process")
    async def double_later(x: int, seconds: float = JOB_SECONDS) -> int:
        import asyncio as _asyncio

        await _asyncio.sleep(seconds)
        return 2 * x

    return double_later


@pytest.mark.slow
def test_an_async_task_is_awaited_and_the_loop_stays_free():
    task = _sleeper(f"async-{uuid.uuid4().hex[:6]}")

    @flow
    async def pipeline() -> tuple[int, float, float]:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(TICK_SECONDS)

        ticking = asyncio.create_task(ticker())
        started = time.monotonic()
        value = await task(21)
        waited = time.monotonic() - started
        ticking.cancel()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        return value, waited, max(gaps)

    value, waited, longest_gap = asyncio.run(pipeline())
    assert value == 42
    assert waited >= JOB_SECONDS
    # A blocked loop shows one gap as long as the job; a free one only scheduling jitter (a loaded machine: < 1.5 s).
    assert longest_gap < 1.5, f"the flow's loop was blocked for {longest_gap:.1f} s of a {waited:.1f} s wait"


@pytest.mark.slow
def test_an_async_task_can_be_submitted_in_an_async_flow():
    task = _sleeper(f"async-submit-{uuid.uuid4().hex[:6]}")

    @flow
    async def pipeline() -> list[int]:
        futures = [task.submit(i, 1.0) for i in (1, 2)]
        return [future.result() for future in futures]

    assert asyncio.run(pipeline()) == [2, 4]


def test_a_cancelled_async_call_raises(tmp_path):
    from prefect import get_client
    from prefect.states import Cancelling
    from test_lifecycle import job_runs, wait_for

    name = f"async-cancel-{uuid.uuid4().hex[:6]}"
    task = _sleeper(name)

    async def cancel_when_started() -> None:
        while not job_runs(name) or not job_runs(name)[0].state.is_running():
            await asyncio.sleep(0.3)
        async with get_client() as client:
            await client.set_flow_run_state(job_runs(name)[0].id, Cancelling(message="stop it"), force=True)

    @flow
    async def pipeline() -> str:
        canceller = asyncio.create_task(cancel_when_started())
        try:
            await task(1, 60)
        except KineticJobCancelled:
            return "raised"
        finally:
            canceller.cancel()
        return "returned"

    assert asyncio.run(pipeline()) == "raised"
    assert wait_for(lambda: job_runs(name)[0].state.is_cancelled(), 30, "the job run to be Cancelled")


@pytest.mark.parametrize("body", ["sync", "async"])
def test_the_call_style_follows_the_body(body):
    """A sync body stays a sync task (its call returns the value); an async one is a coroutine function."""
    import inspect

    if body == "async":

        async def f(x: int) -> int:
            return x
    else:

        def f(x: int) -> int:
            return x

    task = kinetic_task(name=f"style-{body}")(f)
    assert inspect.iscoroutinefunction(task.fn) is (body == "async")
    assert task.isasync is (body == "async")
