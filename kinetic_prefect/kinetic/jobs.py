"""Detached jobs: ``JobHandle`` (``status()``, ``logs()``, ``result()``, ``cancel()``, ``cleanup()``) and ``JobStatus``.

A job is a kinetic job's Prefect flow run, and ``job_id`` is that flow run's id: what the UI shows, what
``prefect flow-run inspect`` takes. Everything a handle knows comes from Prefect's record of the run (state,
logs, job variables: the store and the run's id in it) and from the store (outcome, signed result), so any
process or machine that reaches the same Prefect API and store can attach to a job (``job_lookup.attach``),
whoever submitted it (``detached.submit_detached``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from uuid import UUID

from kinetic_prefect import signing
from kinetic_prefect.contract import (
    DETACHED_TAG,
    GROUP_INDEX_TAG_PREFIX,
    GROUP_TAG_PREFIX,
    LOG_END_MARKER,
    Env,
    Outcome,
    RunLayout,
)
from kinetic_prefect.kinetic.threads_at_exit import start_waited_for_at_exit


class JobStatus(Enum):
    """Kinetic's five statuses of a job, read from the state of its run."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    NOT_FOUND = "NOT_FOUND"  # the run is gone, or was cancelled (its job no longer exists)


TERMINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.NOT_FOUND)


class ResultAlreadyCollected(LookupError):
    """The job succeeded, and its value was already collected with cleanup (its pickled result is deleted)."""


def status_of(state: Any) -> JobStatus:
    if state is None:
        return JobStatus.PENDING
    if state.is_cancelled():
        return JobStatus.NOT_FOUND
    if state.is_completed():
        return JobStatus.SUCCEEDED
    if state.is_final():  # Failed, Crashed
        return JobStatus.FAILED
    if state.is_running() or state.is_cancelling():
        return JobStatus.RUNNING
    return JobStatus.PENDING  # Scheduled, Late, Pending


def run_sync(coro: Any) -> Any:
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(coro)


def _tag_value(tags: list[str], prefix: str) -> str | None:
    return next((t[len(prefix) :] for t in tags if t.startswith(prefix)), None)


@dataclass
class JobHandle:
    """One job, from any process: ``status()``, ``logs()``, ``result()``, ``cancel()``, ``cleanup()``."""

    job_id: str  # the job's Prefect flow run id
    func_name: str
    display_name: str
    accelerator: str
    work_pool: str
    backend: str  # the pool's type: kinetic-local, kinetic-gke
    created_at: str
    group_id: str | None = None
    group_index: int | None = None
    detached: bool = True
    _runner: threading.Thread | None = field(default=None, repr=False, compare=False)
    # The submitter's function: a remote traceback's frames get their file names and source lines back.
    _fn: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ building
    def keep_source(self, fn: Callable[..., Any] | None) -> None:
        """The submitter's function: a remote traceback's frames get their file names and source lines back."""
        self._fn = fn

    def run_in_this_process(self, runner: threading.Thread) -> None:
        """Start the thread that runs this job inside the submitting process; Python waits for it at exit."""
        self._runner = runner
        start_waited_for_at_exit(runner)

    @classmethod
    async def from_flow_run(cls, client: Any, flow_run: Any) -> JobHandle:
        from prefect.exceptions import ObjectNotFound

        variables = flow_run.job_variables or {}
        if not (variables.get("env") or {}).get(Env.RUN_ID):
            raise ValueError(
                f"flow run {flow_run.id} ({flow_run.name}) is not a kinetic job: its job variables carry "
                f"no {Env.RUN_ID}. Pass the id of a job's run (`kinetic-prefect jobs list`), not of the "
                "flow that called the kinetic task."
            )
        try:
            func_name = (await client.read_flow(flow_run.flow_id)).name
        except ObjectNotFound:
            func_name = flow_run.name
        pool_type = ""
        if flow_run.work_pool_name:
            with contextlib.suppress(ObjectNotFound):
                pool_type = (await client.read_work_pool(flow_run.work_pool_name)).type
        index = _tag_value(flow_run.tags, GROUP_INDEX_TAG_PREFIX)
        return cls(
            job_id=str(flow_run.id),
            func_name=func_name,
            display_name=flow_run.name,
            accelerator=str(variables.get("accelerator", "")),
            work_pool=flow_run.work_pool_name or "",
            backend=pool_type,
            created_at=flow_run.created.isoformat() if flow_run.created else "",
            group_id=_tag_value(flow_run.tags, GROUP_TAG_PREFIX),
            group_index=int(index.split("/")[0]) if index else None,
            detached=DETACHED_TAG in flow_run.tags,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") and v is not None}

    # ------------------------------------------------------------------ reading
    async def _read(self, client: Any) -> Any:
        return await client.read_flow_run(UUID(self.job_id))

    def state(self) -> Any:
        """Prefect's state of the job's run (finer than ``status()``: Crashed, Cancelled, Late...)."""
        from prefect import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                return client.read_flow_run(UUID(self.job_id)).state
            except ObjectNotFound:
                return None

    def status(self) -> JobStatus:
        from prefect import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                return status_of(client.read_flow_run(UUID(self.job_id)).state)
            except ObjectNotFound:
                return JobStatus.NOT_FOUND

    def logs(self, follow: bool = False) -> str | None:
        """The job's output so far; ``follow=True`` prints it as it comes until the job ends (returns None)."""
        if follow:
            from prefect import get_client

            async def follow_logs() -> None:
                from kinetic_prefect.caller import _prefect

                async with get_client() as client:
                    await _prefect.wait_for_final_state(
                        client, UUID(self.job_id), on_log=lambda text: print(text, flush=True)
                    )

            run_sync(follow_logs())
            return None
        return "\n".join(self._log_lines())

    def tail(self, n: int = 100) -> str:
        return "\n".join(self._log_lines()[-n:])

    def _log_filter(self) -> Any:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        return LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(self.job_id)]))

    def _log_lines(self) -> list[str]:
        from prefect import get_client
        from prefect.client.schemas.sorting import LogSort

        lines: list[str] = []
        with get_client(sync_client=True) as client:
            offset = 0
            while True:
                page = client.read_logs(
                    self._log_filter(),
                    limit=200,
                    offset=offset,
                    sort=LogSort.TIMESTAMP_ASC,
                )
                lines.extend(line for log in page if log.message != LOG_END_MARKER for line in log.message.split("\n"))
                if len(page) < 200:
                    return lines
                offset += len(page)

    # ------------------------------------------------------------------ collecting
    def result(self, timeout: float | None = None, cleanup: bool = True, stream_logs: bool = False) -> Any:
        """Wait for the job (``timeout`` seconds at most: ``TimeoutError``, the job keeps running) and return its
        value, or raise its exception with the remote traceback. The result is read from the store and checked
        against its signature before it is unpickled; once a value is collected its payload and pickled result
        are deleted (``cleanup=False`` keeps them). A failed job keeps them, so it raises the same way again."""
        return run_sync(self._result(timeout, cleanup, stream_logs))

    async def _result(self, timeout: float | None, cleanup: bool, stream_logs: bool) -> Any:
        import anyio
        from anyio import to_thread
        from prefect import get_client

        from kinetic_prefect.caller import _prefect

        async with get_client() as client:
            try:
                with anyio.fail_after(timeout):
                    await _prefect.wait_for_final_state(
                        client,
                        UUID(self.job_id),
                        poll_seconds=0.5,
                        on_log=(lambda text: print(text, file=sys.stderr, flush=True)) if stream_logs else None,
                    )
            except TimeoutError:
                raise TimeoutError(
                    f"job {self.job_id} ({self.display_name}) did not end within {timeout} s; it keeps "
                    "running: call result() again, or cancel() it"
                ) from None
            flow_run = await self._read(client)
            store, key = await _open_store(client, flow_run)
        return await to_thread.run_sync(self._collect, flow_run, store, key, cleanup)

    def _collect(self, flow_run: Any, store: Any, key: signing.KeyLike, cleanup: bool) -> Any:
        layout = RunLayout((flow_run.job_variables or {})["env"][Env.RUN_ID])
        return self._collect_layout(flow_run.state, layout, store, key, cleanup)

    def _collect_layout(self, state: Any, layout: RunLayout, store: Any, key: signing.KeyLike, cleanup: bool) -> Any:
        """The value (or the exception) the job left under ``layout``, its run having ended in ``state``."""
        import cloudpickle

        from kinetic_prefect import signing
        from kinetic_prefect.caller.outcomes import read_signed
        from kinetic_prefect.caller.remote_errors import raise_remote
        from kinetic_prefect.errors import KineticJobCancelled, KineticJobCrashed
        from kinetic_prefect.storage import ObjectNotFound

        if state.is_cancelled():
            raise KineticJobCancelled(
                f"job {self.job_id} ({self.display_name}) was cancelled: {state.message or 'on request'}"
            )
        try:
            outcome = Outcome.from_json(read_signed(store, layout.outcome, key))
        except ObjectNotFound:
            raise KineticJobCrashed(
                f"job {self.job_id} ({self.display_name}) ended without an outcome ({state.name}: {state.message})"
            ) from None
        if not outcome.completed:
            try:
                blob = read_signed(store, layout.result, key)
            except ObjectNotFound:
                blob = None
            raise_remote(outcome, blob, self.display_name, self._fn)  # type: ignore[arg-type]
        try:
            value = cloudpickle.loads(read_signed(store, layout.result, key))
        except ObjectNotFound:
            raise ResultAlreadyCollected(
                f"job {self.job_id} ({self.display_name}) succeeded, but its result was "
                "already collected and deleted (result(cleanup=False) keeps it for a second "
                "reader)"
            ) from None
        if cleanup:
            for object_key in (layout.payload, layout.result):
                signing.delete(store, object_key)
        return value

    # ------------------------------------------------------------------ stopping and cleaning up
    def cancel(self, wait_seconds: float = 30) -> str | None:
        """Stop the job (its run ends Cancelled) and say what was stopped. Its payload and any pickled result are
        deleted, since nobody will collect them; its outputs and the outcome record stay.

        The worker following the job stops it; where none does (its in-process caller was killed, its polling
        worker is down: nobody acts on Cancelling within ``wait_seconds``), the job's machine is stopped here through
        its pool's launcher (a Vertex AI custom job cancelled, a Kubernetes Job deleted) before the run is set
        Cancelled. A machine that cannot be stopped raises ``JobNotStopped`` and leaves the run as it was."""
        said = run_sync(
            _cancel(UUID(self.job_id), "Cancelled through the kinetic API (JobHandle.cancel)", wait_seconds)
        )
        run_sync(_delete_run_objects(UUID(self.job_id), keep_outcome=True))
        return str(said)

    def cleanup(self, k8s: bool = True, gcs: bool = True) -> None:
        """``k8s``: stop the job if it still runs. ``gcs``: delete its objects in the store (payload, result, outcome;
        its outputs stay, as in Kinetic)."""
        if k8s and self.status() not in TERMINAL:
            self.cancel()
        if gcs:
            run_sync(_delete_run_objects(UUID(self.job_id)))

    def wait(self, timeout: float | None = None) -> JobStatus:
        from prefect import get_client

        async def until_final() -> None:
            import anyio

            from kinetic_prefect.caller import _prefect

            async with get_client() as client:
                with anyio.fail_after(timeout):
                    await _prefect.wait_for_final_state(client, UUID(self.job_id), poll_seconds=0.5)

        run_sync(until_final())
        return self.status()


async def _open_store(client: Any, flow_run: Any) -> tuple[Any, signing.Keyring | None]:
    """The store the job wrote to (its job variables name it), opened with its pool's credentials."""
    from kinetic_prefect.caller import _prefect
    from kinetic_prefect.shared import gcp

    pool = await client.read_work_pool(flow_run.work_pool_name)
    store = gcp.open_store(flow_run.job_variables["store"], await gcp.pool_credentials(pool))
    return store, await _prefect.signing_key()


STOP_GRACE_SECONDS = 10.0  # what a job is given to end by itself before it is killed (the lifecycle's grace)


class JobNotStopped(RuntimeError):
    """Nobody followed the job and its machine could not be stopped: its run is left as it was."""


async def _cancel(flow_run_id: UUID, message: str, wait_seconds: float) -> str:
    """Stop the job; what was stopped, in words."""
    from prefect import get_client
    from prefect.states import Cancelled

    from kinetic_prefect.caller import _prefect
    from kinetic_prefect.shared.prefect_runs import owner_is_gone

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        if flow_run.state is not None and flow_run.state.is_final():
            return f"nothing to stop: the run is already {flow_run.state.name}"
        if flow_run.state is not None and flow_run.state.is_scheduled():
            # Nobody has claimed it: no worker would ever see a Cancelling. A claim races with this and loses.
            await client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)
            return "nothing to stop: the job had not started"
        if not owner_is_gone(flow_run):
            await _prefect.cancel_flow_run(client, flow_run_id, message, wait_seconds=wait_seconds)
            current = await client.read_flow_run(flow_run_id)
            if current.state is not None and current.state.is_final():
                return f"stopped by the worker that followed it ({current.state.name})"
            flow_run, why = current, f"nobody acted on its cancellation within {wait_seconds:g} s"
        else:
            why = "its calling process was gone"
        # An in-process job whose caller was killed, or a job whose polling worker is down: nobody is left to stop
        # the machine, so it is stopped here, and only then is the run said Cancelled.
        stopped = await _stop_machine(client, flow_run)
        await client.set_flow_run_state(flow_run_id, Cancelled(message=f"{message}; {why}; {stopped}"), force=True)
        return stopped


async def _stop_machine(client: Any, flow_run: Any) -> str:
    """Stop the run's job through its pool's launcher (as the worker would): what was stopped, in words."""
    from kinetic_prefect.caller.pools import worker_class_for

    pool = await client.read_work_pool(flow_run.work_pool_name)
    worker_cls = worker_class_for(pool.type)
    worker = worker_cls(work_pool_name=pool.name, name="kinetic-jobs-cancel", create_pool_if_not_found=False)
    worker.use_for_one_call(client, pool)
    launcher = worker.launcher
    try:
        configuration = await worker_cls.job_configuration.resolve_for_flow_run(
            flow_run, client=client, work_pool=pool, worker_name=worker.name
        )
        identifier = await launcher.find(flow_run, configuration)
        if identifier is None:
            return f"no job of the run was found on work pool {pool.name!r} ({pool.type}): nothing was running"
        before = await launcher.status(identifier, configuration)
        if before.phase in ("exited", "gone"):
            return f"its {launcher.job_kind} {identifier} had already ended ({before.detail or before.phase})"
        # as the worker stops a job it follows: the launcher's cancel returns once the job is stopped (or deleted)
        await launcher.cancel(identifier, configuration, STOP_GRACE_SECONDS)
        after = await launcher.status(identifier, configuration)
    except Exception as exc:
        raise JobNotStopped(
            f"job {flow_run.id} ({flow_run.name}): its job on work pool {pool.name!r} ({pool.type}) could not be "
            f"stopped: {type(exc).__name__}: {exc}. Its run is left as it was; stop the job with the platform's own "
            "tools (e.g. `gcloud ai custom-jobs cancel`, `kubectl delete job`), or retry `kinetic-prefect jobs cancel`"
        ) from exc
    return f"stopped {launcher.job_kind} {identifier}" + (f" ({after.detail})" if after.detail else "")


async def _delete_run_objects(flow_run_id: UUID, keep_outcome: bool = False) -> None:
    from anyio import to_thread
    from prefect import get_client

    from kinetic_prefect import signing

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        store, _key = await _open_store(client, flow_run)
    layout = RunLayout((flow_run.job_variables or {})["env"][Env.RUN_ID])
    for object_key in (layout.payload, layout.result, *(() if keep_outcome else (layout.outcome,))):
        await to_thread.run_sync(signing.delete, store, object_key)


__all__ = ["JobHandle", "JobNotStopped", "JobStatus", "ResultAlreadyCollected"]
