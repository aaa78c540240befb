"""``run_async_map`` batches: one detached job per input, a ``BatchHandle`` over them, ``attach_batch``.

Where the detached jobs would run inside the submitting process on a pool whose jobs can be slots, a batch of two
inputs or more rides in slots instead: one flow run whose inputs are task runs (kinetic.batch_inputs); the rules
below hold for both, a retry being a new task run there.

A batch is nothing but its jobs: each child's run carries the batch's tags (``contract.GROUP_TAG_PREFIX`` + the
group id, ``GROUP_INDEX_TAG_PREFIX`` + "index/inputs"), so ``attach_batch`` rebuilds the handle from Prefect's
records alone, from any process. Submission follows Kinetic's rules: at most ``max_concurrent`` jobs active, a
failed job submitted again up to ``retries`` times (a new job), ``fail_fast`` stops submitting after the first
failure and ``cancel_running_on_fail`` also cancels the running ones; the loop runs in a (non-daemon)
background thread whenever it has to watch jobs, else in the calling thread.
"""

from __future__ import annotations

import keyword
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from uuid import UUID

from kinetic_prefect.contract import BATCH_TAG, GROUP_INDEX_TAG_PREFIX, GROUP_TAG_PREFIX, Env
from kinetic_prefect.kinetic import batch_inputs
from kinetic_prefect.kinetic.job_lookup import PAGE
from kinetic_prefect.kinetic.jobs import (
    TERMINAL,
    JobHandle,
    JobStatus,
    ResultAlreadyCollected,
    run_sync,
    status_of,
)
from kinetic_prefect.kinetic.threads_at_exit import start_waited_for_at_exit

logger = logging.getLogger("kinetic_prefect.kinetic")
DEFAULT_MAX_CONCURRENT = 64
POLL_SECONDS = 1.0
INPUT_MODES = ("auto", "single", "args", "kwargs")


class BatchError(Exception):
    """Some children of a batch failed: ``failures`` (their handles), ``partial_results`` (None where one failed),
    ``submission_failures`` (input index -> the exception raised while submitting it)."""

    def __init__(
        self,
        group_id: str,
        failures: list[JobHandle],
        partial_results: list[Any],
        submission_failures: dict[int, BaseException] | None = None,
    ):
        self.group_id, self.failures, self.partial_results = group_id, failures, partial_results
        self.submission_failures = dict(submission_failures or {})
        super().__init__(
            f"Batch {group_id}: {len(failures) + len(self.submission_failures)} of {len(partial_results)} jobs failed"
        )


def _as_call(item: Any, input_mode: str) -> tuple[tuple, dict[str, Any]]:
    if input_mode == "single":
        return (item,), {}
    if input_mode == "args":
        if not isinstance(item, (list, tuple)):
            raise TypeError(f"input_mode='args' takes lists or tuples, not {type(item).__name__}: {item!r}")
        return tuple(item), {}
    if input_mode == "kwargs":
        if not isinstance(item, dict):
            raise TypeError(f"input_mode='kwargs' takes dicts, not {type(item).__name__}: {item!r}")
        return (), dict(item)
    if isinstance(item, dict) and all(
        isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in item
    ):
        return (), dict(item)
    if isinstance(item, (list, tuple)):
        return tuple(item), {}
    return (item,), {}


class BatchHandle:
    """The jobs of one ``run_async_map``, in input order (``jobs[i]`` is None until input i is submitted)."""

    def __init__(self, group_id: str, total: int, name: str | None = None, tags: dict[str, str] | None = None):
        self.group_id, self.name, self.tags = group_id, name, dict(tags or {})
        self.jobs: list[JobHandle | None] = [None] * total
        self._lock = threading.Lock()
        self._submission_complete = threading.Event()
        self._cancel_requested = threading.Event()
        self._submission_errors: dict[int, BaseException] = {}
        self._failed_indices: set[int] = set()  # terminal failures after every attempt
        self._cancelled_indices: set[int] = set()
        self._unavailable: dict[int, str] = {}
        self._cached_failures: list[JobHandle] | None = None
        self._refresh_until: float | None = None  # attach_batch: children still expected until then
        self.flow_run_id: UUID | None = None  # a batch in slots: its flow run (kinetic.batch_inputs)
        self.submitter: Any = None  # a batch in slots submitted by this process: stops its inputs directly

    # ------------------------------------------------------------------ observing
    def _states(self) -> dict[int, JobStatus]:
        from prefect import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterId

        with self._lock:
            submitted = {i: job for i, job in enumerate(self.jobs) if job is not None}
        if not submitted:
            return {}
        from kinetic_prefect.kinetic.batch_inputs import InputHandle, input_status

        inputs = [UUID(job.job_id) for job in submitted.values() if isinstance(job, InputHandle)]
        ids = [UUID(job.job_id) for job in submitted.values() if not isinstance(job, InputHandle)]
        by_id: dict[str, Any] = {}
        task_runs: dict[str, Any] = {}
        with get_client(sync_client=True) as client:
            for start in range(0, len(ids), PAGE):  # one read per 200 jobs (the server's cap on a read)
                chunk = ids[start : start + PAGE]
                for run in client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)), limit=len(chunk)
                ):
                    by_id[str(run.id)] = run.state
            for start in range(0, len(inputs), PAGE):
                chunk = inputs[start : start + PAGE]
                for task_run in client.read_task_runs(
                    task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=chunk)), limit=len(chunk)
                ):
                    task_runs[str(task_run.id)] = task_run
        return {
            i: input_status(task_runs.get(job.job_id), job)
            if isinstance(job, InputHandle)
            else status_of(by_id[job.job_id])
            if job.job_id in by_id
            else JobStatus.NOT_FOUND
            for i, job in submitted.items()
        }

    def statuses(self) -> list[tuple[int, JobStatus]]:
        return sorted(self._states().items())

    def status_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _index, status in self.statuses():
            counts[status.value] = counts.get(status.value, 0) + 1
        return counts

    @property
    def submission_failures(self) -> dict[int, BaseException]:
        return dict(self._submission_errors)

    @property
    def unavailable_children(self) -> dict[int, str]:
        """Children whose result was already collected (and deleted) by an earlier ``results()``."""
        return dict(self._unavailable)

    def expect_children_until(self, deadline: float) -> None:
        """An attached batch whose submitter is still at work: its missing children are looked for again at each
        poll until ``deadline`` (``time.monotonic()``)."""
        self._refresh_until = deadline

    def submission_ended(self) -> None:
        """Every input has a job (or a submission error): waiting now waits for the jobs alone."""
        self._submission_complete.set()

    # ------------------------------------------------------------------ what its submitter records
    def submitted(self, index: int, job: JobHandle) -> None:
        with self._lock:
            self.jobs[index] = job

    def submission_failed(self, index: int, exc: BaseException) -> None:
        """A packaging or validation error: the same on every attempt, never retried."""
        self._submission_errors[index] = exc

    def failed_for_good(self, index: int) -> None:
        """The input's job failed after every attempt."""
        self._failed_indices.add(index)

    def was_cancelled(self, index: int) -> bool:
        return index in self._cancelled_indices

    def mark_cancelled(self, index: int) -> None:
        """The input was cancelled on request (kinetic.batch_inputs): not retried."""
        with self._lock:
            self._cancelled_indices.add(index)

    def stop_submitting(self) -> None:
        """The batch was cancelled: nothing more is submitted or retried."""
        self._cancel_requested.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested.is_set()

    def _settled(self) -> bool:
        if self._refresh_until is not None:
            if time.monotonic() < self._refresh_until and None in self.jobs:
                self._refresh_children()
            if None not in self.jobs or time.monotonic() >= self._refresh_until:
                self._refresh_until = None
                self._submission_complete.set()
        return self._submission_complete.is_set()

    def wait(self, *, timeout: float | None = None) -> None:
        """Until the submission has ended and every submitted job is terminal (``TimeoutError`` after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._settled() and all(s in TERMINAL for s in self._states().values()):
                if self._submission_errors:
                    logger.warning(f"batch {self.group_id}: {len(self._submission_errors)} input(s) failed to submit")
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.group_id} did not end within {timeout} s; its jobs keep running")
            time.sleep(POLL_SECONDS)

    def as_completed(self, timeout: float | None = None) -> Iterator[JobHandle]:
        """Each job's handle as it ends, in the order they end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            for index, status in sorted(self._states().items()):
                if index not in seen and status in TERMINAL:
                    seen.add(index)
                    job = self.jobs[index]
                    assert job is not None
                    yield job
            submitted = {i for i, job in enumerate(self.jobs) if job is not None}
            if self._settled() and submitted <= seen:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.group_id}: not every job ended within {timeout} s")
            time.sleep(POLL_SECONDS)

    # ------------------------------------------------------------------ collecting
    def results(
        self, timeout: float | None = None, ordered: bool = True, cleanup: bool = True, return_exceptions: bool = False
    ) -> list[Any]:
        """Every job's value, in input order (``ordered=False``: in the order they ended); a failed position raises
        ``BatchError`` (``return_exceptions=True``: holds the exception)."""
        order: list[int] = []
        for job in self.as_completed(timeout=timeout):
            assert job.group_index is not None
            order.append(job.group_index)
        results: list[Any] = [None] * len(self.jobs)
        failures: list[JobHandle] = []
        errors: dict[int, BaseException] = dict(self._submission_errors)
        for index, maybe_job in enumerate(self.jobs):
            if maybe_job is None:
                continue
            job = maybe_job
            try:
                results[index] = job.result(cleanup=cleanup)
            except ResultAlreadyCollected:
                self._unavailable[index] = job.job_id
            except Exception as exc:  # the job's own exception, its remote traceback attached
                failures.append(job)
                errors[index] = exc
        self._cached_failures = failures
        if errors and not return_exceptions:
            raise BatchError(
                self.group_id,
                failures,
                [None if i in errors else r for i, r in enumerate(results)],
                self._submission_errors,
            )
        for index, error in errors.items():
            results[index] = error
        if not ordered:
            rest = [i for i in range(len(self.jobs)) if i not in order]
            return [results[i] for i in order + rest]
        return results

    def failures(self) -> list[JobHandle]:
        """The jobs that failed (after their retries); after ``results()``, the failures it found."""
        if self._cached_failures is not None:
            return list(self._cached_failures)
        return [self.jobs[i] for i, s in self.statuses() if s is JobStatus.FAILED]  # type: ignore[misc]

    # ------------------------------------------------------------------ stopping
    def cancel(self) -> None:
        """Cancel every job that has not ended, drop the inputs not yet submitted, retry nothing."""
        self._cancel_requested.set()
        states = self._states()
        with self._lock:
            active = [i for i, s in states.items() if s not in TERMINAL]
            self._cancelled_indices.update(active)
        if self.flow_run_id is not None or self.submitter is not None:  # in slots: its flow run, from any process
            from kinetic_prefect.kinetic.batch_inputs import cancel_batch_run

            if self.flow_run_id is not None:
                run_sync(cancel_batch_run(self.flow_run_id, "Cancelled through the kinetic API (BatchHandle.cancel)"))
            if self.submitter is not None:
                self.submitter.stop_all()
            return
        for index in active:
            job = self.jobs[index]
            if job is not None:
                job.cancel()

    def cleanup(self, *, k8s: bool = True, gcs: bool = True) -> None:
        for job in self.jobs:
            if job is not None:
                job.cleanup(k8s=k8s, gcs=gcs)

    def _refresh_children(self) -> None:
        for index, job in _children(self.group_id)[2].items():
            if index < len(self.jobs) and self.jobs[index] is None:
                self.jobs[index] = job


class _Submission:
    """The submission loop of one batch (Kinetic's rules, see the module docstring)."""

    def __init__(
        self,
        remote: Any,
        batch: BatchHandle,
        calls: list[tuple[tuple, dict[str, Any]]],
        max_concurrent: int | None,
        retries: int,
        fail_fast: bool,
        cancel_running_on_fail: bool,
    ):
        self.remote, self.batch, self.calls = remote, batch, calls
        self.max_concurrent, self.retries = max_concurrent, retries
        self.fail_fast, self.cancel_running = fail_fast, fail_fast and cancel_running_on_fail
        self.queue = list(range(len(calls)))
        self.attempts = [0] * len(calls)
        self.active: set[int] = set()
        self.stopped = False  # fail_fast fired: nothing new is submitted

    @property
    def watches_jobs(self) -> bool:  # in slots: the batch's flow run lasts until its inputs end
        in_slots = hasattr(self.remote, "follow_stops")
        return in_slots or self.max_concurrent is not None or self.retries > 0 or self.cancel_running

    def submit(self, index: int) -> None:
        args, kwargs = self.calls[index]
        total = len(self.calls)
        tags = (f"{GROUP_TAG_PREFIX}{self.batch.group_id}", f"{GROUP_INDEX_TAG_PREFIX}{index}/{total}")
        self.attempts[index] += 1
        try:
            job = self.remote.submit_tagged(args, kwargs, tags)
        except Exception as exc:  # a packaging or validation error: the same on every attempt, never retried
            self.batch.submission_failed(index, exc)
            if self.fail_fast:
                self.stop()
            return
        self.batch.submitted(index, job)
        self.active.add(index)

    def stop(self) -> None:
        self.stopped = True
        if self.cancel_running:
            self.batch.cancel()

    def fill(self) -> None:
        while self.queue and not self.stopped and not self.batch.cancel_requested:
            if self.max_concurrent is not None and len(self.active) >= self.max_concurrent:
                return
            self.submit(self.queue.pop(0))

    def run(self) -> None:
        try:
            self.fill()
            while self.watches_jobs and self.active:
                time.sleep(POLL_SECONDS)
                if hasattr(self.remote, "follow_stops"):  # a batch in slots: a cancel from any process
                    self.remote.follow_stops(self.active)
                states = dict(self.batch.statuses())
                for index in [i for i in self.active if states.get(i) in TERMINAL]:
                    self.active.discard(index)
                    if states[index] is JobStatus.SUCCEEDED or self.batch.was_cancelled(index):
                        continue
                    cancelled = self.batch.cancel_requested
                    if self.attempts[index] <= self.retries and not cancelled:
                        logger.warning(
                            f"batch {self.batch.group_id}: input {index} failed "
                            f"(attempt {self.attempts[index]}); submitting it again"
                        )
                        self.submit(index)
                    else:
                        self.batch.failed_for_good(index)
                        if self.fail_fast and not self.stopped:
                            self.stop()
                self.fill()
        finally:
            self.batch.submission_ended()


def run_async_map(
    remote: Any,
    inputs: Any,
    *,
    input_mode: str = "auto",
    max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
    retries: int = 0,
    fail_fast: bool = False,
    cancel_running_on_fail: bool = False,
    name: str | None = None,
    tags: dict[str, str] | None = None,
    project: str | None = None,
    cluster: str | None = None,
) -> BatchHandle:
    """One detached job per input, or one flow run whose inputs ride in slots (kinetic.batch_inputs); returns once
    the submission has ended or was handed to a background thread."""
    if project is not None or cluster is not None:
        raise TypeError(
            "run_async_map(project=/cluster=) has no per-call equivalent here: a work pool holds where "
            f"jobs run; pass work_pool='NAME' to @kinetic.run (or set {Env.WORK_POOL})"
        )
    if input_mode not in INPUT_MODES:
        raise ValueError(f"input_mode={input_mode!r} is not one of {', '.join(INPUT_MODES)}")
    if max_concurrent is not None and (isinstance(max_concurrent, bool) or max_concurrent < 1):
        raise ValueError(f"max_concurrent must be a positive integer or None, got {max_concurrent!r}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    items = list(inputs)
    calls = [_as_call(item, input_mode) for item in items]  # a bad input fails here, before any job
    batch = BatchHandle(f"grp-{uuid.uuid4().hex[:8]}", len(items), name=name, tags=tags)
    if max_concurrent is None and len(items) > 100:
        logger.warning(f"batch {batch.group_id}: {len(items)} inputs with max_concurrent=None submit at once")
    pool = batch_inputs.rides_in_slots(remote, len(items))
    if pool is not None:  # one flow run, its inputs riding in slots (kinetic.batch_inputs)
        batch.submitter = submitter = batch_inputs.SlotSubmitter(remote, pool, batch)
        loop = _Submission(submitter, batch, calls, max_concurrent, retries, fail_fast, cancel_running_on_fail)
        start_waited_for_at_exit(
            threading.Thread(
                target=batch_inputs.run_batch_flow, args=(loop, submitter), name=f"kinetic-batch-{batch.group_id}"
            )
        )
        return batch
    loop = _Submission(remote, batch, calls, max_concurrent, retries, fail_fast, cancel_running_on_fail)
    if loop.watches_jobs:
        start_waited_for_at_exit(threading.Thread(target=loop.run, name=f"kinetic-batch-{batch.group_id}"))
    else:
        loop.run()
    return batch


def _children(group_id: str) -> tuple[int, UUID | None, dict[int, JobHandle]]:
    """``(inputs, the batch's flow run if it rides in slots, newest job per input index)`` of a batch, from the tags
    of its jobs' runs, or of its inputs' task runs."""
    from prefect import get_client

    from kinetic_prefect.kinetic.job_lookup import find_jobs

    tag = f"{GROUP_TAG_PREFIX}{group_id}"
    handles: list[JobHandle] = run_sync(find_jobs(True, 10_000, None, extra_tags=(tag,)))
    flow_run_id, tags = None, None
    if handles:
        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(UUID(handles[0].job_id)).tags
    else:
        task_runs = _input_task_runs(tag)
        handles = [batch_inputs.InputHandle.from_task_run(task_run) for task_run in task_runs]
        if task_runs:
            flow_run_id, tags = task_runs[0].flow_run_id, task_runs[0].tags
    newest = {}
    for handle in sorted(handles, key=lambda h: h.created_at):
        if handle.group_index is None:
            continue
        newest[handle.group_index] = handle  # a retry is a newer job for the same input
    total = int(next(t for t in tags if t.startswith(GROUP_INDEX_TAG_PREFIX)).rsplit("/", 1)[1]) if tags else 0
    return total, flow_run_id, newest


def _input_task_runs(tag: str) -> list[Any]:
    """The task runs of a batch in slots (kinetic.batch_inputs), read in pages."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterTags

    found: list[Any] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_task_runs(
                task_run_filter=TaskRunFilter(tags=TaskRunFilterTags(all_=[tag, BATCH_TAG])),
                limit=PAGE,
                offset=len(found),
            )
            found.extend(page)
            if len(page) < PAGE:
                return found


def attach_batch(group_id: str, poll_interval: float = 10.0, poll_timeout: float | None = 1800.0) -> BatchHandle:
    """The handle of a batch from its ``group_id``, from any process that reaches the same Prefect API. Inputs not
    yet submitted (their submitter still at work) are looked for again until ``poll_timeout``."""
    total, flow_run_id, children = _children(group_id)
    if not children:
        raise LookupError(f"no batch {group_id!r}: no job's run carries the tag {GROUP_TAG_PREFIX}{group_id}")
    batch = BatchHandle(group_id, total)
    batch.flow_run_id = flow_run_id
    for index, job in children.items():
        batch.jobs[index] = job
    if None in batch.jobs:
        logger.warning(
            f"batch {group_id}: {batch.jobs.count(None)} of {total} inputs have no job yet; looking again "
            f"until {poll_timeout} s from now"
        )
        batch.expect_children_until(time.monotonic() + (poll_timeout if poll_timeout is not None else float("inf")))
    else:
        batch.submission_ended()
    del poll_interval  # the handle looks again at every poll of wait()/results()
    return batch


__all__ = ["BatchError", "BatchHandle", "attach_batch", "run_async_map"]
