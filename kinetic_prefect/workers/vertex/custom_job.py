"""The ``CustomJob`` request of one attempt, in google-cloud-aiplatform's own types (``aiplatform_v1``).

prefect-gcp's ``job_spec`` (its template in the pool) is kept where it says something: the service account,
network, reserved IP ranges, boot disk, web and dashboard access, ``maximum_run_time_hours`` as the scheduling
timeout. What the kinetic lifecycle decides replaces the rest: the machine of the accelerator, the runner's command
and environment, Spot or flex-start, a reservation, and the replica pools of a group.
"""

from __future__ import annotations

from typing import Any

from google.cloud.aiplatform_v1 import types as vertex
from google.protobuf import duration_pb2  # type: ignore[import-untyped]
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect.contract import RUNNER_ARGV, Env
from kinetic_prefect.workers.vertex.configuration import GROUP_BOOT, KineticVertexJobConfiguration

RESERVATION_KEY = "compute.googleapis.com/reservation-name"  # ReservationAffinity's key for a named reservation


def machine_spec(configuration: KineticVertexJobConfiguration) -> vertex.MachineSpec:
    fields: dict[str, Any] = dict(configuration.vertex_machine().as_request_fields())
    if configuration.reservation:
        if configuration.accelerator_spec.spot:
            raise ValueError("a kinetic-vertex pool cannot use a reservation and spot at once")
        fields["reservation_affinity"] = vertex.ReservationAffinity(
            reservation_affinity_type=vertex.ReservationAffinity.Type.SPECIFIC_RESERVATION,
            key=RESERVATION_KEY,
            values=[configuration.reservation],
        )
    return vertex.MachineSpec(**fields)


def scheduling(configuration: KineticVertexJobConfiguration) -> vertex.Scheduling:
    """Prefect-gcp's ``scheduling`` dict and timeout, with the strategy Spot or flex-start sets. Vertex never
    restarts a kinetic job by itself: retries and preemptions belong to the lifecycle (one job, one attempt)."""
    given: dict[str, Any] = dict(configuration.job_spec.get("scheduling") or {})
    if isinstance(given.get("strategy"), str):
        given["strategy"] = getattr(vertex.Scheduling.Strategy, given["strategy"])
    hours = configuration.job_spec.get("maximum_run_time_hours")
    if hours:
        given["timeout"] = duration_pb2.Duration(seconds=int(float(hours) * 3600))
    if configuration.accelerator_spec.spot:
        given["strategy"] = vertex.Scheduling.Strategy.SPOT
    elif configuration.flex_start:
        given["strategy"] = vertex.Scheduling.Strategy.FLEX_START
        if configuration.max_wait_duration_seconds is not None:
            given["max_wait_duration"] = duration_pb2.Duration(seconds=configuration.max_wait_duration_seconds)
    given.update(restart_job_on_worker_restart=False, disable_retries=True)
    return vertex.Scheduling(**given)


def _container(configuration: KineticVertexJobConfiguration, group: bool) -> vertex.ContainerSpec:
    env = configuration.job_env()
    command = list(RUNNER_ARGV)
    if group:
        env[Env.NUM_HOSTS] = str(configuration.host_count)
        command = ["python", "-c", GROUP_BOOT, *command]
    return vertex.ContainerSpec(
        image_uri=configuration.image or "",
        command=command,
        env=[vertex.EnvVar(name=k, value=v) for k, v in sorted(env.items())],
    )


def worker_pools(configuration: KineticVertexJobConfiguration) -> list[vertex.WorkerPoolSpec]:
    """One pool of one replica; a group of N hosts adds a second pool of N-1 replicas (Vertex's layout for
    distributed training: the first pool is the primary replica)."""
    template = (configuration.job_spec.get("worker_pool_specs") or [{}])[0]
    disk = template.get("disk_spec") or {}
    hosts = configuration.host_count
    container = _container(configuration, group=hosts > 1)
    spec = machine_spec(configuration)

    def pool(replicas: int) -> vertex.WorkerPoolSpec:
        return vertex.WorkerPoolSpec(
            container_spec=container,
            machine_spec=spec,
            replica_count=replicas,
            disk_spec=vertex.DiskSpec(
                boot_disk_type=disk.get("boot_disk_type") or "pd-ssd",
                boot_disk_size_gb=int(disk.get("boot_disk_size_gb") or 100),
            ),
        )

    return [pool(1)] + ([pool(hosts - 1)] if hosts > 1 else [])


def custom_job(configuration: KineticVertexJobConfiguration, flow_run: FlowRun, attempt: int = 1) -> vertex.CustomJob:
    """The request that creates this run's job (attempt ``attempt``)."""
    spec = configuration.job_spec
    job_spec = vertex.CustomJobSpec(
        worker_pool_specs=worker_pools(configuration),
        scheduling=scheduling(configuration),
        service_account=spec.get("service_account_name") or "",
        network=spec.get("network") or "",
        reserved_ip_ranges=list(spec.get("reserved_ip_ranges") or []),
        enable_web_access=bool(spec.get("enable_web_access")),
        enable_dashboard_access=bool(spec.get("enable_dashboard_access")),
    )
    return vertex.CustomJob(
        display_name=configuration.display_name(flow_run, attempt),
        job_spec=job_spec,
        labels=configuration.job_labels(flow_run),
    )
