"""Worker side: one lifecycle for every kinetic launcher.

A kinetic job does not run Prefect's flow engine (the runner imports no Prefect), so the worker
owns the job's flow run from start to end, and this module is the only place that moves it:

    Pending ──submit──▶ Running ──outcome──▶ Completed | Failed
                           │ no outcome (killed, OOM, pod lost, cannot schedule) ──▶ Crashed
                           │ cancel asked (the run, its parent flow run, or the caller gone) ──▶ Cancelled

A launcher (``LocalJobLauncher``, ``GKEJobLauncher``) only knows how to submit, find, inspect,
stream, stop and clean up *its* kind of job; it never sets a state. ``KineticWorker.run``
returns status 0 once it has set a final state itself, so Prefect's BaseWorker never adds a
second Crashed of its own.

Who stops a job, on every way out:

* the run (or its parent flow run) is cancelled in Prefect: the worker following it stops the
  job and marks the run Cancelled;
* the caller stops waiting (task timeout, Ctrl-C, SIGTERM): in-process, the follow loop is
  cancelled and stops the job itself; with a polling worker the caller asks for cancellation and
  the worker does the rest;
* the calling process dies (in-process on kinetic-local): the job notices its owner is gone,
  cancels its own run and stops (runner ``watch_owner``);
* the polling worker dies: the job goes on; a restarted worker reattaches (``reattach``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun, WorkPool
from prefect.exceptions import Abort, ObjectNotFound
from prefect.states import Cancelled, Completed, Crashed, Failed, Running, State
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseWorkerResult

from kinetic_prefect import signing
from kinetic_prefect.contract import (
    EVENT_DIAGNOSIS,
    EVENT_EXITED,
    EVENT_UNSCHEDULABLE,
    JOB_CANNOT_START,
    JOB_EVENT_PREFIX,
    LOG_END_MARKER,
    PROGRESS_ARTIFACT_KEY,
    Env,
    Outcome,
    RunLayout,
)
from kinetic_prefect.contract.launchers import LauncherAbilities
from kinetic_prefect.contract.names import KEY_MISMATCH_STATE
from kinetic_prefect.shared import key_blocks, prefect_runs
from kinetic_prefect.shared.outages import Outage
from kinetic_prefect.workers.base import open_job_store
from kinetic_prefect.workers.job_launcher import JobLauncher, JobStatus

# A read that fails for a reason that may pass (a 5xx, a dropped connection) is retried for as long as an
# API outage is waited out (outages.outage_horizon_seconds) before the job is given up as crashed.
# The job's own process is checked every poll; Prefect (a cancel of the run, of its parent) less often:
# those reads are API calls, and a fan-out of many jobs would otherwise spend the API on them.
RUN_CHECK_SECONDS = 1.0
PARENT_CHECK_SECONDS = 2.0
CANCEL_GRACE_SECONDS = 10.0


class KineticWorkerResult(BaseWorkerResult):
    """``status_code`` 0: the worker set the run's final state itself."""


class ProgressArtifact:
    """Turns the job's progress lines into one Prefect progress artifact on the job's run.

    ``wrap`` filters the lines as they are forwarded (a progress line becomes a readable log line);
    ``publish`` creates or updates the artifact with the latest value, from the follow loop.
    """

    def __init__(self, client: Any, flow_run: FlowRun, publish_from_threads: bool = False):
        self.client, self.flow_run = client, flow_run
        self.latest: dict | None = None
        self.published: dict | None = None
        self.artifact_id: Any = None
        # Environment and image builds run in worker threads for minutes: publish from there as they go.
        self.publish_from_threads = publish_from_threads

    def wrap(self, emit: Callable[[str], None]) -> Callable[[str], None]:
        from kinetic_prefect.pod.progress import parse

        def filtered(text: str) -> None:
            kept = []
            for line in text.split("\n"):
                record = parse(line)
                if record is None:
                    kept.append(line)
                    continue
                self.latest = record
                kept.append(
                    f"progress {record['percent']:.0f}%" + (f": {record['message']}" if record["message"] else "")
                )
                if self.publish_from_threads:
                    # RuntimeError: on the event loop's own thread, published after the step
                    with contextlib.suppress(RuntimeError):
                        anyio.from_thread.run(self.publish)
            emit("\n".join(kept))

        return filtered

    async def publish(self) -> None:
        if self.latest is None or self.latest is self.published:
            return
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        record = self.latest
        done = record["message"] or f"{record['done']:g} of {record['total']:g}"
        description = f"Progress of kinetic job {self.flow_run.name}: {done}"
        try:
            if self.artifact_id is None:
                artifact = await self.client.create_artifact(
                    ArtifactCreate(
                        key=PROGRESS_ARTIFACT_KEY,
                        type="progress",
                        data=record["percent"],
                        description=description,
                        flow_run_id=self.flow_run.id,
                    )
                )
                self.artifact_id = artifact.id
            else:
                await self.client.update_artifact(
                    self.artifact_id, ArtifactUpdate(data=record["percent"], description=description)
                )
            self.published = record
        except Exception:  # progress is a nicety: it never fails a job
            pass


class CancelRequested(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BudgetReached(CancelRequested):
    """The job's metered cost reached its ``max_cost_usd``: stopped like a cancel, but its run ends Failed."""


# What one look at a followed job leads to (KineticWorker._on_status).
_FOLLOWED = "followed"  # the run's final state is set
_MOVED = "moved"  # the job moved to a new attempt, looked at at once


@dataclass
class FollowedJob:
    """One job as ``KineticWorker.follow`` follows it: what each look reads and moves on."""

    flow_run: FlowRun
    configuration: Any
    identifier: str  # the current attempt's job (a retry or a fallback moves it)
    logger: Any
    plan: Any  # shared.capacity.CapacityPlan (attempts.plan_for)
    pending_since: float
    progress: ProgressArtifact
    outage: Outage
    output: Any  # log_forwarding.JobLogForwarder
    emit: Callable[[str], None]
    meter: Any  # metering.JobMeter
    usage: Any  # usage_report.UsageReport
    poll: float
    last_parent_check: float
    last_run_check: float
    first_error_at: float | None = None
    marked_running: bool = False
    last_phase: str | None = None
    last_diagnosis: str | None = None
    last_pending_detail: str = ""

    def moved_to(self, identifier: str) -> None:
        """A new attempt: its own time pending and its own phases; metered from the last attempt's end."""
        self.identifier, self.pending_since = identifier, time.monotonic()
        self.last_phase = self.last_diagnosis = None
        self.last_pending_detail = ""
        self.meter.relaunched(identifier, self.plan.attempts[-2].ended)


class KineticWorker:
    """The lifecycle, mixed into each launcher's BaseWorker subclass.

    A mixin rather than a BaseWorker subclass: Prefect registers every BaseWorker subclass as a
    worker type, and this is not one. ``owner_is_caller`` is True when the calling process runs
    the worker for its own call (in-process submission): then the job must not outlive it.
    """

    client: Any
    get_flow_run_logger: Any
    launcher: JobLauncher
    abilities: LauncherAbilities  # each launcher's worker class declares what it can do
    owner_is_caller: bool = False
    # In-process, the caller's words for why it stopped waiting (its timeout_seconds ran out), given the default.
    stopped_waiting_reason: Callable[[str], str] = staticmethod(lambda default: default)

    @property
    def _calling_task_ids(self) -> dict[UUID, UUID | None]:
        """Per followed job, the task run that waits for it: found once, as it never changes."""
        return self.__dict__.setdefault("_calling_task_id_cache", {})

    def owned_by_caller(self, api_env: dict[str, str]) -> None:
        """In-process submission: this worker runs the calling process's own job, which must not
        outlive the call. ``api_env`` lets a launcher's job reach Prefect if the caller dies."""
        self.owner_is_caller = True

    def use_for_one_call(self, client: PrefectClient, pool: WorkPool) -> None:
        """In-process submission: give this worker the caller's client and its pool instead of ``setup()``
        (heartbeats, websockets), which one call's job does not need."""
        self._client = client
        self._work_pool = pool

    @classmethod
    def check_pool_settings(cls, pool_name: str, defaults: dict[str, Any], job_variables: dict[str, Any]) -> None:
        """Raise before anything is uploaded or built if the pool's settings cannot work, naming the fix."""

    # ------------------------------------------------------------------ states (the only place)
    async def _propose(self, flow_run: FlowRun, state: Any) -> None:
        outage = Outage(f"the worker following {flow_run.name}", self.get_flow_run_logger(flow_run).warning)
        # Abort: already final (e.g. Cancelled by someone else), the first word stands
        with contextlib.suppress(Abort):
            await outage.call(
                lambda: propose_state(self.client, state.model_copy(), flow_run_id=flow_run.id),
                f"setting the job's run {state.name}",
            )

    async def mark_running(self, flow_run: FlowRun, message: str) -> None:
        await self._propose(flow_run, Running(message=message))

    async def mark_cancelled(self, flow_run: FlowRun, message: str) -> None:
        await self._propose(flow_run, Cancelled(message=message))

    async def mark_crashed(self, flow_run: FlowRun, message: str) -> None:
        self.get_flow_run_logger(flow_run).error(message)
        await self._propose(flow_run, Crashed(message=message))

    async def mark_from_outcome(self, flow_run: FlowRun, outcome: Outcome, note: str = "") -> None:
        message = outcome.summary() + note
        state: State[Any] = Completed(message=message) if outcome.completed else Failed(message=message)
        await self._propose(flow_run, state)

    # ------------------------------------------------------------------ events
    def emit_job_event(
        self, flow_run: FlowRun, phase: str, configuration: Any, labels: dict[str, str] | None = None, **payload: Any
    ) -> None:
        """``kinetic.job.<phase>`` (pending, running, unschedulable, exited, cancelled, crashed) on the job's
        run, so an automation can react, e.g. page on "kinetic.job.unschedulable" for tpu-v6e-8."""
        try:
            from prefect.events import emit_event

            accelerator = str(getattr(configuration, "accelerator", "") or "")
            pool = getattr(self, "_work_pool", None)
            emit_event(
                event=JOB_EVENT_PREFIX + phase,
                resource={
                    "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                    "prefect.resource.name": flow_run.name,
                    "kinetic.accelerator": accelerator,
                    **(labels or {}),
                },
                related=[
                    {
                        "prefect.resource.id": f"prefect.work-pool.{pool.id}",
                        "prefect.resource.role": "work-pool",
                        "prefect.resource.name": pool.name,
                    }
                ]
                if pool is not None
                else None,
                payload={k: v for k, v in payload.items() if v is not None},
            )
        except Exception:  # events are for automations; they never fail a job
            pass

    # ------------------------------------------------------------------ cancellation sources
    async def stop_reason(self, flow_run: FlowRun, check_parents: bool) -> str | None:
        """Why the job should stop now, or None. Prefect's workers only cancel runs that have not
        started; a started kinetic job has no flow engine to notice, so the worker watches. The runs are read
        with the other jobs' (``prefect_runs.FlowRunReader``): one request for all the jobs this process follows."""
        current = await prefect_runs.read_flow_run_batched(self.client, flow_run.id)
        state = current.state
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            return state.message or "Cancelled on request"
        if state is not None and state.is_final():
            return f"The run is already {state.name}"
        if not check_parents:
            return None
        # the tracking task run is read once per job: its __parents__ never change
        if flow_run.id not in self._calling_task_ids:
            self._calling_task_ids[flow_run.id] = await prefect_runs.calling_task_run_id(self.client, current)
        task_run_id = self._calling_task_ids[flow_run.id]
        task_run = await prefect_runs.read_task_run_or_none(self.client, task_run_id) if task_run_id else None
        if task_run is None:
            return None
        if task_run.state is not None and task_run.state.is_final():
            return f"The task run waiting for this job ended ({task_run.state.name})"
        if task_run.flow_run_id is not None:
            parent = await prefect_runs.read_flow_run_batched(self.client, task_run.flow_run_id)
            if parent.state is not None and (parent.state.is_cancelling() or parent.state.is_cancelled()):
                return f"The parent flow run {parent.name} was cancelled"
        return None

    # ------------------------------------------------------------------ the lifecycle
    def refuse_non_job(self, configuration: Any) -> str | None:
        if configuration.env.get(Env.PAYLOAD_SHA256):
            return None
        return (
            f"A {getattr(self, 'type', 'kinetic')} pool runs @kinetic_task jobs, not flows: this flow run has no "
            "kinetic payload (a deployment's flow run?). Deploy flows to a pool whose worker runs flows "
            "(`prefect work-pool create pipelines --type process`, or kubernetes); their @kinetic_task steps "
            "then come to this pool by themselves."
        )

    async def run(
        self, flow_run: FlowRun, configuration: Any, task_status: anyio.abc.TaskStatus[str] | None = None
    ) -> KineticWorkerResult:
        logger = self.get_flow_run_logger(flow_run)

        def ended_before_start(identifier: str) -> KineticWorkerResult:
            if task_status is not None:
                task_status.started(identifier)
            return KineticWorkerResult(identifier=identifier, status_code=0)

        refusal = self.refuse_non_job(configuration)
        if refusal:
            logger.error(refusal)
            await self._propose(flow_run, Failed(message=refusal))
            return ended_before_start("refused")
        if not await self._hand_over_signing_key(flow_run, configuration):
            return ended_before_start("refused")
        identifier: str | None = await self.launcher.find(flow_run, configuration)
        if identifier:
            logger.info(f"Reattaching to job {identifier} (no duplicate is launched)")
        else:
            build_progress = ProgressArtifact(self.client, flow_run, publish_from_threads=True)
            try:
                identifier = await self.launcher.submit(flow_run, configuration, build_progress.wrap(logger.info))
                await build_progress.publish()
            except Exception as exc:
                await self.mark_crashed(flow_run, f"The job could not be started: {type(exc).__name__}: {exc}")
                return ended_before_start("not-started")
            except BaseException:
                if self.owner_is_caller:  # the caller stopped waiting while its job started: nothing will follow it
                    await self._stop_unfollowed(flow_run, configuration, identifier)
                raise
        if task_status is not None:
            task_status.started(identifier)
        return await self.follow(flow_run, configuration, identifier)

    async def _stop_unfollowed(self, flow_run: FlowRun, configuration: Any, identifier: str | None) -> None:
        with anyio.CancelScope(shield=True):
            if identifier:
                await self.launcher.cancel(identifier, configuration, CANCEL_GRACE_SECONDS)
                await self.launcher.cleanup(identifier, configuration)
            reason = self.stopped_waiting_reason("The calling task stopped waiting while the job was being started")
            await self.mark_cancelled(flow_run, reason)

    async def _hand_over_signing_key(self, flow_run: FlowRun, configuration: Any) -> bool:
        """Before anything is built, launched or read for it: the run's job variables, as the worker will use them
        (its deployment's merged under its own), exactly what a key holder signed; then its forwarded env values
        (its own block only, signed too); then the job gets the derived keys of its own scopes in memory (never the
        master key, never in job variables or a manifest). False once the run is ended refused."""
        key = await key_blocks.signing_key()
        if refusal := key_blocks.unsigned_refusal(str(configuration.env.get(Env.STORE) or ""), key):
            await self.mark_crashed(flow_run, f"This worker refuses the job: {refusal}.")
            return False
        try:
            if key is not None:  # whoever may create flow runs on the pool cannot choose a run id, code or image
                key = await self._check_signed(flow_run, key)
            await self._take_forwarded_env(flow_run, configuration, key)
            if key is not None:
                configuration.hand_over_signing_keys(key)
        except (signing.TamperedObject, signing.BadKey) as exc:
            refused = (
                f"This worker refuses the job: {exc}. Job runs of a signed pool are created by "
                "@kinetic_task calls holding the signing key; nothing was built or launched."
            )
            self.get_flow_run_logger(flow_run).error(refused)
            mismatch = isinstance(exc, signing.KeyMismatch)  # the caller's key differs: no retry can fix it
            await self._propose(flow_run, Failed(message=refused, name=KEY_MISMATCH_STATE if mismatch else "Failed"))
            return False
        if key is None and configuration.env.get(signing.REQUIRED_ENV):
            await self.mark_crashed(
                flow_run,
                f"The caller signs its store objects but this worker has no signing key: "
                f"set {signing.KEY_ENV} or the Prefect Secret block "
                f"{signing.SECRET_BLOCK!r} where the worker runs.",
            )
            return False
        return True

    async def _check_signed(self, flow_run: FlowRun, key: signing.Keyring) -> signing.Keyring:
        """The key the run's variables verify under (the Secret block read again once after a rotation);
        TamperedObject when its deployment adds to them or no key holder signed them."""
        if flow_run.deployment_id is not None:
            deployment = await self.client.read_deployment(flow_run.deployment_id)
            added = deployment_additions(deployment.job_variables or {}, dict(flow_run.job_variables or {}))
            if added:
                raise signing.TamperedObject(
                    f"its deployment {deployment.name!r} sets job variables ({', '.join(added)}) that no key "
                    "holder signed, and Prefect would merge them into the job; a kinetic job runs with exactly "
                    "what its caller signed, so job runs of a signed pool never come from a deployment with job "
                    "variables"
                )
        try:
            signing.check_job_variables(key, dict(flow_run.job_variables or {}))
        except signing.KeyMismatch:
            again = await key_blocks.signing_key_again()  # a rotation under a running worker: the block changed
            if again is None or again.identity() == key.identity():
                raise
            signing.check_job_variables(again, dict(flow_run.job_variables or {}))
            return again
        return key

    async def _take_forwarded_env(self, flow_run: FlowRun, configuration: Any, key: signing.Keyring | None) -> None:
        """The call's forwarded env= values for a polling worker (in-process they are in memory already): from the
        run's own Secret block only (read and deleted), signed for this run, and setting nothing the signed variables
        govern (FORWARD_REFUSED_ENV)."""
        from kinetic_prefect.contract.job_variables import forward_refused
        from kinetic_prefect.contract.layout import env_block

        block = configuration.env.pop(Env.ENV_BLOCK, None)
        if block:
            run_id = str(configuration.env.get(Env.RUN_ID) or "")
            if block != env_block(run_id):
                raise signing.TamperedObject(
                    f"its {Env.ENV_BLOCK} names the Secret block {block!r}, not the run's own {env_block(run_id)!r}; "
                    "a worker reads only a run's own forwarded-env block"
                )
            values = await key_blocks.load_secret_env(block, run_id, key)
            if refused := forward_refused(values):  # in-process, the caller refused them when it prepared the call
                raise signing.TamperedObject(
                    f"its forwarded env sets {', '.join(refused)}, which the job's signed variables or its worker "
                    "set (its run, code, keys, or which code the interpreter loads); a forwarded value never "
                    "replaces them"
                )
            configuration.set_secret_env(values)

    async def follow(self, flow_run: FlowRun, configuration: Any, identifier: str) -> KineticWorkerResult:
        """Follow one job to its end and set the run's final state."""
        job = self._start_following(flow_run, configuration, identifier)
        result = KineticWorkerResult(identifier=identifier, status_code=0)
        try:
            while True:
                status = await self._look(job)
                if status is None:  # a read failed: looked again at once, after its own wait
                    continue
                step = await self._on_status(job, status)
                if step == _FOLLOWED:
                    return result
                if step != _MOVED:  # a retry placed anew is looked at at once
                    await anyio.sleep(job.poll)
        except CancelRequested as request:
            await self._stop_requested(job, request)
            return result
        except BaseException as exc:
            if await self._follow_stopped(job, exc):
                return result
            raise
        finally:
            await self._after_following(job)

    def _start_following(self, flow_run: FlowRun, configuration: Any, identifier: str) -> FollowedJob:
        from kinetic_prefect.workers import attempts, metering, usage_report
        from kinetic_prefect.workers.log_forwarding import JobLogForwarder

        logger = self.get_flow_run_logger(flow_run)
        plan = attempts.plan_for(configuration, runs_here=self.abilities.runs_here)
        pending_since = time.monotonic()
        progress = ProgressArtifact(self.client, flow_run)
        outage = Outage(f"the worker following {flow_run.name}", logger.warning)
        output = JobLogForwarder(self.client, flow_run.id, logger, outage)
        emit = progress.wrap(output.emit if getattr(configuration, "stream_output", True) else (lambda text: None))
        meter = metering.JobMeter(self.launcher, identifier, configuration, self.abilities.price_source)
        # the hint speaks of the accelerator asked for: a job run here on the CPU in its stead was not given it
        asked = configuration.asked_spec if plan.instead_of else meter.spec
        usage = usage_report.UsageReport(self.client, flow_run, meter.spec, asked=asked)
        # In-process, the caller created this run a moment ago: the first look for a cancel waits one interval
        # (4 requests a call fewer; a sub-second job then ends before it).
        last_check = time.monotonic() if self.owner_is_caller else 0.0
        return FollowedJob(
            flow_run=flow_run,
            configuration=configuration,
            identifier=identifier,
            logger=logger,
            plan=plan,
            pending_since=pending_since,
            progress=progress,
            outage=outage,
            output=output,
            emit=usage.wrap(emit),
            meter=meter,
            usage=usage,
            poll=float(getattr(configuration, "poll_seconds", 0.5) or 0.5),
            last_parent_check=last_check,
            last_run_check=last_check,
        )

    async def _look(self, job: FollowedJob) -> JobStatus | None:
        """The job's status, once its new output and progress are forwarded and its run was checked for a stop;
        None after a read that failed (transient until it lasts longer than an outage is waited out)."""
        try:
            await self.launcher.forward_logs(job.identifier, job.configuration, job.emit)
            await self._store_output(job.output, job.identifier)
            await job.progress.publish()
            await self._check_for_stop(job)
            status = await self.launcher.status(job.identifier, job.configuration)
            job.first_error_at = None
            return status
        except CancelRequested:
            raise
        except Exception as exc:  # transient until proven otherwise
            job.first_error_at = job.first_error_at or time.monotonic()
            if time.monotonic() - job.first_error_at > job.outage.horizon:
                raise
            job.logger.warning(f"Could not read the job's state ({type(exc).__name__}: {exc}); retrying")
            await anyio.sleep(min(30.0, job.poll * 4))
            return None

    async def _check_for_stop(self, job: FollowedJob) -> None:
        """Raise CancelRequested when the run (every RUN_CHECK_SECONDS) or its parents (less often) say stop."""
        now = time.monotonic()
        if now - job.last_run_check < RUN_CHECK_SECONDS:
            return
        check_parents = now - job.last_parent_check >= PARENT_CHECK_SECONDS
        reason = await self.stop_reason(job.flow_run, check_parents)
        job.last_run_check = now
        if check_parents:
            job.last_parent_check = now
        if reason:
            raise CancelRequested(reason)

    async def _on_status(self, job: FollowedJob, status: JobStatus) -> str | None:
        """Act on one look at the job: _FOLLOWED when the run's final state is set, _MOVED when the job moved to
        a new attempt (preemption, fallback), else None (look again after a poll)."""
        from kinetic_prefect.workers import attempts

        await job.meter.observe()
        # A job that has ended is never stopped for its budget: its value is kept (it is billed to its
        # own end, which an API outage that delayed this look does not move).
        if status.phase != "exited" and (budget_reached := job.meter.over_budget()):
            raise BudgetReached(budget_reached)
        self._announce(job, status)
        if status.phase == "running":
            job.plan.started = True  # again after a preemption's retry is placed
        if status.phase == "running" and not job.marked_running:
            job.marked_running = True
            await self.mark_running(job.flow_run, (status.detail or "Job running") + attempts.final_note(job.plan))
        elif status.phase == "pending" and (
            moved := await attempts.on_pending(
                self,
                job.flow_run,
                job.configuration,
                job.identifier,
                status,
                job.plan,
                time.monotonic() - job.pending_since,
            )
        ):
            job.moved_to(moved)
            return _MOVED
        elif status.phase == "pending" and status.fatal:
            await self._unschedulable(job, status)
            return _FOLLOWED
        elif status.phase == "exited":
            return await self._exited(job, status)
        elif status.phase == "gone":
            await self.mark_crashed(
                job.flow_run, f"Job {job.identifier} disappeared before it finished ({status.detail or 'deleted'})"
            )
            return _FOLLOWED
        return None

    def _announce(self, job: FollowedJob, status: JobStatus) -> None:
        """Events (and a log line) for a new diagnosis and for a new phase of the job."""
        if status.diagnosis and status.diagnosis.get("category") != job.last_diagnosis:
            # as soon as the cluster says why (not only at the timeout): an automation can page now
            job.last_diagnosis = status.diagnosis.get("category")
            job.logger.warning(
                f"{status.diagnosis.get('summary')}: {status.diagnosis.get('detail')} "
                f"({status.diagnosis.get('resolution')})"
            )
            self.emit_job_event(
                job.flow_run,
                EVENT_DIAGNOSIS,
                job.configuration,
                identifier=job.identifier,
                labels={"kubernetes.diagnosis": job.last_diagnosis or ""},
                **status.diagnosis,
            )
        if status.phase == "pending" and not status.fatal and status.detail not in ("", job.last_pending_detail):
            job.last_pending_detail = status.detail  # e.g. where a queued Job waits and why: said once, not per look
            job.logger.info(f"Job {job.identifier} waits: {status.detail}")
        if status.phase != job.last_phase and status.phase in ("pending", "running"):
            job.last_phase = status.phase
            self.emit_job_event(
                job.flow_run, status.phase, job.configuration, identifier=job.identifier, detail=status.detail
            )

    async def _unschedulable(self, job: FollowedJob, status: JobStatus) -> None:
        """A job that cannot start: its event, the job stopped and the run Crashed."""
        self.emit_job_event(
            job.flow_run,
            EVENT_UNSCHEDULABLE,
            job.configuration,
            identifier=job.identifier,
            diagnosis=status.detail,
            labels={"kubernetes.diagnosis": (status.diagnosis or {}).get("category", "")},
        )
        await self.launcher.cancel(job.identifier, job.configuration, 0)
        why = JOB_CANNOT_START if status.capacity else "cannot start:"  # capacity: another pool may have it
        await self.mark_crashed(job.flow_run, f"Job {job.identifier} {why} {status.detail}")

    async def _exited(self, job: FollowedJob, status: JobStatus) -> str:
        """The job's process ended: its last output forwarded, then a retry placed (_MOVED) or the run finished."""
        from kinetic_prefect.workers import attempts

        await self.launcher.forward_logs(job.identifier, job.configuration, job.emit, final=True)
        await job.progress.publish()
        await self._end_of_output(job.output, job.identifier)
        self.emit_job_event(
            job.flow_run,
            EVENT_EXITED,
            job.configuration,
            identifier=job.identifier,
            exit_code=status.exit_code,
            detail=status.detail,
        )
        moved = await attempts.on_exit(
            self, job.flow_run, job.configuration, job.identifier, status, job.plan, job.progress.latest
        )
        if moved == attempts.HANDLED:
            return _FOLLOWED
        if moved:
            # the retry is placed anew: its own time pending counts toward its capacity wait
            job.moved_to(moved)
            return _MOVED
        await self.finish(job.flow_run, job.configuration, job.identifier, status, note=attempts.final_note(job.plan))
        return _FOLLOWED

    async def _stop_requested(self, job: FollowedJob, request: CancelRequested) -> None:
        """A cancel of the run (or its parent) or a reached budget: the job stopped, its run ends accordingly."""
        from kinetic_prefect.workers import metering

        with anyio.CancelScope(shield=True):
            await self.launcher.cancel(job.identifier, job.configuration, CANCEL_GRACE_SECONDS)
            await self.launcher.forward_logs(job.identifier, job.configuration, job.emit, final=True)
            await self._end_of_output(job.output, job.identifier)
            if isinstance(request, BudgetReached):
                await metering.record_budget_outcome(self, job.flow_run, job.configuration, request.reason)
                await self._propose(job.flow_run, Failed(message=request.reason))
            else:
                await self.mark_cancelled(job.flow_run, request.reason)
        job.logger.info(f"Stopped job {job.identifier}: {request.reason}")

    async def _follow_stopped(self, job: FollowedJob, exc: BaseException) -> bool:
        """The follow loop itself was stopped: the caller's task timed out or was interrupted (in-process), or the
        worker is shutting down, or it failed. True when the run was ended Crashed and ``exc`` is handled."""
        if self.owner_is_caller:
            with anyio.CancelScope(shield=True):
                reason = self.stopped_waiting_reason(
                    "The calling task stopped waiting (timeout, interrupt or error in the caller)"
                )
                await self.launcher.cancel(job.identifier, job.configuration, CANCEL_GRACE_SECONDS)
                await self.mark_cancelled(job.flow_run, reason)
        elif not isinstance(exc, Exception):
            job.logger.warning(f"Worker stopping: job {job.identifier} keeps running; a restarted worker reattaches")
        else:
            with anyio.CancelScope(shield=True):
                await self.launcher.cancel(job.identifier, job.configuration, CANCEL_GRACE_SECONDS)
                await self.mark_crashed(job.flow_run, f"The worker lost the job: {type(exc).__name__}: {exc}")
            return True
        return False

    async def _after_following(self, job: FollowedJob) -> None:
        """Once the run is final: the job's cost and usage published, its resources cleaned up."""
        from kinetic_prefect.workers import metering, startup

        self._calling_task_ids.pop(job.flow_run.id, None)
        with anyio.CancelScope(shield=True):
            current = await _read_state(self.client, job.flow_run)
            if current is not None and current.is_final():
                await metering.publish_job_cost(self, job.flow_run, job.meter)
                await job.usage.publish(self.get_flow_run_logger(job.flow_run))
                if (timeline := await self.launcher.startup_timeline(job.identifier, job.configuration)) is not None:
                    await startup.publish(self.client, job.flow_run, self.get_flow_run_logger(job.flow_run), timeline)
                await self.launcher.cleanup(job.identifier, job.configuration)

    async def _store_output(self, output: Any, identifier: str) -> None:
        if await output.flush():
            await self.launcher.forwarded(identifier)

    async def _end_of_output(self, output: Any, identifier: str) -> None:
        """The job's last lines, then the marker a polling caller reads up to (in-process, the caller already
        has every line), stored before the run's final state is set."""
        if not self.owner_is_caller:
            output.emit(LOG_END_MARKER)
        await self._store_output(output, identifier)

    async def open_pool_store(self, configuration: Any) -> Any:
        return await open_job_store(configuration)

    async def finish(
        self, flow_run: FlowRun, configuration: Any, identifier: str, status: JobStatus, note: str = ""
    ) -> None:
        """Completed/Failed from the outcome record; no record means the job crashed."""
        from kinetic_prefect import signing
        from kinetic_prefect.storage import ObjectNotFound as NoObject

        outcome: Outcome | None = None
        store = await self.open_pool_store(configuration)
        layout = RunLayout(configuration.env[Env.RUN_ID])
        key = await key_blocks.signing_key()
        for attempt in range(5):
            try:
                outcome = Outcome.from_json(await anyio.to_thread.run_sync(signing.get, store, layout.outcome, key))
                break
            except signing.TamperedObject as exc:
                await self.mark_crashed(flow_run, f"Job {identifier}: {exc}")
                return
            except NoObject:
                break
            except Exception:  # a store hiccup: the outcome is there or it is not, ask again
                await anyio.sleep(2**attempt)
        hosts = outcome.num_hosts if outcome is not None else int(getattr(configuration, "host_count", 1) or 1)
        coordinator_failed = outcome is None or not outcome.completed
        if (
            hosts > 1
            and coordinator_failed
            and (status.failed_host or outcome is None or _stopped(outcome))
            and await self._report_group_failure(flow_run, identifier, status, store, layout, key, hosts)
        ):
            return
        if outcome is None:
            code = status.exit_code
            await self.mark_crashed(
                flow_run,
                f"Job {identifier} ended without reporting an outcome "
                f"(exit status {code if code is not None else 'unknown'}"
                f"{'; ' + status.detail if status.detail else ''}){note}",
            )
            return
        await self.mark_from_outcome(flow_run, outcome, note)

    async def _report_group_failure(
        self,
        flow_run: FlowRun,
        identifier: str,
        status: JobStatus,
        store: Any,
        layout: RunLayout,
        key: signing.KeyLike,
        hosts: int,
    ) -> bool:
        """A group is all or nothing, and its failure is the failure of the host that ended it. The coordinator then
        only followed: stopped (JobTerminated), killed while blocked in a collective (no outcome), or failed in a
        collective whose peer died ("Connection reset by peer"). ``status.failed_host`` names that host when the
        launcher saw it; otherwise (a stopped or silent coordinator) the other hosts' records are searched. A host
        whose function raised recorded its own outcome: it becomes the run's (the caller raises that host's error,
        its remote traceback attached). A host that ended without one (killed, OOM) makes the group crashed: the
        coordinator's record is removed and the run is Crashed, naming the host. Either way the task's retry starts
        a new group. False: no other host is to blame (the coordinator's own outcome stands)."""
        from kinetic_prefect import signing
        from kinetic_prefect.storage import ObjectNotFound as NoObject

        recorded: dict[int, Outcome] = {}
        for index in range(1, hosts):
            try:
                blob = await anyio.to_thread.run_sync(signing.get, store, layout.host_outcome(index), key)
                recorded[index] = Outcome.from_json(blob)
            except NoObject:
                continue
            except Exception:  # unreadable or tampered: not a cause we can name
                continue
        failed = [i for i, o in sorted(recorded.items()) if not o.completed and not _stopped(o)]
        missing = [i for i in range(1, hosts) if i not in recorded]
        if status.failed_host:  # the launcher saw which host ended the group: its failure explains the others'
            cause = status.failed_host
            failed = [cause] if cause in failed else []
            missing = [cause] if cause not in recorded else []
        if failed:
            index = failed[0]
            host = recorded[index]
            host.message = f"host {index} of {hosts}: {host.message}"
            await anyio.to_thread.run_sync(signing.delete, store, layout.result)
            await anyio.to_thread.run_sync(signing.put, store, layout.outcome, host.to_json(), key)
            self.get_flow_run_logger(flow_run).error(
                f"Host {index} of {hosts} failed while {host.phase}: {host.error_type}: "
                f"{host.message}; the group fails with it"
            )
            await self.mark_from_outcome(flow_run, host)
            return True
        if missing:
            for object_key in (layout.result, layout.outcome):
                await anyio.to_thread.run_sync(signing.delete, store, object_key)
            await self.mark_crashed(
                flow_run,
                f"Job {identifier}: host {missing[0]} of {hosts} ended "
                f"without reporting an outcome ({status.detail or 'killed?'}); the "
                "group was stopped (all or nothing)",
            )
            return True
        return False

    # ------------------------------------------------------------------ worker restarts
    async def reattach(self, start_soon: Callable[..., Any]) -> int:
        """After a restart: follow the jobs this pool started whose runs are not final yet."""
        count = 0
        work_pool = self.work_pool  # type: ignore[attr-defined]  # BaseWorker's, mixed in
        for flow_run_id, identifier in await self.launcher.unfinished_jobs(work_pool):
            try:
                flow_run = await self.client.read_flow_run(flow_run_id)
            except ObjectNotFound:
                continue
            if flow_run.state is None or flow_run.state.is_final():
                continue
            configuration = await self.job_configuration.resolve_for_flow_run(  # type: ignore[attr-defined]
                flow_run,
                client=self.client,
                work_pool=self.work_pool,  # type: ignore[attr-defined]  # BaseWorker's, mixed in
                worker_name=self.name,  # type: ignore[attr-defined]
            )
            configuration.env.pop(Env.ENV_BLOCK, None)  # read and deleted by the first worker; the job has it
            start_soon(self.follow, flow_run, configuration, identifier)
            count += 1
        return count


def deployment_additions(deployment_variables: dict[str, Any], run_variables: dict[str, Any]) -> list[str]:
    """What a deployment's job variables add to or change in a run's own, as Prefect's worker merges them (the
    deployment's under the run's, dotted names nested): the variables by name, ``env.NAME`` for env entries."""
    from kinetic_prefect.contract.job_variables import sent_variables

    merged, own = sent_variables(deployment_variables, run_variables), sent_variables(run_variables)
    added = []
    for name in sorted(set(merged) | set(own)):
        if name == "env" and isinstance(merged.get(name), dict) and isinstance(own.get(name, {}), dict):
            env, own_env = merged[name], own.get(name, {})
            added += [f"env.{n}" for n in sorted(set(env) | set(own_env)) if env.get(n) != own_env.get(n)]
        elif merged.get(name) != own.get(name):
            added.append(name)
    return added


def _stopped(outcome: Outcome) -> bool:
    """The host did not fail by itself: it was stopped (SIGTERM from a cancel, or because another host failed)."""
    return outcome.terminated


async def _read_state(client: Any, flow_run: FlowRun) -> Any:
    try:
        return (await client.read_flow_run(flow_run.id)).state
    except Exception:
        return None


__all__ = ["JobLauncher", "JobStatus", "KineticWorker", "KineticWorkerResult"]
