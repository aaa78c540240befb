"""The one place that touches Prefect internals and experimental behaviour.

kinetic-prefect submits a job as a *flow run in a work pool* without a deployment (Prefect
calls this ad-hoc submission). Prefect's own path for that (``bind_flow_to_infrastructure`` →
``BaseWorker.submit``) is experimental and costly for us: it freezes dependencies with
``uv pip freeze``, pickles the worker class into a bundle and adds a parent task run. We use
only stable client calls (create a flow run with ``work_pool_name``/``job_variables``/
``parent_task_run_id``, read states and logs) plus, for in-process submission, a worker
instance that is given a client and its pool instead of going through ``setup()``
(heartbeats, websockets), which a one-shot submission does not need. If Prefect changes any
of this, this module is what changes.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import time
from types import SimpleNamespace
from typing import Any, Callable
from uuid import UUID

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId, LogFilterTimestamp
from prefect.client.schemas.objects import FlowRun, WorkerStatus, WorkPool
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.states import Cancelling, Pending, Scheduled, State
from prefect.workers.base import BaseWorker

from kinetic_prefect import config

# Pools are read once per call site burst, not per call: a short TTL keeps edits in the UI effective.
_POOL_TTL_SECONDS = 30.0
_pool_cache: dict[tuple[str, str], tuple[float, WorkPool]] = {}


class WorkPoolError(LookupError):
    pass


def worker_class_for(pool_type: str) -> type[BaseWorker]:
    cls = BaseWorker.get_worker_class_from_type(pool_type)
    if cls is None or not getattr(cls, "finish_from_outcome", None):
        raise WorkPoolError(
            f"work pool type {pool_type!r} is not a kinetic worker type; use a pool of type "
            "'kinetic-local' or 'kinetic-gke' (prefect work-pool create NAME --type kinetic-local)."
        )
    return cls


async def ensure_work_pool(client: PrefectClient, name: str) -> WorkPool:
    """Read the pool; the default local pool is created on first use, other names must exist."""
    key = (str(client.api_url), name)
    cached = _pool_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _POOL_TTL_SECONDS:
        return cached[1]
    try:
        pool = await client.read_work_pool(name)
    except ObjectNotFound:
        if name != config.DEFAULT_WORK_POOL:
            raise WorkPoolError(
                f"work pool {name!r} does not exist on {client.api_url}. Create it first, e.g. "
                f"`prefect work-pool create {name} --type kinetic-gke`, or omit work_pool= to use the local default."
            ) from None
        from kinetic_prefect.workers.local import KineticLocalWorker

        try:
            pool = await client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type=KineticLocalWorker.type,
                    base_job_template=KineticLocalWorker.get_default_base_job_template(),
                    description="Created by kinetic-prefect on first use: jobs run as local processes.",
                )
            )
        except ObjectAlreadyExists:  # another caller created it a moment ago
            pool = await client.read_work_pool(name)
    worker_class_for(pool.type)
    _pool_cache[key] = (time.monotonic(), pool)
    return pool


def pool_default(pool: WorkPool, variable: str) -> Any:
    return pool.base_job_template.get("variables", {}).get("properties", {}).get(variable, {}).get("default")


async def has_online_worker(client: PrefectClient, pool_name: str) -> bool:
    try:
        workers = await client.read_workers_for_work_pool(pool_name)
    except ObjectNotFound:
        return False
    return any(w.status == WorkerStatus.ONLINE for w in workers)


async def create_job_flow_run(
    client: PrefectClient, *, flow_name: str, run_name: str, pool: WorkPool, job_variables: dict[str, Any],
    parent_task_run_id: UUID | None, tags: list[str], for_polling_worker: bool,
) -> FlowRun:
    # A flow record is all the API needs; no Flow object (and no bundle) is built.
    flow = SimpleNamespace(name=flow_name, version=None, retries=0, retry_delay_seconds=0)
    # Pending runs are invisible to polling workers, so an in-process submission cannot be
    # picked up twice; Scheduled runs are what a polling worker claims.
    state = Scheduled() if for_polling_worker else Pending()
    return await client.create_flow_run(
        flow, name=run_name, state=state, work_pool_name=pool.name, job_variables=job_variables,
        parent_task_run_id=parent_task_run_id, tags=tags,
    )


async def run_in_process(client: PrefectClient, pool: WorkPool, flow_run: FlowRun,
                         secret_env: dict[str, str] | None = None) -> int:
    """Run one flow run with the pool's worker class inside this process; returns the job's exit code."""
    worker_cls = worker_class_for(pool.type)
    worker = worker_cls(work_pool_name=pool.name, name=f"in-process@{socket.gethostname()}",
                        create_pool_if_not_found=False)
    worker._client = client  # noqa: SLF001 - one-shot use, see the module docstring
    worker._work_pool = pool  # noqa: SLF001
    configuration = await worker_cls.job_configuration.resolve_for_flow_run(
        flow_run, client=client, work_pool=pool, worker_name=worker.name
    )
    configuration.set_secret_env(secret_env or {})  # in memory only: never stored with the run
    result = await worker.run(flow_run=flow_run, configuration=configuration)
    if result.status_code != 0:
        await worker._propose_crashed_state(  # noqa: SLF001 - the same message a polling worker sets
            flow_run, f"Job exited with status {result.status_code} without reporting an outcome.", client=client
        )
    return result.status_code


async def wait_for_final_state(
    client: PrefectClient, flow_run_id: UUID, on_log: Callable[[str], None] | None = None, poll_seconds: float = 0.25,
) -> State:
    """Poll until the run is final, forwarding its logs (the job's output) as they arrive."""
    since: datetime.datetime | None = None
    while True:
        flow_run = await client.read_flow_run(flow_run_id)
        if on_log is not None:
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            if since is not None:
                log_filter.timestamp = LogFilterTimestamp(after_=since)
            logs = await client.read_logs(log_filter=log_filter, limit=200)  # oldest first
            for log in logs:
                if since is None or log.timestamp > since:
                    on_log(log.message)
            if logs:
                since = max(log.timestamp for log in logs)
        if flow_run.state is not None and flow_run.state.is_final():
            return flow_run.state
        await asyncio.sleep(poll_seconds)


async def cancel_flow_run(client: PrefectClient, flow_run_id: UUID) -> None:
    """Ask the worker to stop the job (it watches for Cancelling and kills the infrastructure)."""
    try:
        await client.set_flow_run_state(flow_run_id, Cancelling(message="The calling task stopped waiting."), force=True)
    except Exception:  # best effort while the caller is already failing
        pass


async def read_flow_runs(client: PrefectClient, ids: list[UUID]) -> list[FlowRun]:
    return await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))


def attach_result_storage(task: Any, storage: Any) -> None:
    """Give a task an *unsaved* result-storage block.

    ``Task.__init__`` insists on blocks saved server-side so that a result's storage can be
    looked up by id later. kinetic's results storage is derived from the store URL, so every
    caller (on any machine) builds the same block and reads the same records; saving a block at
    decoration time would instead need the API at import time. Set after construction on purpose.
    """
    task.result_storage = storage


async def store_secret_env(values: dict[str, str], name: str) -> str:
    """Forwarded env values for a polling worker, in a Prefect Secret block it reads once and deletes."""
    import json as _json

    from prefect.blocks.system import Secret

    await Secret(value=_json.dumps(values)).asave(name=name, overwrite=True)
    return name


def run_interruptibly(coro: Any) -> Any:
    """Run ``coro`` on Prefect's run-sync loop (where its clients already live) and wait in slices.

    ``run_coro_as_sync`` blocks in one C-level wait, which defers Prefect's task timeout (an
    exception raised asynchronously into this thread) and Ctrl-C until the job has ended. Waking
    every 0.2 s lets them land; the coroutine is then cancelled, and given time to stop the job.
    """
    import threading

    from prefect._internal.concurrency.api import cast_to_call
    from prefect._internal.concurrency.threads import get_run_sync_loop

    finished = threading.Event()

    async def tracked() -> Any:
        try:
            return await coro
        finally:
            finished.set()

    call = cast_to_call(tracked)
    get_run_sync_loop().submit(call)
    try:
        while not call.future.done():
            finished.wait(0.2)
        return call.result()
    except BaseException:
        if not call.future.done():
            call.cancel()
            finished.wait(30)
        raise
