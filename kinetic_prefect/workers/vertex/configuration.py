"""A kinetic-vertex job's configuration: prefect-gcp's ``VertexAIWorkerJobConfiguration`` plus the kinetic fields,
and the ``CustomJob`` request built from it with google-cloud-aiplatform's own types.

The request keeps prefect-gcp's ``job_spec`` (service account, network, reserved IP ranges, boot disk, web access,
``maximum_run_time_hours`` as the scheduling timeout) and adds what the catalog and the kinetic lifecycle decide:
the machine spec of the accelerator (``machines``), the runner's command, the job's environment (the kinetic wire
names, the call's forwarded values and the job's scoped signing keys; never the worker's Prefect settings), the
scheduling strategy (SPOT, FLEX_START) and reservation affinity, and for a group of hosts a second worker pool
whose replicas join host 0's ``jax.distributed`` group.
"""

from __future__ import annotations

import re
from typing import Any

from prefect.client.schemas.objects import FlowRun
from prefect_gcp.credentials import GcpCredentials
from prefect_gcp.workers.vertex import VertexAIWorkerJobConfiguration
from pydantic import Field, PrivateAttr, field_validator

from kinetic_prefect import accelerators
from kinetic_prefect.contract import JAX_COORDINATOR_PORT, Env
from kinetic_prefect.contract.job_variables import WORKER_ONLY_ENV, never_a_jobs
from kinetic_prefect.workers.base import KineticJobConfiguration
from kinetic_prefect.workers.vertex import machines

POOL_LABEL = "kinetic-pool"  # GCP label keys: lowercase letters, digits, '-' and '_'
FLOW_RUN_LABEL = "kinetic-flow-run"
_LABEL_CHARS = re.compile(r"[^a-z0-9_-]+")

# A group on Vertex: workerpool0 is host 0 (the coordinator), workerpool1's replicas are hosts 1..N-1. Vertex gives
# every replica the same container spec and tells it where it is in CLUSTER_SPEC (its pool and index, every pool's
# addresses); this program turns that into the group variables the runner reads, then runs the runner.
GROUP_BOOT = (
    "import json, os, sys\n"
    "spec = json.loads(os.environ['CLUSTER_SPEC'])\n"
    "task, cluster = spec['task'], spec['cluster']\n"
    "index = 0 if task['type'] == 'workerpool0' else 1 + int(task['index'])\n"
    "coordinator = cluster['workerpool0'][0].rsplit(':', 1)[0]\n"
    f"os.environ[{Env.HOST_INDEX!r}] = str(index)\n"
    f"os.environ[{Env.COORDINATOR_ADDRESS!r}] = coordinator + ':{JAX_COORDINATOR_PORT}'\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def gcp_label(value: object) -> str:
    """A GCP label value: lowercase, [a-z0-9_-], at most 63 characters."""
    return _LABEL_CHARS.sub("-", str(value).lower())[:63]


class KineticVertexJobConfiguration(KineticJobConfiguration, VertexAIWorkerJobConfiguration):
    region: str = Field(default="us-central1")
    credentials: GcpCredentials | None = Field(default=None)  # prefect-gcp's: a GcpCredentials() needs ADC
    image: str | None = Field(default=None)
    machine_type: str | None = Field(default=None)
    spot: bool = Field(default=False)
    flex_start: bool = Field(default=False)
    max_wait_duration_seconds: int | None = Field(default=None)
    reservation: str | None = Field(default=None)
    hosts: int | None = Field(default=None)
    gcp_project: str | None = Field(default=None)
    api_endpoint: str | None = Field(default=None)
    logging_endpoint: str | None = Field(default=None)
    image_builder: str = Field(default="none")
    image_repository: str | None = Field(default=None)
    build_staging_bucket: str | None = Field(default=None)
    poll_seconds: float = Field(default=5.0)
    stream_output: bool = Field(default=True)
    _image_given: bool | None = PrivateAttr(default=None)
    _pool_name: str | None = PrivateAttr(default=None)

    @field_validator("job_spec")
    @classmethod
    def _ensure_job_spec_includes_required_attributes(cls, value: dict[str, Any]) -> dict[str, Any]:
        """prefect-gcp requires a machine type in the job spec; here the catalog gives it when the pool names none,
        so only the worker pool list must be there."""
        if not value.get("worker_pool_specs"):
            raise ValueError("the job spec has no worker_pool_specs")
        return value

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """None of the worker's own Prefect settings (prefect-gcp passes them all, for a flow run in the job): a
        kinetic job runs no Prefect, and they hold the worker's API key."""
        return {}

    def _ensure_existence_of_service_account(self) -> None:
        """prefect-gcp requires a service account; Vertex runs a job without one as the project's Vertex AI Custom
        Code Service Agent, which is what a pool that names none gets here."""
        named = self.job_spec.get("service_account_name")
        from_block = getattr(self.credentials, "_service_account_email", None) if self.credentials else None
        self.job_spec["service_account_name"] = named or from_block

    def prepare_for_flow_run(
        self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None
    ):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        if work_pool is not None:
            self._pool_name = work_pool.name
        self.vertex_machine()  # an entry Vertex cannot run is refused before anything is built

    @property
    def accelerator_spec(self) -> accelerators.AcceleratorSpec:
        spec = self.asked_spec  # resolved once per run (prepare_for_flow_run); the pool's spot on top
        return spec.with_spot() if self.spot else spec

    @property
    def host_count(self) -> int:
        return accelerators.host_count(self.accelerator_spec, self.hosts)

    def image_given(self) -> bool:
        """Whether ``image`` was given (kept for every attempt) rather than built per accelerator family."""
        if self._image_given is None:
            self._image_given = bool(self.image)
        return self._image_given

    def vertex_machine(self) -> machines.VertexMachine:
        machine = machines.machine_for(self.asked_spec)
        if self.machine_type:  # the pool's own machine type; the accelerator still comes from the catalog
            machine = machines.VertexMachine(
                self.machine_type, machine.accelerator_type, machine.accelerator_count, machine.tpu_topology
            )
        return machine

    @property
    def project(self) -> str:
        if self.gcp_project:
            return self.gcp_project
        if self.credentials is not None and self.credentials.project:
            return str(self.credentials.project)
        raise ValueError("kinetic-vertex needs a project: set the pool's gcp_project (or a credentials block's)")

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.region}"

    def job_env(self) -> dict[str, str]:
        """The job's environment: the kinetic wire names and the call's values, then the worker's hand-over (the
        job's scoped signing keys, the forwarded env); never a Prefect setting of the worker's."""
        env = {k: str(v) for k, v in self.env.items() if v is not None and k not in WORKER_ONLY_ENV}
        env.update(self.secret_env)
        return {k: v for k, v in env.items() if not never_a_jobs(k)}

    def display_name(self, flow_run: FlowRun, attempt: int = 1) -> str:
        slug = re.sub(r"[^a-z0-9-]", "-", str(flow_run.name).lower())[:40].strip("-")
        return f"kinetic-{slug}-{flow_run.id.hex[:8]}" + (f"-a{attempt}" if attempt > 1 else "")

    def job_labels(self, flow_run: FlowRun) -> dict[str, str]:
        labels = {gcp_label(k).strip("-_") or "label": gcp_label(v) for k, v in self.labels.items()}
        labels[FLOW_RUN_LABEL] = str(flow_run.id)
        if self._pool_name:
            labels[POOL_LABEL] = gcp_label(self._pool_name)
        labels["kinetic-accelerator"] = gcp_label(self.accelerator_spec.name)
        return labels
