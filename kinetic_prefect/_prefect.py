"""The one place that touches Prefect internals and experimental behaviour.

kinetic-prefect submits a job as a *flow run in a work pool* without a deployment (Prefect
calls this ad-hoc submission). Prefect's own path for that (``bind_flow_to_infrastructure`` →
``BaseWorker.submit``) is experimental and costly for us: it freezes dependencies with
``uv pip freeze``, pickles the worker class into a bundle and adds a parent task run. We use
only stable client calls (create a tracking task run and a flow run with ``work_pool_name``/
``job_variables``/``parent_task_run_id``, read states and logs) plus, for in-process submission, a worker
instance that is given a client and its pool instead of going through ``setup()``
(heartbeats, websockets), which a one-shot submission does not need. If Prefect changes any
of this, this module is what changes.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
from types import SimpleNamespace
from typing import Any, Callable
from uuid import UUID, uuid4

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId, LogFilterTimestamp
from prefect.client.schemas.objects import FlowRun, TaskRun, TaskRunResult, WorkerStatus, WorkPool
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.states import Cancelling, Pending, Scheduled, State
from prefect.workers.base import BaseWorker

from kinetic_prefect import config
from kinetic_prefect.contract import TRACKING_TASK_KEY_PREFIX

logger = logging.getLogger("kinetic_prefect.api")

# Pools are read once per call site burst, not per call: a short TTL keeps edits in the UI effective.
_POOL_TTL_SECONDS = 30.0
_pool_cache: dict[tuple[str, str], tuple[float, WorkPool]] = {}


class WorkPoolError(LookupError):
    pass


def worker_class_for(pool_type: str) -> type[BaseWorker]:
    from kinetic_prefect import workers

    if pool_type == "kinetic-gke" and workers.GKE_UNAVAILABLE:
        raise WorkPoolError(f"work pool type 'kinetic-gke' needs the k8s and gcp extras ({workers.GKE_UNAVAILABLE}): "
                            "pip install 'kinetic-prefect[gcp,k8s]' (or uv sync --extra gcp --extra k8s)")
    cls = BaseWorker.get_worker_class_from_type(pool_type)
    if cls is None or not getattr(cls, "launcher", None) and not hasattr(cls, "follow"):
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
    async with _pool_read_lock(key):  # a .map()'s calls arrive together: one reads, the others take its answer
        cached = _pool_cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < _POOL_TTL_SECONDS:
            return cached[1]
        return await _read_or_create_pool(client, name, key)


_pool_read_locks: dict[tuple[int, tuple[str, str]], asyncio.Lock] = {}


def _pool_read_lock(key: tuple[str, str]) -> asyncio.Lock:
    loop_key = (id(asyncio.get_running_loop()), key)
    if loop_key not in _pool_read_locks:
        _pool_read_locks[loop_key] = asyncio.Lock()
    return _pool_read_locks[loop_key]


async def _read_or_create_pool(client: PrefectClient, name: str, key: tuple[str, str]) -> WorkPool:
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


_ONLINE_TTL_SECONDS = 2.0  # a .map()'s calls share one answer; a worker coming or going is seen within this
_online_cache: dict[tuple[str, str], tuple[float, bool]] = {}


async def has_online_worker(client: PrefectClient, pool_name: str) -> bool:
    key = (str(client.api_url), pool_name)
    cached = _online_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _ONLINE_TTL_SECONDS:
        return cached[1]
    try:
        workers = await client.read_workers_for_work_pool(pool_name)
        online = any(w.status == WorkerStatus.ONLINE for w in workers)
    except ObjectNotFound:
        online = False
    _online_cache[key] = (time.monotonic(), online)
    return online


async def create_job_flow_run(
    client: PrefectClient, *, flow_name: str, run_name: str, pool: WorkPool, job_variables: dict[str, Any],
    caller: TaskRun | None, tags: list[str], for_polling_worker: bool,
) -> FlowRun:
    """The job's flow run, drawn as Prefect draws a subflow called inside a task: under a tracking task
    run of its own (named like the job, in the caller's flow run, ``__parents__`` = the calling task run).

    Not under the calling task run itself: Prefect's server mirrors a subflow's every state onto its
    parent task run (``UpdateSubflowParentTask``), and the first of those (the job's Pending) takes the
    calling task out of Running, which releases its tag-concurrency slot while the job has not even
    started: a ``.map()`` under a limit of 2 ran 4 jobs at once. The calling task's state stays its own.
    """
    # A flow record is all the API needs; no Flow object (and no bundle) is built.
    flow = SimpleNamespace(name=flow_name, version=None, retries=0, retry_delay_seconds=0)
    tracker_id = None
    if caller is not None:
        tracker = await with_retries(lambda: client.create_task_run(
            _tracking_task(flow_name), flow_run_id=caller.flow_run_id, dynamic_key=uuid4().hex, name=run_name,
            extra_tags=["kinetic"], state=Pending(), task_inputs={"__parents__": [TaskRunResult(id=caller.id)]},
        ), what="creating the job's tracking task run")
        tracker_id = tracker.id
    # Pending runs are invisible to polling workers, so an in-process submission cannot be
    # picked up twice; Scheduled runs are what a polling worker claims.
    state = Scheduled() if for_polling_worker else Pending()
    return await with_retries(lambda: _create_flow_run(
        client, flow, name=run_name, state=state, work_pool_name=pool.name, job_variables=job_variables,
        parent_task_run_id=tracker_id, tags=tags,
    ), what="creating the job's flow run")


_flow_ids: dict[tuple[str, str], UUID] = {}


async def _create_flow_run(client: PrefectClient, flow: Any, *, name: str, state: State, work_pool_name: str,
                           job_variables: dict[str, Any], parent_task_run_id: UUID | None, tags: list[str]) -> FlowRun:
    """``client.create_flow_run`` without its per-call ``POST /flows/``: the flow's id is looked up once per
    name and API (a 64-input map made 64 identical upserts), and again if the server no longer has it."""
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.client.schemas.objects import FlowRunPolicy
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.states import to_state_create

    key = (str(client.api_url), flow.name)
    for attempt in range(2):
        if key not in _flow_ids:
            _flow_ids[key] = await client.create_flow_from_name(flow.name)
        create = FlowRunCreate(
            flow_id=_flow_ids[key], flow_version=flow.version, name=name, parameters={}, context={}, tags=tags,
            parent_task_run_id=parent_task_run_id, state=to_state_create(state),
            empirical_policy=FlowRunPolicy(retries=flow.retries, retry_delay=int(flow.retry_delay_seconds or 0)),
            work_pool_name=work_pool_name, job_variables=job_variables)
        try:
            response = await client.request("POST", "/flow_runs/", json=create.model_dump(mode="json",
                                                                                         exclude_unset=True))
        except PrefectHTTPStatusError as exc:
            if attempt == 0 and exc.response.status_code in (404, 409, 422):  # the flow was deleted meanwhile
                _flow_ids.pop(key, None)
                continue
            raise
        return FlowRun.model_validate(response.json())
    raise AssertionError("unreachable")


def _tracking_task(flow_name: str) -> Any:
    """What ``create_task_run`` reads of a task, for a job's tracking task run: no tags (a user's tag
    limits must not count the job twice), no retries (a retry is the calling task's, with a new job)."""
    return SimpleNamespace(name=flow_name, task_key=f"{TRACKING_TASK_KEY_PREFIX}{flow_name}", version=None, tags=(),
                           retries=0, retry_delay_seconds=0, retry_jitter_factor=None)


async def calling_task_run_id(client: PrefectClient, job: FlowRun) -> UUID | None:
    """The id of the task run that waits for ``job`` (the ``__parents__`` of its tracking task run),
    or None. It never changes for a job, so a caller that asks often may keep it."""
    if job.parent_task_run_id is None:
        return None
    try:
        tracker = await client.read_task_run(job.parent_task_run_id)
    except ObjectNotFound:
        return None
    parents = tracker.task_inputs.get("__parents__") or []
    return parents[0].id if parents else None


async def read_task_run_or_none(client: PrefectClient, task_run_id: UUID) -> TaskRun | None:
    try:
        return await client.read_task_run(task_run_id)
    except ObjectNotFound:
        return None


def is_transient(exc: BaseException) -> bool:
    """An API error that may pass by itself: a 5xx (e.g. SQLite busy under a fan-out), a dropped connection."""
    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (httpx.TransportError, ConnectionError))


_no_retry_settings: tuple[Any, Any] | None = None  # (settings, the same with the client's retries off)


def _client_retries_off() -> Any:
    """A settings context like the current one with Prefect's client retries off (``temporary_settings``
    builds a new Settings object each time, ≈ 25 ms; this one is rebuilt only when the settings change)."""
    global _no_retry_settings
    import prefect.context
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    context = prefect.context.get_settings_context()
    cached = _no_retry_settings
    if cached is None or cached[0] is not context.settings:
        cached = (context.settings, context.settings.copy_with_update(updates={PREFECT_CLIENT_MAX_RETRIES: 0}))
        _no_retry_settings = cached
    return prefect.context.SettingsContext(profile=context.profile, settings=cached[1])


async def with_retries(make_call: Callable[[], Any], what: str, attempts: int = 20) -> Any:
    """Await ``make_call()``, retrying transient errors quickly, with jitter (50 ms doubling to 4 s; ≈ 1 min in all).

    Prefect's client retries a 503 itself after 2, 4, 8, 16 s. A 503 here is nearly always its SQLite
    server answering "database is locked" to one of a fan-out's concurrent writes, a conflict that clears
    in milliseconds: those waits left a 64-input ``.map()`` idle for most of its time (bench/results). So
    each attempt runs with the client's own retries off (it still waits 2 s once before it gives up), and
    the retrying is done here at the pace of the conflict, with jitter so the colliding writers spread out.
    """
    import random

    for attempt in range(attempts):
        try:
            with _client_retries_off():
                return await make_call()
        except Exception as exc:
            if attempt == attempts - 1 or not is_transient(exc):
                raise
            logger.debug("%s: %s; attempt %d/%d", what, exc, attempt + 1, attempts)
            await asyncio.sleep(min(4.0, 0.05 * 2 ** attempt) * random.uniform(0.5, 1.5))
    raise AssertionError("unreachable")


_in_process_slots: dict[int, asyncio.Semaphore] = {}


def in_process_slots() -> asyncio.Semaphore:
    """How many in-process jobs this process runs at once (``KINETIC_IN_PROCESS_CONCURRENCY``, default
    twice the CPU count, at least 4): a ``.map()`` over hundreds of inputs queues here instead of starting
    hundreds of processes and flooding the API. Polling workers are bounded by their pool's limits."""
    import os

    loop = asyncio.get_running_loop()
    if id(loop) not in _in_process_slots:
        default = max(4, 2 * (os.cpu_count() or 1))
        _in_process_slots[id(loop)] = asyncio.Semaphore(int(os.environ.get("KINETIC_IN_PROCESS_CONCURRENCY", default)))
    return _in_process_slots[id(loop)]


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
    worker.owned_by_caller(_api_env())  # the job must not outlive this call (lifecycle.KineticWorker)
    result = await worker.run(flow_run=flow_run, configuration=configuration)
    return result.status_code


def _api_env() -> dict[str, str]:
    """How a job owned by this process reaches Prefect to cancel its own run if the process dies."""
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL

    from kinetic_prefect.contract import Env

    env = {Env.PREFECT_API_URL: PREFECT_API_URL.value() or ""}
    key = PREFECT_API_KEY.value()
    if key:
        env[Env.PREFECT_API_KEY] = key.get_secret_value() if hasattr(key, "get_secret_value") else str(key)
    return env


async def wait_for_final_state(
    client: PrefectClient, flow_run_id: UUID, on_log: Callable[[str], None] | None = None, poll_seconds: float = 0.25,
    log_drain_seconds: float = 15.0,
) -> State:
    """Poll until the run is final, forwarding its logs (the job's output) in order as they arrive.

    Logs reach the API in batches, so the final state can come before the last lines: after it,
    reading goes on until the worker's end marker (``contract.LOG_END_MARKER``) or a time limit.
    """
    from kinetic_prefect.contract import LOG_END_MARKER

    since: datetime.datetime | None = None
    seen_at_since: set[UUID] = set()  # several logs can share one timestamp
    ended_at: float | None = None
    final: State | None = None
    while True:
        if final is None:
            flow_run = await client.read_flow_run(flow_run_id)
            if flow_run.state is not None and flow_run.state.is_final():
                final, ended_at = flow_run.state, time.monotonic()
        if on_log is None:
            if final is not None:
                return final
            await asyncio.sleep(poll_seconds)
            continue
        marker_seen = False
        while True:  # page through everything new
            log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            if since is not None:
                log_filter.timestamp = LogFilterTimestamp(after_=since - datetime.timedelta(microseconds=1))
            logs = await client.read_logs(log_filter=log_filter, limit=LOG_PAGE)  # oldest first
            fresh = [log for log in logs if log.id not in seen_at_since and (since is None or log.timestamp >= since)]
            for log in fresh:
                if log.message == LOG_END_MARKER:
                    marker_seen = True
                else:
                    on_log(log.message)
            if logs:
                newest = max(log.timestamp for log in logs)
                seen_at_since = {log.id for log in logs if log.timestamp == newest} | (
                    seen_at_since if newest == since else set())
                since = newest
            if len(logs) < LOG_PAGE or not fresh:
                break
        if final is not None and (marker_seen or time.monotonic() - (ended_at or 0) > log_drain_seconds):
            return final
        await asyncio.sleep(poll_seconds)


LOG_PAGE = 200


async def cancel_flow_run(client: PrefectClient, flow_run_id: UUID, message: str, wait_seconds: float = 0) -> None:
    """Ask the worker to stop the job (it watches for Cancelling, stops the job, sets Cancelled),
    and wait up to ``wait_seconds`` for it to be done.

    Shielded: it runs while the calling task is itself being cancelled (a timeout, Ctrl-C), when
    an unshielded await would be cancelled before the request is sent. Waiting matters for the
    truth of the UI too: Prefect mirrors a job run's state onto its parent task run, so the job
    must be Cancelled *before* the task run records why it stopped (e.g. TimedOut).
    """
    import anyio

    with anyio.CancelScope(shield=True):
        try:
            current = await client.read_flow_run(flow_run_id)
            if current.state is not None and current.state.is_final():
                return
            await client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)
            with anyio.move_on_after(wait_seconds):
                await wait_for_final_state(client, flow_run_id)
        except Exception:  # best effort while the caller is already failing
            pass


async def cancel_unstarted_run(client: PrefectClient, flow_run_id: UUID, message: str) -> None:
    """End a job's run Cancelled if it never started (an in-process run still Pending); shielded, best effort."""
    import anyio
    from prefect.states import Cancelled

    with anyio.CancelScope(shield=True):
        try:
            current = await client.read_flow_run(flow_run_id)
            if current.state is not None and current.state.is_pending():
                await client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)
        except Exception:  # best effort while the caller is already failing
            pass


async def finish_cancelled_parent(client: PrefectClient, task_run: Any) -> None:
    """A flow run cancelled while it ran as a plain script has nobody to move it past Cancelling
    (no worker or runner owns the process). The job it waited for is stopped now, so the calling
    task, the last one left, finishes the cancellation."""
    from prefect.states import Cancelled

    if task_run is None or task_run.flow_run_id is None:
        return
    parent = await client.read_flow_run(task_run.flow_run_id)
    if parent.state is not None and parent.state.is_cancelling():
        await client.set_flow_run_state(parent.id, Cancelled(message=parent.state.message or "Cancelled"), force=True)


async def read_flow_runs(client: PrefectClient, ids: list[UUID]) -> list[FlowRun]:
    return await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))


_signing_key_cache: dict[str, bytes | None] = {}


async def signing_key() -> bytes | None:
    """The store signing key: ``KINETIC_SIGNING_KEY``, else the Secret block ``kinetic-signing-key``.

    Read once per process and API. Without one, store objects are unauthenticated and a warning
    says so once (see signing.py for what the key protects).
    """
    import os
    import warnings

    from kinetic_prefect import signing

    from_env = signing.key_from_env()
    if from_env is not None:
        return from_env
    from prefect.settings import PREFECT_API_URL

    cache_key = str(PREFECT_API_URL.value())
    if cache_key not in _signing_key_cache:
        from prefect.blocks.system import Secret

        try:
            value = (await Secret.aload(signing.SECRET_BLOCK)).get()
            _signing_key_cache[cache_key] = str(value).encode() if value else None
        except (ValueError, ObjectNotFound):
            _signing_key_cache[cache_key] = None
        if _signing_key_cache[cache_key] is None and not os.environ.get("KINETIC_UNSIGNED_OK"):
            warnings.warn(
                "kinetic-prefect: no signing key (KINETIC_SIGNING_KEY or the Prefect Secret block "
                f"{signing.SECRET_BLOCK!r}): store objects are unauthenticated, so anyone who can write the "
                "store can change results and payloads. Fine on one machine; set a key for shared stores.",
                stacklevel=2)
    return _signing_key_cache[cache_key]


EPHEMERAL_STARTUP_SECONDS = 300


def start_embedded_server() -> None:
    """Start Prefect's ephemeral local server now, with a start-up limit that fits a first run.

    With no ``PREFECT_API_URL``, Prefect starts a temporary server when a flow first needs the API,
    and gives it 20 s. On a fresh machine the first start creates and migrates Prefect's SQLite
    database, which takes longer than that on 2 loaded cores: the README's first command failed
    with "Timed out while attempting to connect to ephemeral Prefect API server". Prefect reads that
    limit from settings fixed when ``prefect`` is imported (before us), so instead the server is
    started here, at decoration time, with a longer limit (``KINETIC_EPHEMERAL_STARTUP_SECONDS``);
    Prefect's own later ``start()`` finds it running (it is one instance per process). Telemetry
    is off for this server only: on an offline machine it can only print errors.
    """
    import os
    import sys

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running:
        return
    _check_prefect_home()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the subprocess reads it
    timeout = int(os.environ.get("KINETIC_EPHEMERAL_STARTUP_SECONDS", EPHEMERAL_STARTUP_SECONDS))
    started = time.monotonic()
    server.start(timeout=timeout)
    if time.monotonic() - started > 10:
        print(f"kinetic-prefect: Prefect's local server took {time.monotonic() - started:.0f}s to start "
              "(a first start creates its database). Run `prefect server start` in another terminal and "
              "set PREFECT_API_URL=http://127.0.0.1:4200/api to keep one running, with its UI.",
              file=sys.stderr, flush=True)


def _check_prefect_home() -> None:
    """The local server keeps its SQLite database in PREFECT_HOME. Where that folder cannot be made or
    written (HOME missing or read-only, as in some containers), the server exits at start-up and
    Prefect waits out its whole start-up limit before a "Timed out ... ephemeral Prefect API server"
    that names nothing: say which folder and what to do, at once."""
    import os
    from pathlib import Path

    from prefect.settings import PREFECT_HOME

    from kinetic_prefect.errors import KineticError

    home = Path(PREFECT_HOME.value()).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        writable = os.access(home, os.W_OK)
        reason = "it is not writable"
    except OSError as exc:
        writable, reason = False, f"it cannot be created ({exc.strerror or exc})"
    if not writable:
        raise KineticError(
            f"Prefect's local server keeps its database in PREFECT_HOME={home}, but {reason}. "
            "Set PREFECT_HOME to a writable folder (or HOME to an existing, writable one), or point "
            "PREFECT_API_URL at a running server (`prefect server start`).")


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

    from kinetic_prefect.sweeps import check_caller

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
            check_caller()  # a Ctrl-C / SIGTERM of the script, when this is a task runner's thread
        return call.result()
    except BaseException:
        if not call.future.done():
            call.cancel()
            finished.wait(30)
        raise
