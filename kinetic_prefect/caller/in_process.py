"""Caller side, in-process submission: the pool's worker runs the call's job inside the calling process.

The worker is given a client and its pool instead of going through ``setup()`` (heartbeats,
websockets), which a one-shot submission does not need.
"""

from __future__ import annotations

import asyncio
import os
import socket

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun, WorkPool

from kinetic_prefect.caller import timeouts
from kinetic_prefect.caller.pools import worker_class_for
from kinetic_prefect.contract import Env, settings

_in_process_slots: dict[int, asyncio.Semaphore] = {}


def in_process_slots() -> asyncio.Semaphore:
    """How many in-process jobs this process runs at once (``KINETIC_IN_PROCESS_CONCURRENCY``, default
    twice the CPU count, at least 4): a ``.map()`` over hundreds of inputs queues here instead of starting
    hundreds of processes and flooding the API. Polling workers are bounded by their pool's limits."""
    loop = asyncio.get_running_loop()
    if id(loop) not in _in_process_slots:
        default = max(4, 2 * (os.cpu_count() or 1))
        _in_process_slots[id(loop)] = asyncio.Semaphore(settings.IN_PROCESS_CONCURRENCY.value() or default)
    return _in_process_slots[id(loop)]


async def run_in_process(
    client: PrefectClient, pool: WorkPool, flow_run: FlowRun, secret_env: dict[str, str] | None = None
) -> int:
    """Run one flow run with the pool's worker class inside this process; returns the job's exit code."""
    worker_cls = worker_class_for(pool.type)
    worker = worker_cls(
        work_pool_name=pool.name, name=f"in-process@{socket.gethostname()}", create_pool_if_not_found=False
    )
    worker.use_for_one_call(client, pool)
    configuration = await worker_cls.job_configuration.resolve_for_flow_run(
        flow_run, client=client, work_pool=pool, worker_name=worker.name
    )
    configuration.set_secret_env(secret_env or {})  # in memory only: never stored with the run
    worker.owned_by_caller(_api_env())  # the job must not outlive this call (lifecycle.KineticWorker)
    worker.stopped_waiting_reason = timeouts.stopped_waiting_reason  # its run's message if the call stops waiting
    result = await worker.run(flow_run=flow_run, configuration=configuration)
    return result.status_code


def _api_env() -> dict[str, str]:
    """How a job owned by this process reaches Prefect to cancel its own run if the process dies."""
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL

    env = {Env.PREFECT_API_URL: PREFECT_API_URL.value() or ""}
    key = PREFECT_API_KEY.value()
    if key:
        env[Env.PREFECT_API_KEY] = key.get_secret_value() if hasattr(key, "get_secret_value") else str(key)
    return env
