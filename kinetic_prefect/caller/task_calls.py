"""Caller side: what calling a kinetic task hands back, for sync and ``async def`` bodies alike.

A cancelled job ends its task run Cancelled by returning a Cancelled state (Prefect never retries a
Cancelled task run, so ``retries=`` cannot undo a cancel). Prefect hands a returned state to the caller
as the call's *value*; the code after the call would then carry on with a ``State`` in hand and the flow
would end Completed. So the call raises ``KineticJobCancelled`` instead, as reading the result of a
cancelled Prefect task raises; a flow that does not catch it does not complete.

When the cancel came from the calling flow run itself (cancelled in the UI while the call waited), the flow
must end Cancelled, not Failed: the call raises ``FlowRunCancelled``, a Prefect ``Abort`` (what the engine
raises when the API tells a run to stop), so the flow engine keeps the run's Cancelled state and the flow's
own code does not carry on, as it would not under a worker that stops the flow's process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from prefect.exceptions import Abort

from kinetic_prefect.caller import capacity_report
from kinetic_prefect.errors import KineticJobCancelled


class FlowRunCancelled(Abort):
    """The calling flow run was cancelled while a kinetic call waited: its job is stopped and the flow run
    ends Cancelled. A ``BaseException`` (Prefect's ``Abort``), so ``except Exception`` in the flow does not
    swallow the cancel."""

    def __init__(self, message: str, state: Any = None):
        super().__init__(message)
        self.state = state  # the flow engine keeps this as the run's final state


def _calling_flow_run_state() -> Any:
    """The calling flow run's state as the API has it now (None outside a flow run or if unreadable)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(context.flow_run.id).state
    except Exception:  # the cancel is reported either way; only its kind depends on this read
        return None


def raise_if_cancelled(value: Any) -> Any:
    """``value``, unless it is the Cancelled state of a cancelled job: then that job's error is raised, or
    ``FlowRunCancelled`` where the calling flow run was cancelled. A Completed state that carries a run's capacity
    summary to the task run (``capacity_report.completed``) gives its value."""
    from prefect.states import State

    value = capacity_report.carried_value(value)

    if isinstance(value, State) and value.is_cancelled():
        message = value.message or "The job was cancelled"
        parent = _calling_flow_run_state()
        if parent is not None and (parent.is_cancelled() or parent.is_cancelling()):
            raise FlowRunCancelled(message, state=parent)
        raise KineticJobCancelled(message)
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


__all__ = ["FlowRunCancelled", "checked_call", "raise_if_cancelled", "remote_body"]
