"""Caller side, waiting for a call's job run: followed while a polling worker runs it (its output printed), or run
here by the pool's worker; taken back from a pool whose workers died; cancelled when the caller stops waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

from kinetic_prefect.caller import _prefect, timeouts
from kinetic_prefect.caller.calls import KineticOptions, PreparedCall
from kinetic_prefect.shared.outages import Outage


async def wait_for_job(
    client: Any,
    pool: Any,
    flow_run: Any,
    call: PreparedCall,
    run_name: str,
    polling: bool,
    options: KineticOptions,
    logger: Any,
) -> Any:
    """The job run's final state: followed while a polling worker runs it, or run here by the pool's worker.
    A caller that stops waiting (timeout, interrupt, error) stops the job, or cancels its run if it never
    started."""
    slot_taken = False
    try:
        if polling and options.submission == "auto" and await _taken_back_from_a_dead_pool(client, pool, flow_run):
            polling = False  # no worker is left to claim it: this process runs it, as with no worker at all
            if logger:
                logger.warning(
                    f"Job {run_name}: no worker of pool {pool.name!r} is online any more (Prefect shows it "
                    "offline) and none claimed the job, so it runs in this process (submission='auto')"
                )
        if polling:
            return await _prefect.wait_for_final_state(
                client, flow_run.id, on_log=lambda text: _print_job_output(run_name, text)
            )
        async with _prefect.in_process_slots():
            slot_taken = True
            await _prefect.run_in_process(client, pool, flow_run, secret_env=call.env)
        return (
            await Outage(f"the caller of {run_name}").call(
                lambda: _prefect.read_flow_run_batched(client, flow_run.id), "reading the job's final state"
            )
        ).state
    except BaseException:
        if logger and (timed_out := timeouts.timed_out_reason()):
            logger.error(f"Job {run_name}: {timed_out}")
        if not polling and not slot_taken:  # still queued for a slot: its run is Pending, and nobody's
            await _cancel_queued(client, flow_run.id)
        elif polling:  # the worker stops the job; shielded: this task is being cancelled itself
            await _prefect.cancel_flow_run(
                client,
                flow_run.id,
                timeouts.stopped_waiting_reason(),
                wait_seconds=20,
            )
        else:  # stopped before the in-process worker followed the job: its run must not stay Pending
            await _cancel_if_not_final(client, flow_run.id)
        raise


# How often a caller whose job run waits for a worker asks whether any worker of the pool is still online. A worker
# killed with SIGKILL reads ONLINE until Prefect's offline horizon (3 heartbeats, 90 s by default) has passed.
UNCLAIMED_CHECK_SECONDS = 2.0


async def _taken_back_from_a_dead_pool(client: Any, pool: Any, flow_run: Any) -> bool:
    """Wait until a worker claims the job run (False), or until the pool has no online worker while the run still
    waits: then take it back for this process by proposing Pending, as a worker would (True). The proposal is
    orchestrated, so a worker that claimed it meanwhile wins and this process goes on waiting for it."""
    from prefect.exceptions import Abort
    from prefect.states import Pending
    from prefect.utilities.engine import propose_state

    outage = Outage("the caller waiting for a worker to claim its job")
    while True:
        current = await outage.call(
            lambda: _prefect.read_flow_run_batched(client, flow_run.id), "reading the job's state"
        )
        if current.state is None or not current.state.is_scheduled():
            return False
        if not await outage.call(
            lambda: _prefect.has_online_worker(client, pool.name),
            "reading the pool's workers",  # one read per 2 s for a whole sweep
        ):
            try:
                await propose_state(client, Pending(message="taken back by its caller"), flow_run_id=flow_run.id)
            except Abort:
                return False
            return True
        await asyncio.sleep(UNCLAIMED_CHECK_SECONDS)


def _print_job_output(run_name: str, text: str) -> None:
    print("\n".join(f"[{run_name}] {line}" for line in text.splitlines()), file=sys.stderr, flush=True)


async def _cancel_if_not_final(client: Any, flow_run_id: Any) -> None:
    import anyio
    from prefect.states import Cancelled

    with anyio.CancelScope(shield=True):
        try:
            current = await client.read_flow_run(flow_run_id)
            if current.state is None or not current.state.is_final():
                await client.set_flow_run_state(
                    flow_run_id,
                    Cancelled(message=timeouts.stopped_waiting_reason()),
                    force=True,
                )
        except Exception:  # best effort while the caller is already failing
            pass


async def _cancel_queued(client: Any, flow_run_id: Any) -> None:
    """The run of a call stopped while it queued for an in-process slot: Cancelled in one write (no read first; a
    1,000-input sweep stopped by Ctrl-C has nearly all its calls queued, and each cost the server two requests)."""
    import anyio
    from prefect.states import Cancelled

    # best effort while the caller is already failing
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await client.set_flow_run_state(
            flow_run_id,
            Cancelled(
                message=timeouts.stopped_waiting_reason(
                    "The calling task stopped waiting before its job started (timeout, interrupt)"
                )
            ),
            force=True,
        )
