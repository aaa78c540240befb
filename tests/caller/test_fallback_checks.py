"""Every entry of a fallback list is checked before anything is uploaded, not on the day the pools before it are
stocked out: a later pool that does not exist, or whose type cannot run its entry (``vx/tpu-v6e-8`` on
kinetic-vertex), fails the call at once, naming the entry, the pool and the fix. And kinetic-vertex's "cannot run
here" check reads the call's accelerator, not the pool's default (a client-boundary check: no Vertex, no Docker)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, TaskRunFilter, TaskRunFilterName
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task
from kinetic_prefect.caller.job_settings import checked_pool
from kinetic_prefect.caller.options import TaskOptions
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker


def _job_runs(task_name: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))


def _vertex_pool(**defaults) -> str:
    """A kinetic-vertex pool that runs a given image (so only the accelerator can refuse a call)."""
    template = KineticVertexWorker.get_default_base_job_template()
    for key, value in {"image": "us-docker.pkg.dev/proj/repo/job:abc", "gcp_project": "proj", **defaults}.items():
        template["variables"]["properties"][key]["default"] = value
    name = f"vx-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type=KineticVertexWorker.type, base_job_template=template))
    return name


def _refused(first_pool: str, accelerator: list[str]) -> tuple[str, str]:
    """A call in a flow whose first pool could run it: the error it raised, and the task's name."""
    name = f"fallback-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name,
        work_pool=first_pool,
        accelerator=accelerator,
        submission="in-process",
        retries=2,
        retry_delay_seconds=0,
    )
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(ValueError) as refused:
        pipeline()
    with get_client(sync_client=True) as client:
        [task_run] = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
    assert task_run.run_count == 1, "a refusal that would be the same on every attempt is not retried"
    return str(refused.value), name


def test_a_fallback_pool_that_does_not_exist_fails_the_call_before_anything_runs():
    missing = f"no-such-pool-{uuid.uuid4().hex[:6]}"
    message, name = _refused(new_pool("first"), ["cpu", f"{missing}/cpu"])
    assert f"{missing}/cpu" in message and f"work pool {missing!r} does not exist" in message, message
    assert "prefect work-pool create" in message, "the fix is named"
    assert _job_runs(name) == [], "nothing ran on the first pool"


def test_a_fallback_entry_its_pool_cannot_run_fails_the_call_before_anything_runs():
    vx = _vertex_pool()
    message, name = _refused(new_pool("first"), ["cpu", f"{vx}/tpu-v6e-8"])
    assert f"{vx}/tpu-v6e-8" in message and "cannot run on Vertex AI" in message, message
    assert "tpu-v5litepod-8" in message, "the nearest entry Vertex runs is named"
    assert _job_runs(name) == []


def _check(pool: str, accelerator: str) -> None:
    async def check() -> None:
        async with get_client() as client:
            await checked_pool(client, TaskOptions(accelerator=accelerator, work_pool=pool).resolve())

    asyncio.run(check())


def test_kinetic_vertex_checks_the_calls_accelerator_not_the_pools_default():
    with pytest.raises(ValueError, match="'tpu-v6e-8' cannot run on Vertex AI"):
        _check(_vertex_pool(accelerator="cpu"), "tpu-v6e-8")  # refused before upload, not by the worker
    _check(_vertex_pool(accelerator="tpu-v6e-8"), "l4")  # the pool's default does not refuse a call for l4
