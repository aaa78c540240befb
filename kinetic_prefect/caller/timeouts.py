"""Caller side: why a call stopped waiting for its job, in the words its job run's state and the task run's log give.

Prefect's ``timeout_seconds`` counts from the task run's start, so it covers packaging, the upload of the inputs
and the job's start-up (an image build, a machine coming up) as well as the job's own run; a user who sized it for
the function alone is told so, with the figure, where the UI shows why the job stopped.
"""

from __future__ import annotations

import datetime

# What a caller says when it stopped waiting for another reason (an interrupt, an error of its own).
STOPPED_WAITING = "The calling task stopped waiting (timeout, interrupt or error in the caller)"

# A cancel that lands this close to the limit is the timeout's (the clock starts when the task run turns Running,
# a moment before Prefect starts its own).
_SLACK_SECONDS = 0.5


def timed_out_reason() -> str | None:
    """What ran out, when the calling task run's ``timeout_seconds`` has passed; None otherwise (or outside one)."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    if ctx is None:
        return None
    limit, state = getattr(ctx.task, "timeout_seconds", None), ctx.task_run.state
    if not limit or state is None or not state.is_running() or state.timestamp is None:
        return None
    elapsed = (datetime.datetime.now(datetime.UTC) - state.timestamp).total_seconds()
    if elapsed < limit - _SLACK_SECONDS:
        return None
    return (
        f"timeout_seconds={limit:g} of task {ctx.task.name!r} ran out after {elapsed:.1f} s, so the job was stopped. "
        "It counts from the task's start: the upload of the inputs and the job's start-up (image, machine) used it "
        "too, not only the job's run; raise timeout_seconds to leave room for them"
    )


def stopped_waiting_reason(default: str = STOPPED_WAITING) -> str:
    """The job run's final message when its caller stopped waiting: the timeout named where it was that."""
    return timed_out_reason() or default


__all__ = ["STOPPED_WAITING", "stopped_waiting_reason", "timed_out_reason"]
