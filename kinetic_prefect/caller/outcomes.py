"""Caller side, a call's end: the job's outcome read (verified before anything unpickles it), its value returned or
its exception raised, its outputs listed, a cancelled job's task run ended Cancelled, and the run's objects
discarded.
"""

from __future__ import annotations

import contextlib
from typing import Any

import cloudpickle
from anyio import to_thread
from prefect.context import TaskRunContext

from kinetic_prefect import signing
from kinetic_prefect.caller import _prefect
from kinetic_prefect.caller.calls import PreparedCall
from kinetic_prefect.caller.data_repair import heal_reported
from kinetic_prefect.caller.remote_errors import raise_remote
from kinetic_prefect.caller.uploads import forget_broken_code
from kinetic_prefect.contract import OUTPUTS_ARTIFACT_KEY, Outcome, checkpoints_key
from kinetic_prefect.contract.names import KEY_MISMATCH_STATE
from kinetic_prefect.errors import KineticJobCrashed, SigningKeyMismatch
from kinetic_prefect.shared.outages import Outage


async def _publish_outputs(store: Any, call: PreparedCall, outcome: Outcome, run_name: str) -> None:
    """A table artifact on the task run listing what the job left in KINETIC_OUTPUT_DIR."""
    if not outcome.outputs or TaskRunContext.get() is None:
        return
    from prefect.artifacts import acreate_table_artifact

    rows = [{"file": rel, "url": store.url_for(call.layout.output(rel))} for rel in outcome.outputs]
    await Outage(f"the caller of {run_name}").call(
        lambda: acreate_table_artifact(
            rows, key=OUTPUTS_ARTIFACT_KEY, description=f"Outputs of kinetic job {run_name} ({outcome.status})"
        ),
        "listing the job's outputs",
    )


async def collect(
    store: Any, call: PreparedCall, key: signing.KeyLike, state: Any, run_name: str, fn: Any, logger: Any, task_run: Any
) -> Any:
    """The job's outcome read: its value returned, or its exception raised (a missing outcome: a crash)."""
    from kinetic_prefect.storage import ObjectNotFound

    try:
        outcome = Outcome.from_json(read_signed(store, call.layout.outcome, key))
        call.outcome_read = True
    except ObjectNotFound:
        message = state.message if state is not None else "no state"
        if state is not None and state.name == KEY_MISMATCH_STATE:  # the worker's key differs: retrying cannot help
            raise SigningKeyMismatch(f"job {run_name}: {message}") from None
        raise KineticJobCrashed(
            f"job {run_name} ended without an outcome ({state.name if state else '?'}: {message})"
        ) from None
    await _publish_outputs(store, call, outcome, run_name)
    from kinetic_prefect.caller import capacity_report

    record = await capacity_report.publish(store, call.layout, key, run_name, logger, task_run)
    try:
        if outcome.completed:
            return capacity_report.completed(cloudpickle.loads(read_signed(store, call.layout.result, key)), record)
        try:
            blob = read_signed(store, call.layout.result, key)
        except ObjectNotFound:
            blob = None
        await to_thread.run_sync(forget_broken_code, store, call, outcome)
        await to_thread.run_sync(heal_reported, store, call.data, outcome)
        raise_remote(outcome, blob, run_name, fn)
    finally:
        if not call.kept_for_batch:  # a batch input's BatchHandle collects (and then deletes) it
            await to_thread.run_sync(discard_run, store, call)


def read_signed(store: Any, object_key: str, key: signing.KeyLike) -> bytes:
    """Read a store object the job wrote, verified before anything unpickles it."""
    from kinetic_prefect.errors import SigningKeyMismatch, StoreTampered

    try:
        return signing.get(store, object_key, key)
    except signing.KeyMismatch as exc:
        raise SigningKeyMismatch(str(exc)) from None
    except signing.TamperedObject as exc:
        raise StoreTampered(str(exc)) from None


def discard_run(store: Any, call: PreparedCall, entirely: bool = False) -> None:
    """Collected: the payload and the pickled result are not needed any more; the small outcome record stays as
    the job's receipt. ``entirely`` (a cancelled, interrupted or crashed call: nothing to collect): the outcome
    goes too, so calls that end badly do not grow the store. Outputs and checkpoints stay."""
    for object_key in (call.layout.payload, call.layout.result):
        signing.delete(store, object_key)  # never raises: cleanup must not turn a result into a failure
    if not entirely:
        return
    with contextlib.suppress(Exception):
        store.delete_prefix(call.layout.prefix + "/")
    # A job stopped while it started may not have removed its checkpoint folder; an empty one is only clutter.
    checkpoint_dir = store.local_path(checkpoints_key(call.task_run_id or call.layout.run_id))
    if checkpoint_dir is not None:
        with contextlib.suppress(OSError):  # only when empty: what a job saved is kept for the retry
            checkpoint_dir.rmdir()


async def discard_interrupted_run(store: Any, call: PreparedCall) -> None:
    """The call ends without an outcome: the job is stopped by now (in-process) or was asked to stop and waited
    for (polling worker), or it crashed; its payload and whatever it wrote are removed, shielded from a
    cancellation that is unwinding this call. What a job still writes after that is for `kinetic-prefect cleanup`."""
    import anyio

    with anyio.CancelScope(shield=True):
        await to_thread.run_sync(discard_run, store, call, True)


async def cancelled_result(client: Any, task_run: Any, run_name: str, state: Any) -> Any:
    """A cancelled job ends its task run Cancelled (returned as a state: Prefect does not retry it,
    so a cancel is never undone by ``retries=``). Without a task run, it raises."""
    from prefect.states import Cancelled
    from prefect.transactions import get_transaction

    from kinetic_prefect.errors import KineticJobCancelled

    message = f"Job {run_name} was cancelled: {state.message or 'on request'}"
    if task_run is None:
        raise KineticJobCancelled(message)
    transaction = get_transaction()
    if transaction is not None:
        transaction.write_on_commit = False  # a cancelled call must not become a cache hit
    await _prefect.finish_cancelled_parent(client, task_run)
    return Cancelled(message=message, data=KineticJobCancelled(message))  # raised by task_calls, and by .result()
