"""Worker side: a job's run as a series of attempts (accelerator fallbacks, retries after a preemption).

The lifecycle follows one job; this module decides, from what the launcher reports, whether that job is replaced
by another attempt under the same flow run: the next accelerator of a fallback list while nothing has started,
or the same accelerator again after a preemption, from ``preemption_retries`` (which Prefect's ``retries`` never
see: the task run is not told about an attempt the infrastructure took away). Each attempt is an event
(``kinetic.job.fallback`` / ``kinetic.job.preempted``) and a log line; the run's final state message and the
store's capacity record (``RunLayout.capacity``) say which accelerator ran and what it took.
"""

from __future__ import annotations

from typing import Any

import anyio
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators
from kinetic_prefect.contract import EVENT_FALLBACK, EVENT_PREEMPTED, CapacityRecord, Env, Outcome, RunLayout
from kinetic_prefect.shared import capacity
from kinetic_prefect.workers.job_launcher import JobLauncher, JobStatus

# on_exit: the state is set already (the budget is spent): the lifecycle returns.
HANDLED = "handled"


def plan_for(configuration: Any, runs_here: bool) -> capacity.CapacityPlan:
    """The run's attempts: its fallback list, retries and waits, from the configuration; ``runs_here`` (the
    launcher's ability: jobs on the worker's own machine) lets an accelerator the machine lacks be run on the CPU."""
    names = list(getattr(configuration, "accelerator_choices", None) or [configuration.accelerator])
    # resolved once, when the configuration was prepared for the run; a bare configuration resolves its one name
    specs = list(getattr(configuration, "accelerator_specs", None) or [accelerators.resolve(configuration.accelerator)])
    if getattr(configuration, "spot", False):
        specs = [spec.with_spot() for spec in specs]
    retries = getattr(configuration, "preemption_retries", None)
    wait = getattr(configuration, "capacity_wait_seconds", None)
    provisioning = getattr(configuration, "provisioning_timeout_seconds", None)
    # the launcher may have chosen already (kinetic-local: the first accelerator this machine has)
    chosen = names.index(configuration.accelerator) if configuration.accelerator in names else 0
    # a job on this machine without the accelerator runs on the CPU, and says so (and is billed as cpu)
    instead_of = configuration.cpu_instead_of if runs_here else None
    if instead_of:
        specs[chosen] = accelerators.resolve("cpu")
    return capacity.CapacityPlan(
        specs,
        preemption_retries=capacity.DEFAULT_PREEMPTION_RETRIES if retries is None else int(retries),
        spot_fallback=bool(getattr(configuration, "spot_fallback", False)),
        index=chosen,
        capacity_wait_seconds=capacity.DEFAULT_CAPACITY_WAIT_SECONDS if wait is None else float(wait),
        provisioning_timeout_seconds=None if provisioning is None else float(provisioning),
        instead_of=instead_of or None,
    )


def attempt_env(plan: capacity.CapacityPlan) -> dict[str, str]:
    """What the job is told about this attempt: the accelerator it got (so the body can size its batch)."""
    spec = plan.current
    return {
        Env.ACCELERATOR: spec.name,
        Env.ACCELERATOR_CHIPS: str(capacity.chip_count(spec)),
        Env.PREEMPTIONS: str(plan.preemptions),
        "JAX_PLATFORMS": spec.jax_platform,
    }


def _can_relaunch(launcher: JobLauncher) -> bool:
    return launcher.can_relaunch


async def _relaunch(
    worker: Any, flow_run: FlowRun, configuration: Any, identifier: str, plan: capacity.CapacityPlan
) -> str:
    logger = worker.get_flow_run_logger(flow_run)
    configuration.env.update(attempt_env(plan))
    return await worker.launcher.relaunch(
        flow_run, configuration, identifier, plan.current, len(plan.attempts), logger.info
    )


async def on_pending(
    worker: Any,
    flow_run: FlowRun,
    configuration: Any,
    identifier: str,
    status: JobStatus,
    plan: capacity.CapacityPlan,
    waited_seconds: float,
) -> str | None:
    """The next accelerator's job when this one cannot be placed, else None (keep waiting, or time out)."""
    if not plan.has_fallback or not _can_relaunch(worker.launcher):
        return None
    tried = capacity.label(plan.current)
    # No capacity reason (a bad image or config, fatal or not) would fail the same way on every accelerator.
    # At the pod watch (or provisioning) timeout every wait is over, whatever it was set to.
    if status.fatal:
        waited_seconds = float("inf")
        scaling_up = float("inf") if status.capacity == capacity.SCALING_UP else 0.0
    else:
        scaling_up = min(status.scaling_up_seconds, waited_seconds)
    if plan.fallback_after(status.capacity, waited_seconds, scaling_up) is None:
        return None
    why = plan.attempts[-2].ended
    worker.get_flow_run_logger(flow_run).warning(
        f"Accelerator {tried} cannot be placed ({why}): falling back to {capacity.label(plan.current)} "
        f"(attempt {len(plan.attempts)} of {len(plan.specs)})"
    )
    worker.emit_job_event(
        flow_run,
        EVENT_FALLBACK,
        configuration,
        identifier=identifier,
        tried=tried,
        reason=why,
        next=capacity.label(plan.current),
        detail=status.detail,
    )
    return await _relaunch(worker, flow_run, configuration, identifier, plan)


async def _read_outcome(worker: Any, configuration: Any) -> Outcome | None:
    from kinetic_prefect import signing
    from kinetic_prefect.shared import key_blocks

    store = await worker.open_pool_store(configuration)
    layout = RunLayout(configuration.env[Env.RUN_ID])
    key = await key_blocks.signing_key()
    try:
        return Outcome.from_json(await anyio.to_thread.run_sync(signing.get, store, layout.outcome, key))
    except Exception:
        return None


def _terminated(outcome: Outcome | None) -> bool:
    return outcome is not None and (outcome.error_type or "").endswith(".JobTerminated")


def resumed_from(progress: dict | None, outcome: Outcome | None) -> str | None:
    """How far the preempted attempt had come: its last progress line (``done``), which is what it resumes from
    when it checkpoints as often as it reports; else how many checkpoint files the next attempt restored."""
    if progress and progress.get("done") is not None:
        return f"step {progress['done']:,.0f}"
    if outcome is not None and outcome.checkpoint_files_restored:
        return f"{outcome.checkpoint_files_restored} checkpoint file(s)"
    return None


async def on_exit(
    worker: Any,
    flow_run: FlowRun,
    configuration: Any,
    identifier: str,
    status: JobStatus,
    plan: capacity.CapacityPlan,
    progress: dict | None,
) -> str | None:
    """After the job ended: another attempt's identifier when it was preempted and the budget lasts; HANDLED when
    it was preempted once too often (the run is Crashed); None to finish from the outcome as usual."""
    outcome = await _read_outcome(worker, configuration)
    reason = status.preempted
    if (
        reason is None
        and getattr(worker.launcher, "outside_sigterm_is_preemption", False)
        and _terminated(outcome)
        and status.failed_host is None
    ):
        reason = "the job was stopped by a SIGTERM from outside the worker (the machine shutting down?)"
    if reason is None or (outcome is not None and outcome.completed):
        if plan.preemptions and plan.resumed is None:
            plan.resumed = resumed_from(None, outcome)
        await write_record(worker, flow_run, configuration, plan)
        return None
    if await worker.stop_reason(flow_run, True):
        return None  # cancelled meanwhile: the lifecycle's own path says so
    logger = worker.get_flow_run_logger(flow_run)
    plan.resumed = resumed_from(progress, outcome) or plan.resumed
    spec = plan.retry_after_preemption(reason)
    worker.emit_job_event(
        flow_run,
        EVENT_PREEMPTED,
        configuration,
        identifier=identifier,
        reason=reason,
        preemptions=plan.preemptions,
        budget=plan.preemption_retries,
        resumed_from=plan.resumed,
        next=capacity.label(spec) if spec else None,
    )
    await _discard_attempt(worker, configuration)
    if spec is None:
        await write_record(worker, flow_run, configuration, plan)
        await worker.mark_crashed(
            flow_run,
            f"Job {identifier} was preempted {plan.preemptions}× "
            f"(preemption_retries={plan.preemption_retries} spent): {reason}",
        )
        return HANDLED
    on_demand = " on on-demand capacity (spot_fallback)" if plan.on_demand and not spec.spot else ""
    logger.warning(
        f"Job {identifier} was preempted ({reason}): attempt {plan.preemptions + 1} on "
        f"{capacity.label(spec)}{on_demand}, resuming from {plan.resumed or 'its checkpoints'} "
        f"(preemption {plan.preemptions} of {plan.preemption_retries}; `retries` are not spent)"
    )
    return await _relaunch(worker, flow_run, configuration, identifier, plan)


async def _discard_attempt(worker: Any, configuration: Any) -> None:
    """The preempted attempt's record (JobTerminated) must not stand for the next attempt's."""
    from kinetic_prefect import signing

    store = await worker.open_pool_store(configuration)
    layout = RunLayout(configuration.env[Env.RUN_ID])
    for key in (layout.outcome, layout.result):
        await anyio.to_thread.run_sync(signing.delete, store, key)


async def write_record(worker: Any, flow_run: FlowRun, configuration: Any, plan: capacity.CapacityPlan) -> None:
    from kinetic_prefect import signing
    from kinetic_prefect.shared import key_blocks

    spec = plan.current
    resumed = plan.resumed if plan.preemptions else None
    record = CapacityRecord(
        accelerator=capacity.label(spec),
        chips=capacity.chip_count(spec),
        summary=plan.summary(),
        preemptions=plan.preemptions,
        resumed_from=resumed,
        attempts=[vars(a) for a in plan.attempts],
    )
    try:
        store = await worker.open_pool_store(configuration)
        key = await key_blocks.signing_key()
        layout = RunLayout(configuration.env[Env.RUN_ID])
        await anyio.to_thread.run_sync(signing.put, store, layout.capacity, record.to_json(), key)
    except Exception as exc:  # the record is a report: it never fails a job
        worker.get_flow_run_logger(flow_run).warning(f"Could not write the capacity record: {exc!r}")


def final_note(plan: capacity.CapacityPlan) -> str:
    """Appended to the run's final state message when the run took more than one attempt."""
    if not plan.eventful:
        return ""
    return f" ({plan.summary()})"
