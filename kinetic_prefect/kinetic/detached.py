"""The submission behind ``.run_async()``: ``submit_detached``.

A detached job is submitted by the one code path every call takes (``caller.submission.call_remotely``) but is
nobody's subflow: no task run waits for it, so a worker never stops it because its submitter ended. It needs
someone to launch it:

* a **polling worker** online for the pool (``prefect worker start --type kinetic-local --pool NAME``): the job
  outlives the script that submitted it;
* otherwise the submitting process runs it itself, in a background thread (in-process submission), and says
  so once: the job is then bound to that process (Python waits for it at exit; killed, the job stops itself).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.contract import (
    DETACHED_TAG,
)
from kinetic_prefect.kinetic.jobs import JobHandle

_warned_in_process: set[str] = set()


@dataclass
class Detach:
    """What ``caller.submission`` does once a detached job's run exists (``detach.submitted``): return a handle,
    and when no worker polls the pool, run the job in this process, in a background thread."""

    tags: tuple[str, ...] = (DETACHED_TAG,)
    fn: Callable[..., Any] | None = None

    async def submitted(self, pool: Any, flow_run: Any, polling: bool, call: Any) -> JobHandle:
        from prefect import get_client

        async with get_client() as client:
            handle = await JobHandle.from_flow_run(client, flow_run)
        handle.keep_source(self.fn)
        if not polling:
            if pool.name not in _warned_in_process:
                _warned_in_process.add(pool.name)
                warnings.warn(
                    f"kinetic-prefect: no worker polls pool {pool.name!r}, so detached jobs run inside this process: "
                    "Python waits for them at exit, and a job whose process is killed stops itself. For jobs that "
                    f"outlive their script, start one: `prefect worker start --type {pool.type} --pool {pool.name}` "
                    "(with a Prefect server that outlives the script too: `prefect server start`).",
                    stacklevel=2,
                )
            handle.run_in_this_process(
                threading.Thread(
                    target=_run_in_process_thread, args=(pool, flow_run, call.env), name=f"kinetic-job-{flow_run.id}"
                )
            )
        return handle


def _run_in_process_thread(pool: Any, flow_run: Any, secret_env: dict[str, str]) -> None:
    import asyncio

    from prefect import get_client

    from kinetic_prefect.caller import _prefect

    async def run() -> None:
        async with get_client() as client:
            await _prefect.run_in_process(client, pool, flow_run, secret_env=secret_env)

    try:
        asyncio.run(run())
    except BaseException as exc:  # the run's state says what happened; this only keeps the thread quiet
        print(f"kinetic-prefect: in-process job {flow_run.id} stopped: {type(exc).__name__}: {exc}", file=sys.stderr)


def submit_detached(
    options: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    task_name: str,
    tags: tuple[str, ...] = (),
    source_fn: Callable[..., Any] | None = None,
) -> JobHandle:
    """Submit one call as a detached job through the same path as every call (``caller.submission.call_remotely``)."""
    from kinetic_prefect.caller.submission import call_remotely

    detach = Detach(tags=(DETACHED_TAG, *tags), fn=source_fn or fn)
    return call_remotely(options, fn, args, kwargs, task_name, detach=detach)


__all__ = ["submit_detached"]
