"""Worker side, ``kinetic-gke``: the pool's variables (its form) and the Job manifest its template starts from.

prefect-kubernetes' own fields are reused as they are (same name, type, title and text), so a prefect-kubernetes
user finds every setting they know; ``backoff_limit`` alone is left out: one Job is one attempt.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Literal

from prefect_kubernetes.credentials import KubernetesClusterConfig
from prefect_kubernetes.worker import KubernetesWorkerVariables
from pydantic import Field

from kinetic_prefect.contract.job_variables import (
    CALLER_VARIABLES,
    ImageBuildVariables,
    PoolVariables,
    WarmVariables,
)
from kinetic_prefect.workers.gke.kube import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT

# Retries belong to Prefect: a failed Job is never restarted by Kubernetes (a group fails all or nothing).
JOB_BACKOFF_LIMIT = 0
MANAGED_BY = {"app.kubernetes.io/managed-by": "kinetic-prefect"}
CONTAINER = "prefect-job"  # prefect-kubernetes' manifest validation requires its container name
_THEIRS = KubernetesWorkerVariables.model_fields


def job_manifest_template() -> dict[str, Any]:
    """The ``job_manifest`` of the pool's template: placeholders for the variables the manifest takes, and the Pod
    Security Standards' restricted settings every job pod runs with (shown, so the pool's form says so)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"namespace": "{{ namespace }}", "labels": dict(MANAGED_BY), "annotations": "{{ annotations }}"},
        "spec": {
            "backoffLimit": JOB_BACKOFF_LIMIT,
            "template": {
                "metadata": {"labels": dict(MANAGED_BY)},
                "spec": {
                    "parallelism": 1,
                    "completions": 1,
                    "restartPolicy": "Never",
                    "serviceAccountName": "{{ service_account_name }}",
                    "automountServiceAccountToken": False,
                    "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
                    "containers": [
                        {
                            "name": CONTAINER,
                            "image": "{{ image }}",
                            "imagePullPolicy": "{{ image_pull_policy }}",
                            "resources": {"limits": {"cpu": "{{ cpu_limit }}", "memory": "{{ memory_limit }}"}},
                            "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
                        }
                    ],
                },
            },
            "activeDeadlineSeconds": "{{ job_watch_timeout_seconds }}",
            "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
        },
    }


class KineticGKEVariables(PoolVariables, WarmVariables, ImageBuildVariables):
    """``kinetic-gke``: jobs as Kubernetes Jobs on GKE node pools with the named accelerator."""

    # What a call may set on this pool: the kinetic list, a prebuilt image (@kinetic_task(image=...)) and the FUSE
    # volumes of its Data(fuse=True); the pool pins the rest (namespace, service_account_name, cluster_config, the
    # image builder, annotations, resources, scheduling...)
    caller_variables: ClassVar[frozenset[str]] = CALLER_VARIABLES | {"image", "gcs_fuse_mounts"}

    annotations: dict[str, str] = _THEIRS["annotations"]
    namespace: str = Field(default="default", title="Namespace", description="Kubernetes namespace of the Jobs.")
    image: str | None = Field(
        default=None,
        title="Image",
        description="A prebuilt image with the job's environment. Empty: built from the ImageSpec tag by "
        "image_builder.",
    )
    service_account_name: str | None = Field(
        default=None,
        title="Service account",
        description="Kubernetes service account of the job pods (Workload Identity gives it GCS access).",
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = _THEIRS["image_pull_policy"]
    finished_job_ttl: int | None = Field(
        default=3600,
        title="Finished Job TTL",
        description="ttlSecondsAfterFinished: the cluster deletes a finished Job (its pod and env Secret with it) "
        "after this many seconds.",
    )
    job_watch_timeout_seconds: int | None = Field(
        default=None,
        title="Job Watch Timeout Seconds",
        description="activeDeadlineSeconds of the Job: the cluster stops the job after this many seconds, even with "
        "no worker watching. Empty: no limit.",
    )
    pod_watch_timeout_seconds: int = Field(
        default=600,
        title="Pod Watch Timeout Seconds",
        description="How long the pod may stay Pending (no node pool, no capacity, image pulling) before the run "
        "fails with the scheduler's reason. GPU/TPU node pools scale up in minutes, hence 600, not "
        "prefect-kubernetes' 60.",
    )
    provisioning_timeout_seconds: int | None = Field(
        default=None,
        title="Provisioning timeout seconds",
        ge=0,
        description="How long a node the cluster autoscaler is adding for a pod (its TriggeredScaleUp event) may "
        "take to join. That time counts here, not toward pod_watch_timeout_seconds or capacity_wait_seconds: a "
        "node pool at zero nodes and a TPU slice coming up are waited for. Then the next accelerator of a fallback "
        "list is tried, or the run fails. Empty: 900 (the autoscaler's own max-node-provision-time), 1800 for TPUs.",
    )
    cluster_config: KubernetesClusterConfig | None = Field(
        default=None,
        title="Cluster config",
        description="A saved KubernetesClusterConfig block (prefect-kubernetes): the cluster the Jobs run in. Empty: "
        "kubeconfig_path / kube_context below, else in-cluster credentials, else ~/.kube/config.",
    )
    cpu_request: str | None = Field(
        default=None, title="CPU request", description="CPU request of the job container, e.g. '4'."
    )
    cpu_limit: str | None = _THEIRS["cpu_limit"]
    memory_request: str | None = Field(default=None, title="Memory request", description="Memory request, e.g. '16Gi'.")
    memory_limit: str | None = _THEIRS["memory_limit"]
    accelerator: str = Field(
        default="cpu",
        title="Accelerator",
        description="Accelerator name from the kinetic catalog (`l4`, `a100x2`, `h100x8`, `tpu-v6e-8`, "
        "`tpu-v5litepod-4`, ...). Decides the node selector, tolerations and accelerator limits. A "
        "comma-separated list (`tpu-v6e-8,a100x4,l4x4`) is a fallback list, tried in order.",
    )
    reservation: str | None = Field(
        default=None,
        title="Reservation",
        description="A Compute Engine reservation (specific affinity) the first accelerator's pods consume: node "
        "selectors cloud.google.com/reservation-name and cloud.google.com/reservation-affinity=specific. "
        "Not with spot.",
    )
    reservation_project: str | None = Field(
        default=None,
        title="Reservation project",
        description="The project owning a shared reservation (cloud.google.com/reservation-project); empty: the "
        "cluster's project.",
    )
    flex_start: bool = Field(
        default=False,
        title="Flex-start",
        description="Run on flex-start VMs (Dynamic Workload Scheduler): node selector "
        "cloud.google.com/gke-flex-start=true. The pod waits for capacity instead of failing; raise "
        "pod_watch_timeout_seconds to match.",
    )
    queued_provisioning: str | None = Field(
        default=None,
        title="Queued provisioning (Kueue queue)",
        description="Name of a Kueue LocalQueue backed by flex-start with queued provisioning: the Job is created "
        "suspended with kueue.x-k8s.io/queue-name, and starts when all its capacity is provisioned at "
        "once. Waiting in the queue does not count toward pod_watch_timeout_seconds.",
    )
    install_requirements_at_start: bool = Field(
        default=False,
        title="Install requirements when the pod starts",
        description="Kinetic's prebuilt mode: the image holds the runner alone (one image per Python version and "
        "base image, built once), and each pod pip-installs the call's requirements as it starts. No build when "
        "requirements change, at the price of an install in every pod; for requirements that change often.",
    )
    hold_node_during_build: bool = Field(
        default=True,
        title="Ask for the node while the image builds",
        description="While a job's image builds, a placeholder Job of the lowest priority that still makes the "
        "cluster autoscaler scale up (PriorityClass kinetic-placeholder: gke-worker-manifests has it, a caller "
        "submitting in-process makes it) asks for the job's node; it is deleted before the job's Job is created. A "
        "cold call then waits for the longer of the build and the scale-up, not for both.",
    )
    spot: bool = Field(
        default=False,
        title="Spot",
        description="Schedule on Spot VMs (cloud.google.com/gke-spot node selector and toleration).",
    )
    hosts: int | None = Field(
        default=None,
        title="Hosts",
        ge=1,
        description="Pods in one job's group (data parallelism over several nodes; host 0 is the coordinator). A "
        "multi-host TPU slice (tpu-v5litepod-16, ...) sets its own count. Empty: one pod.",
    )
    gcp_project: str | None = Field(
        default=None, title="GCP project", description="Project for Cloud Build and Artifact Registry."
    )
    gcp_region: str | None = Field(
        default=None, title="GCP region", description="Region of Cloud Build and the Artifact Registry repository."
    )
    ephemeral_storage_request: str | None = Field(
        default=None,
        title="Ephemeral storage request",
        description="Local disk request, e.g. '50Gi' (datasets downloaded to the node).",
    )
    shm_size: str | None = Field(
        default=None,
        title="Shared memory size",
        description="Size of /dev/shm (a memory-backed emptyDir) for data loaders, e.g. '8Gi'. Empty: the 64 MiB "
        "default.",
    )
    gcs_fuse_mounts: dict[str, str] = Field(
        default={},
        title="Cloud Storage FUSE mounts",
        description="Set per call by the caller for Data(..., fuse=True): mount id -> gs://bucket/dir, each a "
        "read-only Cloud Storage FUSE CSI ephemeral volume at /_kinetic/fuse-data/<id>. Needs the GcsFuseCsiDriver "
        "add-on and a service account that may read the buckets (Workload Identity). Leave empty on the pool.",
    )
    poll_seconds: float = Field(
        default=2.0, title="Poll interval", description="Seconds between status checks of a running Job."
    )
    kubeconfig_path: str | None = Field(
        default=None, title="Kubeconfig", description="Used only without cluster_config: path of a kubeconfig file."
    )
    kube_context: str | None = Field(
        default=None, title="Kube context", description="Used only without cluster_config: context in kubeconfig_path."
    )
    store: str | None = Field(
        default=None,
        title="Artifact store",
        description="Where payloads, results and outputs live: gs://bucket/prefix (job pods must reach it).",
    )
