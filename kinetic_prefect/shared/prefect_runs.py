"""Run plumbing: a job's flow run created, followed, cancelled and waited for through stable client calls.

kinetic-prefect submits a job as a *flow run in a work pool* without a deployment (Prefect
calls this ad-hoc submission). Prefect's own path for that (``bind_flow_to_infrastructure`` →
``BaseWorker.submit``) is experimental and costly for us: it freezes dependencies with
``uv pip freeze``, pickles the worker class into a bundle and adds a parent task run. We use
only stable client calls (create a tracking task run and a flow run with ``work_pool_name``/
``job_variables``/``parent_task_run_id``, read states and logs). Used by the caller and the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTimestamp,
)
from prefect.client.schemas.objects import FlowRun, Log, TaskRun, TaskRunResult, WorkPool
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Cancelled, Cancelling, Pending, Scheduled, State

from kinetic_prefect.contract import JOB_OUTPUT_LOGGER, LOG_END_MARKER, TRACKING_TASK_KEY_PREFIX
from kinetic_prefect.shared.outages import Outage, _client_retries_off, is_transient
from kinetic_prefect.shared.processes import process_start_ticks
from kinetic_prefect.shared.sweeps import check_caller, stop_waking, wake_on_interrupt, wake_seconds

logger = logging.getLogger("kinetic_prefect.api")


# --------------------------------------------------------------------------- one client per process


_shared_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, PrefectClient]] = (
    weakref.WeakKeyDictionary()
)
_shared_client_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def shared_client() -> AsyncIterator[PrefectClient]:
    """The Prefect API client of this process, for ``async with``: on Prefect's run-sync loop (where every
    synchronous call of a kinetic task waits, ``run_interruptibly``), started by the first call that needs it
    and left open after it, so every call of a sweep shares its connections and CSRF token.

    ``async with get_client()`` per call started a client per input (its httpx pool, its connections and a
    ``GET /csrf-token`` before the first write): 65 of the 751 requests of a 64-input map. Prefect's client
    may be entered again while it is open and is safe to share between the coroutines of its loop; it is
    kept per API URL, and made again if something closed it.
    """
    from prefect._internal.concurrency.threads import get_run_sync_loop
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    loop = asyncio.get_running_loop()
    if getattr(get_run_sync_loop(), "_loop", None) is not loop:
        # Another loop (an async task's, a passing thread's) may end at any time and leave its client open:
        # there, Prefect's own client context (a flow's client, kept by the flow) or a client of the call's own.
        async with get_client() as own:
            yield own
        return
    url = str(PREFECT_API_URL.value() or "")
    clients = _shared_clients.setdefault(loop, {})
    client: PrefectClient | None = clients.get(url)
    if client is None or getattr(client, "_closed", False):
        async with _shared_client_locks.setdefault(loop, asyncio.Lock()):
            client = clients.get(url)
            if client is None or getattr(client, "_closed", False):
                # httpx_settings={}: a client of our own, never the one of a Prefect client context that
                # its owner closes on its way out
                client = get_client(httpx_settings={})
                await client.__aenter__()  # left entered: the client lives as long as its loop
                clients[url] = client
    async with client:
        yield client


# --------------------------------------------------------------------------- creating a job's run

# Run creations of this process in flight at once. SQLite takes one writer at a time: a 256-input map that
# created its 512 runs (trackers and job runs) all at once met 503 "database is locked" on most of them and
# exhausted the retries of some; a few at a time keep the server busy without the lock conflicts.
CONCURRENT_RUN_CREATIONS = 4
_creation_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _run_creation_slot() -> asyncio.Semaphore:
    return _creation_slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(CONCURRENT_RUN_CREATIONS))


async def create_job_flow_run(
    client: PrefectClient,
    *,
    flow_name: str,
    run_name: str,
    pool: WorkPool,
    job_variables: dict[str, Any],
    caller: TaskRun | None,
    tags: list[str],
    for_polling_worker: bool,
    signing_key: Any = None,
    in_flow_run: UUID | None = None,
) -> FlowRun:
    """The job's flow run, drawn as Prefect draws a subflow called inside a task: under a tracking task
    run of its own (named like the job, in the caller's flow run, ``__parents__`` = the calling task run).

    Not under the calling task run itself: Prefect's server mirrors a subflow's every state onto its
    parent task run (``UpdateSubflowParentTask``), and the first of those (the job's Pending) takes the
    calling task out of Running, which releases its tag-concurrency slot while the job has not even
    started: a ``.map()`` under a limit of 2 ran 4 jobs at once. The calling task's state stays its own.

    ``in_flow_run`` (with no ``caller``): a job that serves several calls of that flow run (a sweep's slot) hangs
    under a tracking task run there with no ``__parents__``: its cost counts in the flow run's (``flow_cost``).
    """
    from kinetic_prefect import signing

    signing.sign_job_variables(signing_key, job_variables)  # last: nothing is added to them after this
    async with _run_creation_slot():
        return await _create_job_flow_run(
            client,
            flow_name=flow_name,
            run_name=run_name,
            pool=pool,
            job_variables=job_variables,
            caller=caller,
            tags=tags,
            for_polling_worker=for_polling_worker,
            in_flow_run=in_flow_run,
        )


async def _create_job_flow_run(
    client: PrefectClient,
    *,
    flow_name: str,
    run_name: str,
    pool: WorkPool,
    job_variables: dict[str, Any],
    caller: TaskRun | None,
    tags: list[str],
    for_polling_worker: bool,
    in_flow_run: UUID | None = None,
) -> FlowRun:
    # A flow record is all the API needs; no Flow object (and no bundle) is built.
    flow = SimpleNamespace(name=flow_name, version=None, retries=0, retry_delay_seconds=0)
    tracker_id = None
    tracker_flow_run = caller.flow_run_id if caller is not None else in_flow_run
    if tracker_flow_run is not None:
        parents: dict[str, list[Any]] = {"__parents__": [TaskRunResult(id=caller.id)]} if caller is not None else {}
        tracker = await with_retries(
            lambda: client.create_task_run(
                _tracking_task(flow_name),
                flow_run_id=tracker_flow_run,
                dynamic_key=uuid4().hex,
                name=run_name,
                extra_tags=["kinetic"],
                state=Pending(),
                task_inputs=parents,
            ),
            what="creating the job's tracking task run",
        )
        tracker_id = tracker.id
    # Pending runs are invisible to polling workers, so an in-process submission cannot be
    # picked up twice; Scheduled runs are what a polling worker claims.
    state: State[Any] = Scheduled() if for_polling_worker else Pending()
    try:
        flow_run: FlowRun = await with_retries(
            lambda: _create_flow_run(
                client,
                flow,
                name=run_name,
                state=state,
                work_pool_name=pool.name,
                job_variables=job_variables,
                parent_task_run_id=tracker_id,
                tags=tags,
                labels={} if for_polling_worker else owner_labels(),
            ),
            what="creating the job's flow run",
        )
        return flow_run
    except BaseException:
        if tracker_id is not None:  # no job run will ever end it: a tracking task run must not stay Pending
            await _end_tracker(client, tracker_id)
        raise


async def _end_tracker(client: PrefectClient, tracker_id: UUID) -> None:
    # best effort: the API is what failed
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await client.set_task_run_state(
            tracker_id, Cancelled(message="its job's flow run could not be created"), force=True
        )


_owner_labels: tuple[int, dict[str, str]] | None = None  # (pid, labels): read once per process, not per call


def owner_labels() -> dict[str, str]:
    """Who runs an in-process job (Prefect labels on its flow run): a run left Pending by a caller killed before
    its job started is then known to be nobody's (``owner_is_gone``) and can be cancelled."""
    global _owner_labels
    import socket

    from kinetic_prefect.contract import OWNER_HOST_LABEL, OWNER_PID_LABEL, OWNER_START_LABEL

    pid = os.getpid()
    if _owner_labels is None or _owner_labels[0] != pid:
        _owner_labels = (
            pid,
            {
                OWNER_HOST_LABEL: socket.gethostname(),
                OWNER_PID_LABEL: str(pid),
                OWNER_START_LABEL: str(process_start_ticks(pid) or ""),
            },
        )
    return dict(_owner_labels[1])


def owner_is_gone(flow_run: FlowRun) -> bool:
    """True when the run names an in-process owner on this machine whose process no longer runs."""
    import socket

    from kinetic_prefect.contract import OWNER_HOST_LABEL, OWNER_PID_LABEL, OWNER_START_LABEL

    labels = flow_run.labels or {}
    if labels.get(OWNER_HOST_LABEL) != socket.gethostname() or not str(labels.get(OWNER_PID_LABEL, "")).isdigit():
        return False
    pid = int(labels[OWNER_PID_LABEL])
    ticks = process_start_ticks(pid)
    return ticks is None or str(ticks) != str(labels.get(OWNER_START_LABEL) or ticks)


_flow_ids: dict[tuple[str, str], UUID] = {}


async def _create_flow_run(
    client: PrefectClient,
    flow: Any,
    *,
    name: str,
    state: State,
    work_pool_name: str,
    job_variables: dict[str, Any],
    parent_task_run_id: UUID | None,
    tags: list[str],
    labels: dict[str, str] | None = None,
) -> FlowRun:
    """``client.create_flow_run`` without its per-call ``POST /flows/``: the flow's id is looked up once per
    name and API (a 64-input map made 64 identical upserts), and again if the server no longer has it."""
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.client.schemas.objects import FlowRunPolicy
    from prefect.states import to_state_create

    key = (str(client.api_url), flow.name)
    for attempt in range(2):
        if key not in _flow_ids:
            _flow_ids[key] = await client.create_flow_from_name(flow.name)
        create = FlowRunCreate(
            flow_id=_flow_ids[key],
            flow_version=flow.version,
            name=name,
            parameters={},
            context={},
            tags=tags,
            parent_task_run_id=parent_task_run_id,
            state=to_state_create(state),
            empirical_policy=FlowRunPolicy(retries=flow.retries, retry_delay=int(flow.retry_delay_seconds or 0)),
            work_pool_name=work_pool_name,
            job_variables=job_variables,
            labels=dict(labels or {}),
        )
        try:
            response = await client.request(
                "POST", "/flow_runs/", json=create.model_dump(mode="json", exclude_unset=True)
            )
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
    return SimpleNamespace(
        name=flow_name,
        task_key=f"{TRACKING_TASK_KEY_PREFIX}{flow_name}",
        version=None,
        tags=(),
        retries=0,
        retry_delay_seconds=0,
        retry_jitter_factor=None,
    )


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
    parent_id: UUID | None = getattr(parents[0], "id", None) if parents else None
    return parent_id


async def read_task_run_or_none(client: PrefectClient, task_run_id: UUID) -> TaskRun | None:
    try:
        return await client.read_task_run(task_run_id)
    except ObjectNotFound:
        return None


async def with_retries(make_call: Callable[[], Any], what: str, attempts: int = 20) -> Any:
    """Await ``make_call()``, retrying transient errors quickly, with jitter (50 ms doubling to 4 s; ≈ 1 min in all).

    Prefect's client retries a 503 itself after 2, 4, 8, 16 s. A 503 here is nearly always its SQLite
    server answering "database is locked" to one of a fan-out's concurrent writes, a conflict that clears
    in milliseconds: those waits left a 64-input ``.map()`` idle for most of its time (bench/results). So
    each attempt runs with the client's own retries off (it still waits 2 s once before it gives up), and
    the retrying is done here at the pace of the conflict, with jitter so the colliding writers spread out.
    """
    for attempt in range(attempts):
        try:
            with _client_retries_off():
                return await make_call()
        except Exception as exc:
            if attempt == attempts - 1 or not is_transient(exc):
                raise
            logger.debug("%s: %s; attempt %d/%d", what, exc, attempt + 1, attempts)
            await asyncio.sleep(min(4.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.5))
    raise AssertionError("unreachable")


class FlowRunReader:
    """Reads, for every call of a process waiting on a job's run, all those runs in one request per 200.

    Each call waiting for its job read its run with a ``GET /flow_runs/{id}`` 4 times a second; a 1,000-input
    map on a polling worker asked the server 4,000 times a second about runs that mostly still waited for a
    slot. A call now asks this reader, which collects what its loop's calls ask within ``GATHER_SECONDS``
    and answers them all with ``POST /flow_runs/filter`` (ids in pages of ``PAGE``). An answer is never older
    than the question: a call gets the run as read after it asked.
    """

    GATHER_SECONDS = 0.05
    PAGE = 200

    def __init__(self, client: PrefectClient) -> None:
        self.client = client
        self._asked: dict[UUID, list[asyncio.Future[FlowRun]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def read(self, flow_run_id: UUID) -> FlowRun:
        """The run as the API has it now; raises what the read raised (a transient error for the caller's
        ``Outage`` to wait out, ``ObjectNotFound`` for a run that is gone)."""
        future: asyncio.Future[FlowRun] = asyncio.get_running_loop().create_future()
        self._asked.setdefault(flow_run_id, []).append(future)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._answer())
        return await future

    async def _answer(self) -> None:
        try:
            await self._answer_all()
        except BaseException as exc:  # the loop is going away: no caller may wait for an answer that never comes
            for futures in self._asked.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(RuntimeError(f"the flow-run reader stopped: {exc!r}"))
            raise

    async def _answer_all(self) -> None:
        while self._asked:
            await asyncio.sleep(self.GATHER_SECONDS)
            asked, self._asked = self._asked, {}
            ids = list(asked)
            found: dict[UUID, FlowRun] = {}
            try:
                for start in range(0, len(ids), self.PAGE):
                    page = ids[start : start + self.PAGE]
                    with _client_retries_off():  # each caller's Outage decides how long to retry
                        runs = await self.client.read_flow_runs(
                            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=page)), limit=len(page)
                        )
                    found.update((run.id, run) for run in runs)
            except Exception as exc:
                for futures in asked.values():
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            for run_id, futures in asked.items():
                run = found.get(run_id)
                if run is None:  # gone: the single read raises Prefect's own ObjectNotFound for it
                    try:
                        run = await self.client.read_flow_run(run_id)
                    except Exception as exc:
                        for future in futures:
                            if not future.done():
                                future.set_exception(exc)
                        continue
                for future in futures:
                    if not future.done():  # a caller that stopped waiting cancelled its own
                        future.set_result(run)


_readers: weakref.WeakKeyDictionary[PrefectClient, FlowRunReader] = weakref.WeakKeyDictionary()


def read_flow_run_batched(client: PrefectClient, flow_run_id: UUID) -> Any:
    """``client.read_flow_run(flow_run_id)``, answered with the other waiting calls' reads (``FlowRunReader``)."""
    reader = _readers.get(client)
    if reader is None:
        reader = _readers[client] = FlowRunReader(client)
    return reader.read(flow_run_id)


# A call waiting on a run whose state does not change asks less and less often, up to this: a sweep's calls
# waiting for a slot on a polling worker ask every 2 s, not 4 times a second. A new state, or new output,
# brings the pace back to the caller's poll_seconds.
MAX_POLL_SECONDS = 2.0


async def wait_for_final_state(
    client: PrefectClient,
    flow_run_id: UUID,
    on_log: Callable[[str], None] | None = None,
    poll_seconds: float = 0.25,
    log_drain_seconds: float = 15.0,
    outage: Any = None,
    max_poll_seconds: float = MAX_POLL_SECONDS,
) -> State:
    """Poll until the run is final, forwarding its logs (the job's output) in order as they arrive.

    Logs reach the API in batches, so the final state can come before the last lines: after it,
    reading goes on until the worker's end marker (``contract.LOG_END_MARKER``) or a time limit.
    An unreachable API is waited out (``outages.Outage``): a server restart does not end the wait.
    The run's state is read with the process's other waiting calls (``FlowRunReader``), its logs only
    once a worker has claimed it (a Scheduled run has no output yet), and a run whose state and output
    stay the same is asked about less often, up to ``max_poll_seconds``.
    """
    outage = outage or Outage("the caller waiting for its job")
    output = JobOutputReader(client, flow_run_id, outage, on_log) if on_log is not None else None
    ended_at: float | None = None
    final: State | None = None
    claimed = False
    last_state: tuple[Any, Any] | None = None
    interval = poll_seconds
    while True:
        changed = False
        if final is None:
            flow_run = await outage.call(lambda: read_flow_run_batched(client, flow_run_id), "reading the job's state")
            state = flow_run.state
            if state is not None and state.is_final():
                final, ended_at = state, time.monotonic()
            claimed = claimed or (state is not None and not state.is_scheduled())
            key = (state.type, state.name) if state is not None else None
            changed, last_state = key != last_state, key
        if output is None:
            if final is not None:
                return final
            interval = poll_seconds if changed else min(max_poll_seconds, interval * 1.5)
            await asyncio.sleep(interval)
            continue
        shown, marker_seen = await output.read_new() if claimed else (0, False)
        if final is not None and (marker_seen or time.monotonic() - (ended_at or 0) > log_drain_seconds):
            return final
        # the drain after the final state keeps the caller's pace: the end marker is due any moment
        steady = not changed and not shown and final is None
        interval = min(max_poll_seconds, interval * 1.5) if steady else poll_seconds
        await asyncio.sleep(interval)


class JobOutputReader:
    """A job run's logs, forwarded in order across polls (``wait_for_final_state``).

    Every read starts again from ``since`` (the newest job-output record read), paging on past the worker's
    own notices (stored late, and out of order, by Prefect's background log sender): the job's output is
    stored in order, so no output line is behind ``since``, while a notice may be and is then not shown (it
    stays in the run's logs). ``seen`` holds the records read at or after ``since`` (several can share a
    timestamp).
    """

    def __init__(self, client: PrefectClient, flow_run_id: UUID, outage: Any, on_log: Callable[[str], None]) -> None:
        self.client, self.flow_run_id, self.outage, self.on_log = client, flow_run_id, outage, on_log
        self.since: datetime.datetime | None = None
        self.seen: dict[UUID, datetime.datetime] = {}

    async def read_new(self) -> tuple[int, bool]:
        """Forward the lines not yet forwarded; returns how many records were new and whether the worker's end
        marker was among them."""
        marker_seen = False
        shown = 0
        page_since = self.since
        while True:
            logs = await self._page(page_since)
            for log in logs:
                if log.id in self.seen or (self.since is not None and log.timestamp < self.since):
                    continue
                self.seen[log.id] = log.timestamp
                shown += 1
                if log.message == LOG_END_MARKER:
                    marker_seen = True
                else:
                    self.on_log(log.message)
            output = [log.timestamp for log in logs if log.name == JOB_OUTPUT_LOGGER]
            if output and (self.since is None or max(output) > self.since):
                self.since = max(output)
            newest = max((log.timestamp for log in logs), default=page_since)
            if len(logs) < LOG_PAGE or newest == page_since:
                break
            page_since = newest
        if self.since is not None:
            since = self.since
            self.seen = {log_id: stamp for log_id, stamp in self.seen.items() if stamp >= since}
        return shown, marker_seen

    async def _page(self, page_since: datetime.datetime | None) -> list[Log]:
        """Up to ``LOG_PAGE`` records of the run from ``page_since`` on, oldest first."""
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[self.flow_run_id]))
        if page_since is not None:
            after = page_since - datetime.timedelta(microseconds=1)
            log_filter.timestamp = LogFilterTimestamp(after_=after)  # type: ignore[arg-type]  # a datetime is fine
        logs: list[Log] = await self.outage.call(
            lambda: self.client.read_logs(log_filter=log_filter, limit=LOG_PAGE), "reading the job's output"
        )
        return logs


LOG_PAGE = 200


async def cancel_flow_run(client: PrefectClient, flow_run_id: UUID, message: str, wait_seconds: float = 0) -> None:
    """Ask the worker to stop the job (it watches for Cancelling, stops the job, sets Cancelled),
    and wait up to ``wait_seconds`` for it to be done.

    Shielded: it runs while the calling task is itself being cancelled (a timeout, Ctrl-C), when
    an unshielded await would be cancelled before the request is sent. Waiting matters for the
    truth of the UI too: Prefect mirrors a job run's state onto its parent task run, so the job
    must be Cancelled *before* the task run records why it stopped (e.g. TimedOut).
    """
    with anyio.CancelScope(shield=True):
        try:
            current = await client.read_flow_run(flow_run_id)
            if current.state is not None and current.state.is_final():
                return
            await client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)
            with anyio.move_on_after(wait_seconds):
                await wait_for_final_state(client, flow_run_id, max_poll_seconds=0.5)  # a stop is due soon
        except Exception:  # best effort while the caller is already failing
            pass


async def finish_cancelled_parent(client: PrefectClient, task_run: Any) -> None:
    """A flow run cancelled while it ran as a plain script has nobody to move it past Cancelling
    (no worker or runner owns the process). The job it waited for is stopped now, so the calling
    task, the last one left, finishes the cancellation."""
    if task_run is None or task_run.flow_run_id is None:
        return
    parent = await client.read_flow_run(task_run.flow_run_id)
    if parent.state is not None and parent.state.is_cancelling():
        await client.set_flow_run_state(parent.id, Cancelled(message=parent.state.message or "Cancelled"), force=True)


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


def run_interruptibly(coro: Any) -> Any:
    """Run ``coro`` on Prefect's run-sync loop (where its clients already live) and wait in slices.

    ``run_coro_as_sync`` blocks in one C-level wait, which defers Prefect's task timeout (an
    exception raised asynchronously into this thread) and Ctrl-C until the job has ended. Waking
    now and then (``sweeps.wake_seconds``: 0.2 s for up to 50 waiting calls), and at once when the
    script is interrupted, lets them land; the coroutine is then cancelled, and given time to stop the job.
    """
    from prefect._internal.concurrency.api import cast_to_call
    from prefect._internal.concurrency.threads import get_run_sync_loop

    finished = threading.Event()
    wake = threading.Event()  # the job's end, or an interrupt of the script (sweeps.wake_on_interrupt)

    async def tracked() -> Any:
        try:
            return await coro
        finally:
            finished.set()
            wake.set()

    call = cast_to_call(tracked)
    get_run_sync_loop().submit(call)
    wake_on_interrupt(wake)
    try:
        while not call.future.done():
            wake.wait(0.01 if finished.is_set() else wake_seconds())  # finished: the result is moments away
            wake.clear()
            check_caller()  # a Ctrl-C / SIGTERM of the script, when this is a task runner's thread
        return call.result()
    except BaseException:
        if not call.future.done():
            call.cancel()
            finished.wait(30)
        raise
    finally:
        stop_waking(wake)
