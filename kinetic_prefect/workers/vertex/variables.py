"""Worker side, ``kinetic-vertex``: the pool's variables (its form).

prefect-gcp's ``VertexAIWorkerVariables`` under the kinetic ``PoolVariables`` and ``ImageBuildVariables``: a
prefect-gcp user finds every setting they know (region, service account, network, boot disk, scheduling, web
access ...). Changed: ``image`` is optional
(built from the call's environment like kinetic-gke's), the machine fields default to the catalog's entry for the
accelerator, and ``credentials`` defaults to none (prefect-gcp makes a ``GcpCredentials()`` there, which needs
Application Default Credentials on every machine that merely reads the form).
"""

from __future__ import annotations

from typing import ClassVar

from prefect_gcp.credentials import GcpCredentials
from prefect_gcp.workers.vertex import VertexAIWorkerVariables
from pydantic import Field

from kinetic_prefect.contract.job_variables import CALLER_VARIABLES, ImageBuildVariables, PoolVariables

_THEIRS = VertexAIWorkerVariables.model_fields


class KineticVertexVariables(PoolVariables, ImageBuildVariables, VertexAIWorkerVariables):
    """``kinetic-vertex``: jobs as Vertex AI custom jobs on the machine the accelerator names."""

    # What a call may set: the kinetic list and a prebuilt image (@kinetic_task(image=...)); the pool pins the rest
    # (region, project, service account, network, the image builder, scheduling ...).
    caller_variables: ClassVar[frozenset[str]] = CALLER_VARIABLES | {"image"}

    region: str = Field(
        default="us-central1",
        title="Region",
        description="The region where the Vertex AI custom jobs run (and their machines' prices apply).",
    )
    image: str | None = Field(
        default=None,
        title="Image",
        description="A prebuilt image with the job's environment. Empty: built from the ImageSpec tag by "
        "image_builder and pushed to image_repository (Vertex must be able to pull it: Artifact Registry).",
    )
    credentials: GcpCredentials | None = Field(
        default=None,
        title="GCP Credentials (block)",
        description="A saved prefect-gcp GcpCredentials block the worker creates and reads jobs with. Empty: "
        "gcp_credentials below, else Application Default Credentials.",
    )
    machine_type: str | None = Field(
        default=None,
        title="Machine Type",
        description="Empty: the catalog's machine for the accelerator (kinetic_prefect.workers.vertex.machines). "
        "Set: this machine type for every job (the accelerator type and count still come from the catalog).",
    )
    accelerator_type: str | None = Field(
        default=None,
        title="Accelerator Type",
        description="Leave empty: the catalog decides it from `accelerator`.",
    )
    accelerator_count: int | None = Field(
        default=None,
        title="Accelerator Count",
        description="Leave empty: the catalog decides it from `accelerator`.",
    )
    maximum_run_time_hours: int = _THEIRS["maximum_run_time_hours"]
    accelerator: str = Field(
        default="cpu",
        title="Accelerator",
        description="Accelerator name from the kinetic catalog (`l4`, `a100x2`, `h100x8`, `tpu-v5litepod-4`, ...), "
        "mapped to a Vertex machine spec; an entry Vertex cannot run is refused with the nearest one it can. A "
        "comma-separated list is a fallback list, tried in order.",
    )
    spot: bool = Field(
        default=False,
        title="Spot",
        description="Scheduling strategy SPOT: Spot VMs at Spot prices; a preempted job is retried "
        "(preemption_retries), resuming from its checkpoints.",
    )
    flex_start: bool = Field(
        default=False,
        title="Flex-start",
        description="Scheduling strategy FLEX_START (Dynamic Workload Scheduler): the job waits up to "
        "max_wait_duration for its capacity instead of failing.",
    )
    max_wait_duration_seconds: int | None = Field(
        default=None,
        title="Flex-start maximum wait (seconds)",
        ge=0,
        description="Scheduling.max_wait_duration of a flex-start job. Empty: Vertex's default.",
    )
    reservation: str | None = Field(
        default=None,
        title="Reservation",
        description="A Compute Engine reservation the jobs consume (SPECIFIC_RESERVATION): "
        "projects/PROJECT/zones/ZONE/reservations/NAME. Not with spot.",
    )
    gcp_project: str | None = Field(
        default=None,
        title="GCP project",
        description="Project of the custom jobs (and of Cloud Build). Empty: the credentials' project.",
    )
    api_endpoint: str | None = Field(
        default=None,
        title="API endpoint",
        description="Vertex AI's endpoint. Empty: REGION-aiplatform.googleapis.com. An http:// address is a local "
        "stand-in: reached over REST with anonymous credentials, never the worker's.",
    )
    logging_endpoint: str | None = Field(
        default=None,
        title="Cloud Logging endpoint",
        description="Where the jobs' output is read (entries.list). Empty: https://logging.googleapis.com.",
    )
    poll_seconds: float = Field(
        default=5.0,
        title="Poll interval",
        description="Seconds between reads of a running custom job (its state and new output lines).",
    )
    store: str | None = Field(
        default=None,
        title="Artifact store",
        description="Where payloads, results and outputs live: gs://bucket/prefix (the job's service account must "
        "reach it).",
    )
