"""A ``run_async_map`` batch that rides in slots: its inputs are task runs of one flow run, not a job run each.

Where a batch's detached jobs would run inside the submitting process anyway (no polling worker serves the pool,
see kinetic.detached) on a pool whose jobs can be a sweep's slots (``caller.sweep_calls.pool_carries_slots``), a
batch of two inputs or more runs as one flow run, ``kinetic-batch``, in the batch's background thread: each input is
a ``.submit()`` of the kinetic task there, a task run carrying the batch's tags, so the inputs ride in a few slot jobs
as any fan-out does (caller/slots.py). The batch stays bound to its process, as its detached jobs were: Python waits
for it at exit, and a killed submitter's slots stop themselves. With a polling worker every input keeps a detached
job of its own, which outlives the script.

``InputHandle`` is an input's ``JobHandle``: ``job_id`` is its task run's id; its status and logs are the task run's;
its value or exception is read from the store, where the call leaves it for the handle (``contract.
batch_input_run_id``) instead of deleting it, and deleted once collected, as a detached job's is. A cancel reaches
the submitter through Prefect's records, so it works from any process: ``BatchHandle.cancel()`` cancels the batch's
flow run (its sweep stops its slots and ends each waiting input Cancelled; ``SlotSubmitter.follow_stops`` drops the
inputs not started), an input's ``cancel()`` marks its task run Cancelling and the submission loop stops it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from kinetic_prefect import signing
from kinetic_prefect.contract import (
    BATCH_POOL_TAG_PREFIX,
    BATCH_TAG,
    GROUP_INDEX_TAG_PREFIX,
    GROUP_TAG_PREFIX,
    RunLayout,
    batch_input_run_id,
)
from kinetic_prefect.kinetic.jobs import TERMINAL, JobHandle, JobStatus, _tag_value, run_sync, status_of

BATCH_FLOW_NAME = "kinetic-batch"
POLL_SECONDS = 0.5


def rides_in_slots(remote: Any, inputs: int) -> Any:
    """The pool, when a batch of ``inputs`` calls of ``remote`` rides in slots; else None (a detached job each)."""
    if inputs < 2:
        return None
    options = remote.task.kinetic
    if options.debug or options.env or options.fallbacks or (options.hosts or 1) > 1:
        return None
    from kinetic_prefect import config
    from kinetic_prefect.caller import _prefect, slots
    from kinetic_prefect.caller.sweep_calls import pool_carries_slots

    async def read() -> tuple[Any, bool]:
        from prefect import get_client

        async with get_client() as client:
            pool = await _prefect.ensure_work_pool(client, options.work_pool or config.default_work_pool())
            polling = options.submission == "worker" or (
                options.submission == "auto" and await _prefect.has_online_worker(client, pool.name)
            )
            return pool, polling

    pool, polling = run_sync(read())
    variables = options.job_variables
    keep_warm = float(variables.get("keep_warm_seconds", _prefect.pool_default(pool, "keep_warm_seconds")) or 0)
    if polling or not slots.slot_count(pool) or not pool_carries_slots(pool, variables, keep_warm):
        return None
    return pool


def input_status(task_run: Any, handle: InputHandle) -> JobStatus:
    """An input's status from its task run (None: not recorded yet, or never started)."""
    if task_run is None:
        return JobStatus.PENDING if handle.pending_here() else JobStatus.NOT_FOUND
    return status_of(task_run.state)


@dataclass
class InputHandle(JobHandle):
    """One input of a batch in slots: a ``JobHandle`` read from its task run (see the module docstring)."""

    _future: Any = field(default=None, repr=False, compare=False)  # in the submitting process: its Prefect future

    @classmethod
    def from_task_run(cls, task_run: Any) -> InputHandle:
        tags = list(task_run.tags or ())
        index = _tag_value(tags, GROUP_INDEX_TAG_PREFIX)
        return cls(
            job_id=str(task_run.id),
            func_name=task_run.name.rsplit("-", 1)[0],
            display_name=task_run.name,
            accelerator=_tag_value(tags, "accelerator:") or "",
            work_pool=_tag_value(tags, BATCH_POOL_TAG_PREFIX) or "",
            backend="",
            created_at=task_run.created.isoformat() if task_run.created else "",
            group_id=_tag_value(tags, GROUP_TAG_PREFIX),
            group_index=int(index.split("/")[0]) if index else None,
            detached=False,
        )

    @property
    def future(self) -> Any:
        """Its Prefect future, in the process that submitted it (else None)."""
        return self._future

    def pending_here(self) -> bool:
        """Submitted by this process and not given up: its task run is only not recorded yet."""
        wrapped = getattr(self._future, "wrapped_future", None)
        return wrapped is not None and not wrapped.cancelled()

    def _task_run(self) -> Any:
        from prefect import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                return client.read_task_run(UUID(self.job_id))
            except ObjectNotFound:
                return None

    def state(self) -> Any:
        task_run = self._task_run()
        return task_run.state if task_run is not None else None

    def status(self) -> JobStatus:
        return input_status(self._task_run(), self)

    def _log_filter(self) -> Any:
        from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

        return LogFilter(task_run_id=LogFilterTaskRunId(any_=[UUID(self.job_id)]))

    def logs(self, follow: bool = False) -> str | None:
        if not follow:
            return "\n".join(self._log_lines())
        self._follow(None, echo=True)
        return None

    def _follow(self, timeout: float | None, echo: bool) -> JobStatus:
        """Until the input ends (``TimeoutError`` after ``timeout``), printing its new log lines with ``echo``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        printed = 0
        while True:
            status = self.status()
            if echo:
                lines = self._log_lines()
                for line in lines[printed:]:
                    print(line, flush=True)
                printed = len(lines)
            if status in TERMINAL:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"input {self.display_name} of batch {self.group_id} did not end within {timeout} s; it keeps "
                    "running: call result() again, or cancel() it"
                )
            time.sleep(POLL_SECONDS)

    def wait(self, timeout: float | None = None) -> JobStatus:
        return self._follow(timeout, echo=False)

    def result(self, timeout: float | None = None, cleanup: bool = True, stream_logs: bool = False) -> Any:
        self._follow(timeout, echo=stream_logs)
        return run_sync(self._collect_input(cleanup))

    async def _collect_input(self, cleanup: bool) -> Any:
        from anyio import to_thread
        from prefect import get_client

        from kinetic_prefect.caller import _prefect
        from kinetic_prefect.errors import KineticJobCancelled

        async with get_client() as client:
            task_run = await _prefect.read_task_run_or_none(client, UUID(self.job_id))
            if task_run is None:
                raise KineticJobCancelled(
                    f"input {self.display_name} of batch {self.group_id} was cancelled before it started"
                )
            store, key = await _input_store(client, self.work_pool)
        layout = RunLayout(batch_input_run_id(task_run.id, task_run.run_count))
        return await to_thread.run_sync(self._collect_layout, task_run.state, layout, store, key, cleanup)

    def cancel(self, wait_seconds: float = 30) -> None:
        """Stop the input (its task run ends Cancelled): where it waits in this process, or through its task run's
        state from any other (the submission loop acts on it). Its payload and any pickled result are deleted."""
        if self.status() in TERMINAL:
            return
        if self._future is not None:
            from kinetic_prefect.shared import sweeps

            sweeps.stop_futures(
                [self._future], timeout=wait_seconds, reason="cancelled through the kinetic API (JobHandle.cancel)"
            )
        else:
            run_sync(_mark_cancelling(UUID(self.job_id), "Cancelled through the kinetic API (JobHandle.cancel)"))
            with contextlib.suppress(TimeoutError):  # its stop is on its way; the objects go now
                self._follow(wait_seconds, echo=False)
        run_sync(self._delete_objects(keep_outcome=True))

    def cleanup(self, k8s: bool = True, gcs: bool = True) -> None:
        if k8s and self.status() not in TERMINAL:
            self.cancel()
        if gcs:
            run_sync(self._delete_objects(keep_outcome=False))

    async def _delete_objects(self, keep_outcome: bool) -> None:
        from anyio import to_thread
        from prefect import get_client

        from kinetic_prefect import signing
        from kinetic_prefect.caller import _prefect

        async with get_client() as client:
            task_run = await _prefect.read_task_run_or_none(client, UUID(self.job_id))
            if task_run is None or not task_run.run_count:
                return
            store, _key = await _input_store(client, self.work_pool)
        layout = RunLayout(batch_input_run_id(task_run.id, task_run.run_count))
        for object_key in (layout.payload, layout.result, *(() if keep_outcome else (layout.outcome,))):
            await to_thread.run_sync(signing.delete, store, object_key)


async def _input_store(client: Any, pool_name: str) -> tuple[Any, signing.Keyring | None]:
    from kinetic_prefect.caller import _prefect
    from kinetic_prefect.shared import gcp

    pool = await client.read_work_pool(pool_name)
    store = gcp.open_store(gcp.store_url(pool), await gcp.pool_credentials(pool))
    return store, await _prefect.signing_key()


async def _mark_cancelling(task_run_id: UUID, message: str) -> None:
    from prefect import get_client
    from prefect.states import Cancelling

    async with get_client() as client:
        await client.set_task_run_state(task_run_id, Cancelling(message=message), force=True)


async def cancel_batch_run(flow_run_id: UUID, message: str) -> None:
    """The batch's flow run Cancelling: its sweep and its submission loop, wherever they run, stop its inputs."""
    from prefect import get_client
    from prefect.states import Cancelling

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        if flow_run.state is None or not flow_run.state.is_final():
            await client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)


class SlotSubmitter:
    """What ``batch._Submission`` submits through when its batch rides in slots (the module docstring)."""

    def __init__(self, remote: Any, pool: Any, batch: Any):
        self.remote, self.pool, self.batch = remote, pool, batch
        # Prefect would also persist each value in its result storage, where nobody reads or deletes it
        self.task = remote.task.with_options(persist_result=False)
        self.handles: dict[int, InputHandle] = {}
        self.stopping: set[int] = set()

    @property
    def batch_tags(self) -> tuple[str, ...]:
        return (
            f"{GROUP_TAG_PREFIX}{self.batch.group_id}",
            BATCH_TAG,
            f"{BATCH_POOL_TAG_PREFIX}{self.pool.name}",
        )

    def submit_tagged(self, args: tuple, kwargs: dict[str, Any], tags: tuple[str, ...]) -> InputHandle:
        from prefect import tags as prefect_tags

        call_args, call_kwargs = self.remote.call_args(args, kwargs)
        index = int(_tag_value(list(tags), GROUP_INDEX_TAG_PREFIX).split("/")[0])  # type: ignore[union-attr]
        with prefect_tags(*tags):  # on the task run, with the flow run's tags (the context is copied at submit)
            future = self.task.submit(*call_args, **call_kwargs)
        handle = InputHandle(
            job_id=str(future.task_run_id),
            func_name=self.task.name,
            display_name=f"{self.task.name}[{index}]",
            accelerator=self.remote.task.kinetic.accelerator.name,
            work_pool=self.pool.name,
            backend=self.pool.type,
            created_at=datetime.now(UTC).isoformat(),
            group_id=self.batch.group_id,
            group_index=index,
            detached=False,
            _future=future,
        )
        handle.keep_source(self.remote.fn)
        self.handles[index] = handle
        return handle

    def stop_all(self, reason: str = "its batch was cancelled") -> None:
        """Every input not ended stops (those not started never start); returns once they have ended."""
        from kinetic_prefect.shared import sweeps

        futures = [h.future for h in self.handles.values() if h.future is not None]
        sweeps.stop_futures(futures, reason=reason)

    def follow_stops(self, active: set[int]) -> None:
        """One poll of the submission loop: a cancel of the batch's flow run (from any process) drops what is left;
        an input whose task run was marked Cancelling is stopped where it waits."""
        from prefect import get_client
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId

        ids = [UUID(self.handles[i].job_id) for i in active if i in self.handles and i not in self.stopping]
        with get_client(sync_client=True) as client:
            parent = client.read_flow_run(self.batch.flow_run_id).state
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids))) if ids else []
        if parent is not None and (parent.is_cancelling() or parent.is_cancelled()):
            self.batch.stop_submitting()
            self.stop_all()
            return
        by_id = {str(run.id): run for run in runs}
        for index in active:
            handle = self.handles.get(index)
            run = by_id.get(handle.job_id) if handle is not None else None
            if handle is None or run is None or run.state is None or not run.state.is_cancelling():
                continue
            from kinetic_prefect.shared import sweeps

            self.stopping.add(index)
            self.batch.mark_cancelled(index)
            threading.Thread(
                target=sweeps.stop_futures,
                args=([handle.future],),
                kwargs={"reason": "cancelled through the kinetic API (JobHandle.cancel)"},
                daemon=True,
            ).start()


def run_batch_flow(loop: Any, submitter: SlotSubmitter) -> None:
    """The batch's flow run, in the batch's background thread: the submission loop runs inside it."""
    from prefect import flow
    from prefect import tags as prefect_tags
    from prefect.context import FlowRunContext

    batch = loop.batch

    @flow(name=BATCH_FLOW_NAME, flow_run_name=batch.name or batch.group_id, validate_parameters=False)
    def kinetic_batch() -> None:
        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        batch.flow_run_id = context.flow_run.id
        loop.run()

    try:
        with prefect_tags(*submitter.batch_tags):
            kinetic_batch(return_state=True)
    except BaseException as exc:  # the inputs' task runs say what happened; this only keeps the thread quiet
        print(f"kinetic-prefect: batch {batch.group_id} stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        batch.submission_ended()


__all__ = ["BATCH_FLOW_NAME", "InputHandle", "SlotSubmitter", "rides_in_slots", "run_batch_flow"]
