"""Caller side, a call that joins a sweep (caller/slots.py): which calls a slot can carry, and one input's wait
for its outcome in a slot.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from anyio import to_thread

from kinetic_prefect import accelerators, signing
from kinetic_prefect.caller import _prefect, data_mounts, slots
from kinetic_prefect.caller.calls import KineticOptions, PreparedCall
from kinetic_prefect.caller.outcomes import cancelled_result, collect, discard_run
from kinetic_prefect.contract.launchers import SweepSlots
from kinetic_prefect.errors import KineticJobCrashed

SLOT_IDLE_SECONDS = 5.0  # a slot with nothing to take waits this long (or keep_warm_seconds) for a retry to rejoin


def pool_carries_slots(pool: Any, job_variables: dict[str, Any], keep_warm: float) -> bool:
    """Whether this pool's jobs can be a sweep's slots, as its launcher's abilities say (``sweep_slots``): always
    (kinetic-local: a slot is a process that lives as long as its sweep has inputs, so it needs no warm runners,
    which stay opt-in for single calls), or only with warm jobs (kinetic-gke: ``keep_warm_seconds > 0``, a slot
    being a pod that takes the sweep's inputs one after another). Never when the pool runs its own command in the
    runner's place (a slot swaps the runner module for the slot runner's)."""
    from kinetic_prefect.contract import RUNNER_MODULE

    try:
        slots_when = _prefect.abilities_of(pool.type).sweep_slots
    except _prefect.WorkPoolError:  # not a kinetic pool (or not installed here): no slots
        return False
    if slots_when is SweepSlots.NEVER or (slots_when is SweepSlots.WITH_WARM and keep_warm <= 0):
        return False
    command = job_variables.get("command", _prefect.pool_default(pool, "command"))
    return not command or RUNNER_MODULE in str(command)


def sweep_of(
    options: KineticOptions,
    call: PreparedCall,
    client: Any,
    store: Any,
    pool: Any,
    polling: bool,
    job_variables: dict[str, Any],
    task_run: Any,
    task_name: str,
    detach: Any,
    signing_key: signing.KeyLike,
) -> Any:
    """The sweep this call's input joins (caller/slots.py), or None for a job run of its own: a call with no
    concurrent sibling, or one a slot cannot carry (a pool that cannot, a group, a fallback list, a budget, debug,
    FUSE mounts, secret env values, another loop than the shared one)."""
    from prefect._internal.concurrency.threads import get_run_sync_loop

    keep_warm = float(job_variables.get("keep_warm_seconds", _prefect.pool_default(pool, "keep_warm_seconds")) or 0)
    carried = (
        detach is None
        and task_run is not None
        and pool_carries_slots(pool, job_variables, keep_warm)
        and not options.fallbacks
        and not options.debug
        and not call.env
        and accelerators.host_count(options.accelerator, job_variables.get("hosts", options.hosts)) == 1
        and "max_cost_usd" not in job_variables
        and data_mounts.FUSE_VARIABLE not in job_variables
        and getattr(get_run_sync_loop(), "_loop", None) is asyncio.get_running_loop()
    )
    # A run_async_map batch's input (kinetic.batch_inputs) is a fan-out's by construction, however its task runs
    # start: it joins the sweep alone too, and the sweep waits for the batch's late inputs as its slots do.
    if not carried or not slots.slot_count(pool):
        return None
    if not call.kept_for_batch and not slots.has_siblings((task_run.flow_run_id, task_name)):
        return None
    idle_seconds = max(keep_warm, SLOT_IDLE_SECONDS)
    shared, _ = slots.split_variables(job_variables)
    key = (task_run.flow_run_id, task_name, pool.name, polling, json.dumps(shared, sort_keys=True, default=str))
    return slots.sweep_for(
        key,
        lambda: slots.Sweep(
            key,
            client,
            store,
            pool,
            polling,
            shared,
            task_name,
            idle_seconds=idle_seconds,
            signing_key=signing_key,
            close_grace=idle_seconds if call.kept_for_batch else slots.CLOSE_GRACE_SECONDS,
        ),
    )


async def wait_in_sweep(
    sweep: Any,
    client: Any,
    call: PreparedCall,
    job_variables: dict[str, Any],
    key: signing.KeyLike,
    run_name: str,
    fn: Any,
    logger: Any,
    task_run: Any,
) -> Any:
    """One input of a sweep: queued, taken by a slot, and its outcome read as a single call's is. Its slot's run
    cancelled: Cancelled (not retried); its slot gone without its outcome (killed, failed): a crash, retried."""
    from prefect.states import Cancelled

    _, per_call = slots.split_variables(job_variables)
    if logger:
        logger.info(f"Input {run_name} queued in sweep {sweep.keys.sweep_id} (slot jobs of {sweep.task_name!r})")
    how, detail = await sweep.run_input(call.layout.run_id, per_call, task_run, run_name)
    slot = detail.get("slot") if isinstance(detail, dict) else None
    if how == "done" and detail.get("refused"):
        from kinetic_prefect.errors import StoreTampered

        raise StoreTampered(f"slot job of input {run_name} refused its queued record: {detail['refused']}")
    if how == "done":
        await sweep.forward_log(call.layout.run_id, logger)
        if not detail.get("stopped"):
            return await collect(call.store, call, key, None, run_name, fn, logger, task_run)
        state = await sweep.slot_final(slot)
        slot = sweep.every_slot[slot].name if slot in sweep.every_slot else slot
    else:  # withdrawn if no slot took it, else stopped where it runs: never run by a slot and by a retry
        await sweep.stop_input(call.layout.run_id)
        state = Cancelled(message=str(detail)) if how == "cancelled" else detail["state"]
    if state is not None and state.is_cancelled():
        await to_thread.run_sync(discard_run, call.store, call, True)
        return await cancelled_result(client, task_run, run_name, state)
    what = f"{state.name}: {state.message}" if state is not None else "no final state"
    raise KineticJobCrashed(f"slot job {slot} ended ({what}) before input {run_name} had an outcome")
