"""Caller side: what the worker's capacity record (``RunLayout.capacity``) tells the task run.

Every call logs the accelerator that ran. A call that took more than one attempt (a fallback, a preemption) also
gets a table artifact on its task run, one row per attempt, and its Completed state carries the summary
("ran on l4x4; after a100x4 (no node pool has it); preempted 2×, resumed from step 1,200").
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

from anyio import to_thread

from kinetic_prefect import signing
from kinetic_prefect.contract import CapacityRecord, RunLayout


def _read(store: Any, layout: RunLayout, key: signing.KeyLike) -> CapacityRecord | None:
    try:
        return CapacityRecord.from_json(signing.get(store, layout.capacity, key))
    except Exception:  # none (an older worker), unreadable or tampered: the call's value does not depend on it
        return None


async def publish(
    store: Any, layout: RunLayout, key: signing.KeyLike, run_name: str, logger: Any, task_run: Any
) -> CapacityRecord | None:
    record = await to_thread.run_sync(_read, store, layout, key)
    if record is None:
        return None
    if logger:
        logger.info(f"Job {run_name} {record.summary}")
    if task_run is not None and (record.preemptions or len(record.attempts) > 1):
        from prefect.artifacts import acreate_table_artifact

        rows = [
            {
                "attempt": i + 1,
                "accelerator": a.get("accelerator"),
                "spot": a.get("spot"),
                "ended": a.get("ended") or ("ran" if i == len(record.attempts) - 1 else ""),
            }
            for i, a in enumerate(record.attempts)
        ]
        with contextlib.suppress(Exception):  # a report: never fails the call
            await acreate_table_artifact(
                rows, key=None, description=f"Capacity of kinetic job {run_name}: {record.summary}"
            )
    return record


# The Completed states made here, until the call that returns one unwraps it (``carried_value``). A task body that
# returns a State makes it the task run's final state, which is how the summary reaches the UI; but Prefect then
# hands that State to a plain call instead of the value. Held strongly, so an id is not reused while listed; the
# states a future collects (``.submit()``, ``.map()``) are never unwrapped here, so the oldest are let go.
_SUMMARY_STATES: OrderedDict[int, Any] = OrderedDict()
_SUMMARY_STATES_KEPT = 1024
_summary_lock = threading.Lock()


def completed(value: Any, record: CapacityRecord | None) -> Any:
    """The task's return: the value itself, or (after fallbacks or preemptions) a Completed state that carries
    it with the summary as its message, so the task run itself shows what the run took."""
    if record is None or not (record.preemptions or len(record.attempts) > 1):
        return value
    from prefect.context import TaskRunContext
    from prefect.states import Completed, State

    if TaskRunContext.get() is None or isinstance(value, State):
        return value
    state: State = Completed(data=value, message=record.summary)
    with _summary_lock:
        _SUMMARY_STATES[id(state)] = state
        while len(_SUMMARY_STATES) > _SUMMARY_STATES_KEPT:
            _SUMMARY_STATES.popitem(last=False)
    return state


def carried_value(returned: Any) -> Any:
    """What a plain call returns for Prefect's return value: the value inside a state made by ``completed``, else
    ``returned`` unchanged (a State the user's own function returned stays Prefect's business)."""
    with _summary_lock:
        # ``is not None`` first: ``pop``'s default is None, so a task that returns None would match itself.
        made_here = returned is not None and _SUMMARY_STATES.pop(id(returned), None) is returned
    return returned.result() if made_here else returned
