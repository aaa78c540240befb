"""Caller side: what calling a kinetic task hands back, for sync and ``async def`` bodies alike.

A cancelled job ends its task run Cancelled by returning a Cancelled state (Prefect never retries a
Cancelled task run, so ``retries=`` cannot undo a cancel). Prefect hands a returned state to the caller
as the call's *value*; the code after the call would then carry on with a ``State`` in hand and the flow
would end Completed. So the call raises ``KineticJobCancelled`` instead, as reading the result of a
cancelled Prefect task raises; a flow that does not catch it does not complete.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from kinetic_prefect.errors import KineticJobCancelled


def raise_if_cancelled(value: Any) -> Any:
    """``value``, unless it is the Cancelled state of a cancelled job: then that job's error is raised."""
    from prefect.states import State

    if isinstance(value, State) and value.is_cancelled():
        raise KineticJobCancelled(value.message or "The job was cancelled")
    return value


def checked_call(value: Any, return_state: bool) -> Any:
    """What ``KineticTask.__call__`` returns for Prefect's return ``value`` (a coroutine for an async task)."""
    if return_state:
        return value
    if inspect.isawaitable(value):
        return _awaited_and_checked(value)
    return raise_if_cancelled(value)


async def _awaited_and_checked(awaitable: Any) -> Any:
    return raise_if_cancelled(await awaitable)


def remote_body(
    fn: Callable[..., Any], launch: Callable[..., Any], launch_async: Callable[..., Any]
) -> Callable[..., Any]:
    """The Task's fn, with ``fn``'s signature and source identity; calling it launches a job.

    An ``async def`` function gets an ``async def`` body, so Prefect treats the task as async (the call is
    awaitable, ``.submit()`` works in an async flow) and the wait for the job runs on the flow's event loop
    without blocking it.
    """
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_as_job_async(*args: Any, **kwargs: Any) -> Any:
            return await launch_async(args, kwargs)

        return run_as_job_async

    @functools.wraps(fn)
    def run_as_job(*args: Any, **kwargs: Any) -> Any:
        return launch(args, kwargs)

    return run_as_job


__all__ = ["checked_call", "raise_if_cancelled", "remote_body"]
