"""Caller side: turn one call of a kinetic task into a job and bring its outcome back.

Runs inside the Prefect task run, so caching and retries stay Prefect's: a cache hit never
reaches this module, and whatever it raises (a remote exception, a crashed job) lets Prefect
retry, which calls it again and launches a new job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from anyio import to_thread
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from kinetic_prefect import signing
from kinetic_prefect.caller import _prefect, data_mounts, slots
from kinetic_prefect.caller.calls import KineticOptions, PreparedCall, prepare
from kinetic_prefect.caller.job_settings import build_job_variables, checked_pool
from kinetic_prefect.caller.outcomes import cancelled_result, collect, discard_interrupted_run, discard_run
from kinetic_prefect.caller.sweep_calls import sweep_of, wait_in_sweep
from kinetic_prefect.caller.uploads import upload_inputs
from kinetic_prefect.caller.waiting import wait_for_job
from kinetic_prefect.contract import JOB_CANNOT_START, Env
from kinetic_prefect.contract.layout import env_block
from kinetic_prefect.errors import FallbackPoolRefused, KineticJobCrashed, SigningKeyMissing
from kinetic_prefect.shared import capacity, gcp, key_blocks


async def submit_and_collect(
    options: KineticOptions, call: PreparedCall, task_name: str, fn: Callable[..., Any], detach: Any = None
) -> Any:
    """``_submit_and_wait``, and whatever way it ends without the job's outcome (a timeout or Ctrl-C at any
    point after the upload, a crashed job, an error creating the run), the run's objects are removed."""
    ctx = TaskRunContext.get()
    siblings = (ctx.task_run.flow_run_id if ctx else None, task_name)  # calls of a sweep count each other
    while True:
        try:
            with slots.calling(siblings):
                return await _submit_and_wait(options, call, task_name, fn, detach)
        except KineticJobCrashed as crashed:
            if call.store is not None and not call.outcome_read:
                await discard_interrupted_run(call.store, call)
            if not (options.pool_fallbacks and _placement_refused(crashed)):
                raise
            options = _next_pool(options, crashed)
        except BaseException:
            if call.store is not None and not call.outcome_read:
                await discard_interrupted_run(call.store, call)
            raise


def _placement_refused(crashed: KineticJobCrashed) -> bool:
    """The pool's worker could not place the job (no capacity, no node pool, a stockout or quota: the lifecycle
    ends such a run Crashed with ``JOB_CANNOT_START``), so it never ran: the next pool of the list may."""
    return JOB_CANNOT_START in str(crashed)


def _next_pool(options: KineticOptions, crashed: KineticJobCrashed) -> KineticOptions:
    following = options.on_next_pool()
    if TaskRunContext.get() is not None:
        get_run_logger().warning(
            f"Pool {options.work_pool!r} could not place the job ({crashed}): trying pool {following.work_pool!r} "
            f"with {capacity.join(following.accelerator_choices)}"
        )
    return following


async def _check_fallback_pools(client: Any, options: KineticOptions) -> None:
    """Every later pool of the fallback list, checked against its entries as the first pool is (it exists, its type
    runs them, the call's settings suit it) before anything is uploaded: not on the day the pools before it are
    stocked out."""
    later = options
    while later.pool_fallbacks:
        later = later.on_next_pool()
        try:
            await checked_pool(client, later)
        except (ValueError, LookupError) as refused:
            entries = ", ".join(f"{later.work_pool}/{capacity.label(spec)}" for spec in later.accelerator_choices)
            given = options.given.accelerator if options.given is not None else entries
            entry = "entries" if len(later.accelerator_choices) > 1 else "entry"
            raise FallbackPoolRefused(
                f"accelerator={given!r}: the fallback {entry} {entries} cannot run: {str(refused).rstrip('.')}. "
                f"Fix pool {later.work_pool!r} or drop the {entry}; nothing was uploaded or launched."
            ) from None


def _job_variables(
    options: KineticOptions,
    call: PreparedCall,
    store_url: str,
    pool_variables: set[str],
    budget: Any,
    fuse_mounts: Any,
    key: Any,
) -> dict[str, Any]:
    """The run's job variables: the call's, with its budget, its FUSE mounts and, where calls are signed, the flag
    that makes the job insist on signatures (not the key)."""
    job_variables = build_job_variables(options, call, store_url, pool_variables)
    if budget is not None:
        job_variables["max_cost_usd"] = budget
    if fuse_mounts:
        job_variables[data_mounts.FUSE_VARIABLE] = fuse_mounts
    if key is not None:
        job_variables["env"][signing.REQUIRED_ENV] = "1"
    return job_variables


def _submitted_line(run_name: str, flow_run: Any, pool: Any, polling: bool, options: KineticOptions) -> str:
    return (
        f"Job {run_name} ({flow_run.id}) on pool {pool.name!r} "
        f"[{'polling worker' if polling else 'in-process'}], accelerator "
        f"{capacity.join(options.accelerator_choices)}"
    )


async def _submit_and_wait(
    options: KineticOptions, call: PreparedCall, task_name: str, fn: Callable[..., Any], detach: Any = None
) -> Any:
    ctx = TaskRunContext.get()
    task_run = ctx.task_run if ctx else None
    logger = get_run_logger() if ctx else None
    async with _prefect.shared_client() as client:
        pool, budget = await checked_pool(client, options)
        await _check_fallback_pools(client, options)
        pool_variables = set(pool.base_job_template["variables"]["properties"])
        store_url = gcp.store_url(pool)
        store = call.store = gcp.open_store(store_url, await gcp.pool_credentials(pool))  # bad gcp_credentials: here
        key = await _prefect.signing_key()
        if refusal := _prefect.unsigned_refusal(store_url, key):  # before anything is uploaded or launched
            raise SigningKeyMissing(refusal)
        fuse_mounts = await to_thread.run_sync(data_mounts.plan, call, pool, pool_variables, store_url)
        await to_thread.run_sync(upload_inputs, store, call, logger, key)

        polling = options.submission == "worker" or (
            options.submission == "auto" and await _prefect.has_online_worker(client, pool.name)
        )
        attempt = task_run.run_count if task_run else 1
        run_name = f"{task_run.name}-job{attempt}" if task_run else f"{task_name}-job"
        job_variables = _job_variables(options, call, store_url, pool_variables, budget, fuse_mounts, key)
        sweep = sweep_of(options, call, client, store, pool, polling, job_variables, task_run, task_name, detach, key)
        if sweep is not None:
            return await wait_in_sweep(sweep, client, call, job_variables, key, run_name, fn, logger, task_run)
        block = None
        if polling and call.env:
            block = env_block(call.layout.run_id)
            job_variables["env"][Env.ENV_BLOCK] = await _prefect.store_secret_env(call.env, block)
        try:
            flow_run = await _prefect.create_job_flow_run(
                client,
                flow_name=task_name,
                run_name=run_name,
                pool=pool,
                job_variables=job_variables,
                caller=None if detach else task_run,  # a detached job is nobody's subflow: its submitter may end
                tags=[f"accelerator:{options.accelerator.name}", "kinetic", *getattr(detach, "tags", ())],
                for_polling_worker=polling,
                signing_key=key,
            )
            if detach is not None:  # kinetic_prefect.kinetic: hand the job over instead of waiting for it
                block = None  # its worker reads the block later; cleanup deletes it if none ever does
                return await detach.submitted(pool, flow_run, polling, call)
            if logger:
                logger.info(_submitted_line(run_name, flow_run, pool, polling, options))
            state = await wait_for_job(client, pool, flow_run, call, run_name, polling, options, logger)
        finally:  # the worker deletes the block it reads; one no worker read must not keep the call's secrets
            if block is not None:
                await key_blocks.delete_secret_env(block)
        if state is not None and state.is_cancelled():
            await to_thread.run_sync(discard_run, store, call, True)
            return await cancelled_result(client, task_run, run_name, state)
    return await collect(store, call, key, state, run_name, fn, logger, task_run)


def call_remotely(
    options: KineticOptions,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    task_name: str,
    detach: Any = None,
) -> Any:
    """Package, submit, wait, and return the job's value (or raise its exception). With ``detach`` (see
    kinetic_prefect.kinetic.detached), return what ``detach.submitted`` makes of the job's run once it exists."""
    call = prepare(options, fn, args, kwargs)  # PayloadError etc. before anything is stored
    return _prefect.run_interruptibly(submit_and_collect(options, call, task_name, fn, detach))


async def call_remotely_async(
    options: KineticOptions, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], task_name: str
) -> Any:
    """``call_remotely`` for an ``async def`` task: on the caller's event loop, which the wait never blocks
    (packaging runs in a thread, with the task run's context)."""
    import contextvars
    import functools

    packaging = functools.partial(contextvars.copy_context().run, prepare, options, fn, args, kwargs)
    call = await to_thread.run_sync(packaging)
    return await submit_and_collect(options, call, task_name, fn)


__all__ = ["call_remotely", "call_remotely_async"]
