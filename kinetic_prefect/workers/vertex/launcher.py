"""``VertexJobLauncher``: creating, finding, following, cancelling the Vertex AI custom jobs of kinetic calls.

What prefect-gcp's worker lacks and this launcher adds: the job found again after a worker restart (by its flow
run's label), its output forwarded while it runs, its exit status, a Spot preemption told from a failure, a
stockout or quota refusal told as capacity (so a fallback list moves on), and a cancel that waits for the job to
end. Blocking client calls run in threads. Identifiers are the job's resource name
(``projects/P/locations/L/customJobs/ID``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import anyio
import anyio.from_thread
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators
from kinetic_prefect.contract import VERTEX_WORKER_TYPE, Env
from kinetic_prefect.shared import builders, capacity
from kinetic_prefect.workers.base import open_job_store
from kinetic_prefect.workers.job_launcher import JobLauncher, JobStatus
from kinetic_prefect.workers.owner_heartbeat import Heartbeats, owned_here
from kinetic_prefect.workers.vertex import custom_job, service
from kinetic_prefect.workers.vertex.configuration import (
    FLOW_RUN_LABEL,
    POOL_LABEL,
    KineticVertexJobConfiguration,
    gcp_label,
)

_EXIT_STATUS = re.compile(r"non-zero status of (\d+)")
# What Vertex says of a job whose machine could not be had: a stockout, or a quota the project lacks.
_CAPACITY_WORDS = ("resource_exhausted", "stockout", "does not have enough resources", "quota", "insufficient")
_PREEMPTION_WORDS = ("preempt",)
CANCEL_WAIT_SECONDS = 120.0
_FINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"}


def status_of(job: Any) -> JobStatus:
    """What the lifecycle sees of a ``CustomJob`` (its state, and its error when it ended)."""
    state = job.state.name
    if state in ("JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_UNSPECIFIED"):
        return JobStatus("pending", detail=f"Vertex AI job {job.name}: {state.removeprefix('JOB_STATE_').lower()}")
    if state in ("JOB_STATE_RUNNING", "JOB_STATE_CANCELLING", "JOB_STATE_UPDATING"):
        return JobStatus("running", detail=f"Vertex AI job {job.name} running")
    if state == "JOB_STATE_SUCCEEDED":
        return JobStatus("exited", exit_code=0, detail="the job succeeded")
    message = str(job.error.message or state)
    lowered = message.lower()
    if state == "JOB_STATE_FAILED" and not job.start_time and any(w in lowered for w in _CAPACITY_WORDS):
        return JobStatus(
            "pending", detail=message, fatal=True, capacity=capacity.INSUFFICIENT_CAPACITY
        )  # never started: waiting changes nothing, the next accelerator of a fallback list may
    if state == "JOB_STATE_CANCELLED":
        return JobStatus("exited", exit_code=143, detail=f"the job was cancelled: {message}")
    if any(w in lowered for w in _PREEMPTION_WORDS):
        return JobStatus("exited", exit_code=143, detail=message, preempted=f"Vertex AI preempted the job: {message}")
    found = _EXIT_STATUS.search(message)
    return JobStatus("exited", exit_code=int(found.group(1)) if found else 1, detail=message)


class VertexJobLauncher(JobLauncher):
    """A kinetic job as one Vertex AI custom job (one replica; a group adds a second replica pool)."""

    job_kind = "Vertex AI custom job"

    can_relaunch = True

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}
        self._logs: dict[str, service.JobLog] = {}
        self._sessions: dict[str, Any] = {}
        self._jobs: dict[str, Any] = {}  # the last CustomJob read per identifier (for host_spans)
        # In-process submission: the calling process's proof of life for its jobs (owner_heartbeat.py)
        self.heartbeats = Heartbeats()
        self._run_ids: dict[str, str] = {}  # identifier -> the run id its heartbeat is kept under

    # ------------------------------------------------------------------ clients
    async def _block(self, configuration: KineticVertexJobConfiguration) -> Any:
        if configuration.credentials is not None:
            return configuration.credentials
        if configuration.gcp_credentials:
            from kinetic_prefect.shared import gcp

            return await gcp.credentials_block(VERTEX_WORKER_TYPE, configuration.gcp_credentials)
        return None

    async def client(self, configuration: KineticVertexJobConfiguration) -> Any:
        key = f"{configuration.api_endpoint}|{configuration.region}|{configuration.gcp_credentials}"
        if key not in self._clients:
            block = await self._block(configuration)
            self._clients[key] = await anyio.to_thread.run_sync(service.job_service_client, configuration, block)
        return self._clients[key]

    # ------------------------------------------------------------------ the JobLauncher interface
    async def submit(
        self, flow_run: FlowRun, configuration: KineticVertexJobConfiguration, log: Callable[[str], None]
    ) -> str:
        return await self._create(flow_run, configuration, log, attempt=1)

    async def _create(
        self, flow_run: FlowRun, configuration: KineticVertexJobConfiguration, log: Callable[[str], None], attempt: int
    ) -> str:
        configuration.image_given()  # decided before the image is set below
        # A cancel (Ctrl-C, a task timeout) stops waiting at once; the build is told to stop (a Cloud Build cancelled)
        configuration.image = await builders.ensure_interruptibly(
            lambda stop: self.ensure_image(configuration, log, stop)
        )
        run_id = str(configuration.env[Env.RUN_ID])
        if owned_here(flow_run) and not self.heartbeats.following(run_id):
            # the first beat before the job exists: its runner, once up, finds a record to watch
            store = await open_job_store(configuration)
            await anyio.to_thread.run_sync(self.heartbeats.start, run_id, store)
            configuration.add_secret_env(self.heartbeats.job_env())
        request = custom_job.custom_job(configuration, flow_run, attempt)
        try:
            client = await self.client(configuration)
            job = await anyio.to_thread.run_sync(
                lambda: client.create_custom_job(parent=configuration.parent, custom_job=request)
            )
        except BaseException:  # no job: nothing to keep alive
            self.heartbeats.stop(run_id)
            raise
        self._run_ids[str(job.name)] = run_id
        machine = request.job_spec.worker_pool_specs[0].machine_spec
        log(
            f"Created Vertex AI custom job {job.name} ({request.display_name}) on {machine.machine_type}"
            + (
                f" with {machine.accelerator_count} x {machine.accelerator_type.name}"
                if machine.accelerator_count
                else ""
            )
            + f" for accelerator {configuration.accelerator}"
        )
        return str(job.name)

    async def find(self, flow_run: FlowRun, configuration: KineticVertexJobConfiguration) -> str | None:
        client = await self.client(configuration)
        jobs = await anyio.to_thread.run_sync(
            lambda: list(
                client.list_custom_jobs(
                    request={"parent": configuration.parent, "filter": f'labels.{FLOW_RUN_LABEL}="{flow_run.id}"'}
                )
            )
        )
        mine = sorted(
            (j for j in jobs if j.labels.get(FLOW_RUN_LABEL) == str(flow_run.id)),
            key=lambda j: j.create_time or datetime.min,
        )
        return str(mine[-1].name) if mine else None

    async def status(self, identifier: str, configuration: KineticVertexJobConfiguration) -> JobStatus:
        from google.api_core import exceptions

        client = await self.client(configuration)
        try:
            job = await anyio.to_thread.run_sync(lambda: client.get_custom_job(name=identifier))
        except exceptions.NotFound:
            return JobStatus("gone", detail="the custom job was deleted")
        self._jobs[identifier] = job
        return status_of(job)

    async def forward_logs(
        self,
        identifier: str,
        configuration: KineticVertexJobConfiguration,
        emit: Callable[[str], None],
        final: bool = False,
    ) -> None:
        if identifier not in self._logs:
            self._logs[identifier] = service.JobLog(configuration.project, identifier.rsplit("/", 1)[-1])
        endpoint = configuration.logging_endpoint or service.LOGGING_ENDPOINT
        if endpoint not in self._sessions:
            block = await self._block(configuration)
            self._sessions[endpoint] = await anyio.to_thread.run_sync(service.logging_session, configuration, block)
        session, job_log = self._sessions[endpoint], self._logs[identifier]
        await anyio.to_thread.run_sync(job_log.read, session, endpoint, emit, final)

    async def cancel(self, identifier: str, configuration: KineticVertexJobConfiguration, grace_seconds: float) -> None:
        """CancelCustomJob, then wait (bounded) until the job has ended: Vertex cancels asynchronously."""
        from google.api_core import exceptions

        client = await self.client(configuration)
        try:
            await anyio.to_thread.run_sync(lambda: client.cancel_custom_job(name=identifier))
        except exceptions.NotFound:
            return
        except exceptions.BadRequest:  # FAILED_PRECONDITION (400 over REST): the job has ended already
            job = await anyio.to_thread.run_sync(lambda: client.get_custom_job(name=identifier))
            if job.state.name in _FINAL:
                return
            raise
        with anyio.move_on_after(CANCEL_WAIT_SECONDS):
            while True:
                job = await anyio.to_thread.run_sync(lambda: client.get_custom_job(name=identifier))
                self._jobs[identifier] = job
                if job.state.name in _FINAL:
                    return
                await anyio.sleep(min(configuration.poll_seconds, 2.0))

    async def relaunch(
        self,
        flow_run: FlowRun,
        configuration: KineticVertexJobConfiguration,
        identifier: str,
        spec: accelerators.AcceleratorSpec,
        attempt: int,
        log: Callable[[str], None],
    ) -> str:
        """A new custom job for the same run on ``spec`` (the old one cancelled first: one run, one machine)."""
        await self.cancel(identifier, configuration, 0)
        await self.cleanup(identifier, configuration)
        configuration.accelerator, configuration.spot = capacity.label(spec.with_spot(False)), spec.spot
        if not configuration.image_given():
            configuration.image = None  # built (or found) again for this accelerator's family
        configuration.labels["kinetic.accelerator"] = spec.name
        return await self._create(flow_run, configuration, log, attempt)

    async def cleanup(self, identifier: str, configuration: KineticVertexJobConfiguration) -> None:
        self._logs.pop(identifier, None)
        run_id = self._run_ids.pop(identifier, None)
        if run_id is not None and run_id not in self._run_ids.values():  # a relaunch keeps the run's heartbeat
            await anyio.to_thread.run_sync(self.heartbeats.stop, run_id)

    async def host_spans(self, identifier: str, configuration: KineticVertexJobConfiguration) -> list[Any]:
        """The job's start and end as the last read saw them, once per host (metering)."""
        from kinetic_prefect.shared.cost import HostSpan

        job = self._jobs.get(identifier)
        if job is None or not job.start_time:
            return []
        end = job.end_time.timestamp() if job.end_time else None
        return [HostSpan(start=job.start_time.timestamp(), end=end) for _ in range(configuration.host_count)]

    async def unfinished_jobs(self, work_pool: Any) -> list[tuple[str, str]]:
        base: KineticVertexJobConfiguration = await KineticVertexJobConfiguration.from_template_and_values(
            work_pool.base_job_template, {}
        )
        client = await self.client(base)
        pool = gcp_label(work_pool.name)
        jobs = await anyio.to_thread.run_sync(
            lambda: list(
                client.list_custom_jobs(request={"parent": base.parent, "filter": f'labels.{POOL_LABEL}="{pool}"'})
            )
        )
        # finished jobs too: one that ended while no worker watched still has an outcome to collect
        return [
            (j.labels[FLOW_RUN_LABEL], str(j.name))
            for j in jobs
            if j.labels.get(POOL_LABEL) == pool and j.labels.get(FLOW_RUN_LABEL)
        ]

    # ------------------------------------------------------------------ images
    @staticmethod
    def ensure_image(
        configuration: KineticVertexJobConfiguration,
        log: Callable[[str], None],
        stop: threading.Event | None = None,
    ) -> str:
        """The hash-tagged image of the call's environment, as kinetic-gke makes it (Cloud Build or Docker); a set
        ``stop`` ends the build (``builders.BuildStopped``)."""
        if configuration.image:
            return configuration.image
        configuration.check_build_variables()  # a flow run made over the API has skipped the caller's checks
        spec = configuration.image_spec
        if configuration.image_builder == "docker" and configuration.image_repository:
            return builders.DockerBuilder(configuration.image_repository, stop=stop).ensure(spec, log)
        if configuration.image_builder == "cloud-build" and configuration.image_repository:
            from kinetic_prefect.shared import gcp

            credentials = None
            if configuration.gcp_credentials:
                block = anyio.from_thread.run(gcp.credentials_block, VERTEX_WORKER_TYPE, configuration.gcp_credentials)
                credentials = gcp.google_credentials(block)
            bucket = configuration.build_staging_bucket
            if not bucket:
                raise ValueError("kinetic-vertex builds with Cloud Build into build_staging_bucket, which is not set")
            return builders.CloudBuildBuilder(
                project=configuration.project,
                region=configuration.region,
                repository=configuration.image_repository,
                staging_bucket=bucket,
                credentials=credentials,
                stop=stop,
            ).ensure(spec, log)
        raise ValueError(
            "kinetic-vertex needs an image: pass image= to @kinetic_task, or set the pool's image_builder "
            "('cloud-build' or 'docker') and image_repository (e.g. us-docker.pkg.dev/PROJECT/REPO)."
        )
