"""Stopping a sweep: Ctrl-C / SIGTERM of the calling script stops every job, and ``fail_fast`` over futures.

A ``.map()`` or ``.submit()`` runs each call in one of Prefect's task-runner threads, waiting for its job. A signal
reaches the main thread only: there it becomes a KeyboardInterrupt (Ctrl-C) or Prefect's TerminationSignal
(SIGTERM, inside a flow run), and on its way out the flow waits for the task runner's threads, which would wait for
their jobs to finish (minutes) and let them end Completed. So every call waiting in a thread
(``_prefect.run_interruptibly``) looks, every 0.2 s, at what the main thread is handling; once it is such an
interrupt, the call stops its job as a timeout or a Ctrl-C of a single call does: the job is stopped and its run ends
Cancelled. No signal handler is replaced (Prefect's SIGTERM bridge must stay its own), and an interrupt the script
catches and gets past leaves later calls alone.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


class CallerStopped(BaseException):
    """The calling script was interrupted (Ctrl-C or SIGTERM) while this call waited for its job.

    A BaseException, as KeyboardInterrupt is: Prefect must not retry a call whose caller is going away.
    """


_INTERRUPTS: tuple[type[BaseException], ...] = ()


def _interrupts() -> tuple[type[BaseException], ...]:
    global _INTERRUPTS
    if not _INTERRUPTS:  # imported once, while the process runs (not while it shuts down)
        from prefect.exceptions import TerminationSignal

        _INTERRUPTS = (KeyboardInterrupt, TerminationSignal)
    return _INTERRUPTS


# What the main thread is handling, read for every waiting call at once. ``sys._current_exceptions()`` walks every
# thread, so each of N waiting calls reading it 5 times a second was O(N²) work under the GIL: a 512-input map spent
# a core on it and starved the event loop the calls share. One reading serves all calls for SNAPSHOT_SECONDS.
SNAPSHOT_SECONDS = 0.1
_snapshot_lock = threading.Lock()
_snapshot: tuple[float, bool] = (0.0, False)  # (monotonic time of the reading, the main thread was interrupted)


def _main_thread_interrupted() -> bool:
    main = threading.main_thread()
    # CPython's view of each thread's exception being handled (an exc_info tuple before 3.12, the exception after).
    handled = sys._current_exceptions().get(main.ident or 0)  # noqa: SLF001 - CPython's, no public equivalent
    exc = handled[1] if isinstance(handled, tuple) else handled
    return isinstance(exc, _interrupts())


def caller_interrupted() -> bool:
    """Whether the main thread is unwinding from a Ctrl-C or a SIGTERM (False in the main thread itself, where
    the interrupt is raised into the waiting call directly); at most SNAPSHOT_SECONDS old."""
    global _snapshot
    if threading.current_thread() is threading.main_thread():
        return False
    if getattr(threading, "_SHUTTING_DOWN", False) and isinstance(getattr(sys, "last_value", None), _interrupts()):
        return True  # the script already ended with the interrupt; the interpreter now waits for its threads
    read_at, interrupted = _snapshot
    now = time.monotonic()
    if now - read_at < SNAPSHOT_SECONDS or not _snapshot_lock.acquire(blocking=False):
        return interrupted  # fresh enough, or another thread is reading it right now
    try:
        _snapshot = (now, _main_thread_interrupted())
        return _snapshot[1]
    finally:
        _snapshot_lock.release()


_caller_stopped = threading.Event()  # a waiting call saw the script's interrupt: what a sweep's slots go by


def caller_was_stopped() -> bool:
    """Whether a waiting call of this process has stopped for a Ctrl-C or SIGTERM of the script (or one is now)."""
    return _caller_stopped.is_set() or caller_interrupted()


def check_caller() -> None:
    """Raise CallerStopped when the calling script is being interrupted (see the module docstring)."""
    if caller_interrupted():
        _caller_stopped.set()
        raise CallerStopped("the calling script was interrupted (Ctrl-C or SIGTERM): its job is stopped")


# --------------------------------------------------------------------------- waking the waiting calls

# Each waiting call woke 5 times a second to look (``run_interruptibly``): 1,000 task-runner threads of a
# 1,000-input map woke 5,000 times a second, and their fight for the GIL starved the event loop their calls
# share (30 job runs in 11 minutes). Now one watcher thread looks every WATCH_SECONDS and wakes every waiting
# call at an interrupt, and a call wakes by itself less often the more calls wait (for an exception Prefect
# raises into its thread, a task's timeout): every WATCH_SECONDS up to CALLS_PER_WAKE calls, at most every
# MAX_WAKE_SECONDS.
WATCH_SECONDS = 0.2
CALLS_PER_WAKE = 50
MAX_WAKE_SECONDS = 2.0
_waiting: set[threading.Event] = set()
_waiting_lock = threading.Lock()
_watcher: threading.Thread | None = None


def wake_on_interrupt(wake: threading.Event) -> None:
    """Set ``wake`` when the calling script is interrupted, until ``stop_waking(wake)``."""
    global _watcher
    with _waiting_lock:
        _waiting.add(wake)
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="kinetic-interrupt-watch", daemon=True)
            _watcher.start()


def stop_waking(wake: threading.Event) -> None:
    with _waiting_lock:
        _waiting.discard(wake)


def wake_seconds() -> float:
    """How long a waiting call sleeps before it looks by itself."""
    return min(MAX_WAKE_SECONDS, WATCH_SECONDS * max(1.0, len(_waiting) / CALLS_PER_WAKE))


def _watch() -> None:
    global _watcher
    while True:
        with _waiting_lock:
            if not _waiting:
                _watcher = None
                return
            waiting = list(_waiting)
        if caller_interrupted():
            for wake in waiting:
                wake.set()
        time.sleep(WATCH_SECONDS)


# --------------------------------------------------------------------------- fail fast


def _is_failure(state: Any) -> bool:
    return state is not None and (state.is_failed() or state.is_crashed())


def fail_fast(futures: Iterable[Any], poll_seconds: float = 0.5) -> list[Any]:
    """The results of a sweep's futures (``task.map(...)`` or a list of ``task.submit(...)``), in order; at the
    first failure, the rest are stopped (their jobs stopped, their runs Cancelled) and that failure is raised.

    Calls not started yet are cancelled in the task runner; running calls have their job's run cancelled, which
    ends their task run Cancelled (never retried). Works on both submission paths.
    """
    from prefect.futures import as_completed

    futures = list(futures)
    for done in as_completed(futures):
        # wait() on a done future records the state the task runner returned; without it ``state`` is read from
        # the API, where the task run's final state can lag behind (a failed call still showed Retrying)
        done.wait()
        if _is_failure(done.state):
            stop_futures([f for f in futures if f is not done], poll_seconds=poll_seconds)
            return [done.result()]  # raises the failure
    return [future.result() for future in futures]


# Called by stop_futures with the task-run ids of the calls to stop and why, from the caller's thread: a call whose
# input waits in a sweep's slot (caller/slots.py) has no job run of its own to cancel.
STOP_HOOKS: list[Callable[[set[str], str], None]] = []


def stop_futures(
    futures: Iterable[Any],
    poll_seconds: float = 0.5,
    timeout: float = 120.0,
    reason: str = "fail_fast: another call of the sweep failed",
) -> None:
    """Stop the calls behind ``futures`` and wait until each has ended (its job stopped, its run Cancelled)."""
    from prefect.futures import wait

    futures = list(futures)
    for future in futures:
        wrapped = getattr(future, "wrapped_future", None)
        if wrapped is not None:
            wrapped.cancel()  # not started yet: never starts
    deadline = time.monotonic() + timeout
    while True:
        running = [f for f in futures if not _future_done(f)]
        if not running or time.monotonic() > deadline:
            return
        for hook in STOP_HOOKS:
            hook({str(f.task_run_id) for f in running}, reason)
        _cancel_job_runs([f.task_run_id for f in running], reason)
        wait(running, timeout=poll_seconds)


def _future_done(future: Any) -> bool:
    wrapped = getattr(future, "wrapped_future", None)
    return bool(wrapped.done() if wrapped is not None else future.state.is_final())


def _cancel_job_runs(task_run_ids: list[Any], reason: str) -> None:
    """Ask for every unfinished job run of these task runs to be stopped (the worker, or the in-process
    lifecycle, stops the job and ends the run Cancelled)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
        TaskRunFilterId,
    )
    from prefect.states import Cancelling

    from kinetic_prefect.contract import TRACKING_TASK_KEY_PREFIX

    wanted = {str(t) for t in task_run_ids}
    with get_client(sync_client=True) as client:
        callers = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=list(task_run_ids))))
        flow_runs = list({c.flow_run_id for c in callers if c.flow_run_id is not None})
        if not flow_runs:
            return
        siblings = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=flow_runs)), limit=None
        )
        trackers = [
            t.id
            for t in siblings
            if t.task_key.startswith(TRACKING_TASK_KEY_PREFIX)
            and any(str(getattr(p, "id", None)) in wanted for p in t.task_inputs.get("__parents__", []))
        ]
        if not trackers:
            return
        jobs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(any_=trackers))
        )
        for job in jobs:
            if job.state is not None and not job.state.is_final() and not job.state.is_cancelling():
                client.set_flow_run_state(job.id, Cancelling(message=reason), force=True)


__all__ = ["CallerStopped", "caller_interrupted", "fail_fast", "stop_futures"]
