"""Provisioning, pure logic: the settings of ``up`` / ``pool add`` checked, the names they imply, the GKE requests.

Everything here runs before any request, so bad input fails with the culprit and its fix and nothing is made.
Names are derived, never random: a second ``up`` finds what the first made, which is what makes it idempotent.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from google.cloud import container_v1

from kinetic_prefect import accelerators
from kinetic_prefect.accelerators import AcceleratorSpec
from kinetic_prefect.contract import GKE_WORKER_TYPE
from kinetic_prefect.workers.gke.deploy import JOB_SERVICE_ACCOUNT
from kinetic_prefect.workers.provisioning import ProvisionError

DEFAULT_CLUSTER = "kinetic-cluster"
DEFAULT_WORK_POOL = GKE_WORKER_TYPE  # the pool `up` makes is named after its type
DEFAULT_NODE_MACHINE = "e2-standard-4"  # the cluster's own pool: system pods, the worker, cpu jobs
GPU_POOL_HEADROOM = 10  # a GPU or single-host TPU pool grows to --min-nodes + this many nodes
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
RESERVATION_KEY = "compute.googleapis.com/reservation-name"
ACCELERATOR_NODE_LABEL = "kinetic-prefect.io/accelerator"
STORE_PREFIX = "kinetic-prefect"
DEFAULT_NAMESPACE = "kinetic"  # kinetic's own, enforcing the restricted Pod Security Standard
WORKER_SERVICE_ACCOUNT = "kinetic-gke-worker"  # workers.gke.deploy.worker_manifests' default name
BUCKET_ROLE = "roles/storage.objectUser"  # read, write and delete objects: the store, and Cloud Build's contexts

_PROJECT_RE = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
_ZONE_RE = re.compile(r"([a-z]+-[a-z]+[0-9]+)-[a-z]")
_GKE_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")  # clusters and node pools: 40 characters
_BUCKET_MAX = 63


@dataclass(frozen=True)
class NodePoolSpec:
    """One accelerator node pool: what it runs and how it scales."""

    accelerator: AcceleratorSpec
    min_nodes: int = 0
    reservation: str | None = None
    preload_disk_image: str | None = None  # a disk image of container images, the nodes' secondary boot disk

    @property
    def name(self) -> str:
        name = f"kp-{self.accelerator.name}" + ("-spot" if self.accelerator.spot else "")
        if self.reservation:  # two pools of one accelerator, one bound to a reservation, get two names
            name += "-r" + hashlib.sha1(self.reservation.encode()).hexdigest()[:4]
        return name

    @property
    def max_nodes(self) -> int:
        # A multi-host slice's pool is the slice: GKE makes all its hosts together, never part of it.
        spec = self.accelerator
        return spec.hosts if spec.multi_host else self.min_nodes + GPU_POOL_HEADROOM


@dataclass(frozen=True)
class Settings:
    """What ``up`` was asked for, checked (:func:`settings`)."""

    project: str
    zone: str
    cluster: str = DEFAULT_CLUSTER
    node_pools: tuple[NodePoolSpec, ...] = ()
    work_pool: str = DEFAULT_WORK_POOL
    worker_image: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    job_service_account: str = JOB_SERVICE_ACCOUNT
    labels: dict[str, str] = field(default_factory=lambda: {"kinetic-prefect": "true"})

    @property
    def region(self) -> str:
        return region_of(self.zone)

    @property
    def location_path(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def cluster_path(self) -> str:
        return f"{self.location_path}/clusters/{self.cluster}"

    @property
    def repository_id(self) -> str:
        return f"kn-{self.cluster}"  # the names Keras Kinetic's `up` gives: its resources are found, not doubled

    @property
    def repository_path(self) -> str:
        return f"projects/{self.project}/locations/{self.region}/repositories/{self.repository_id}"

    @property
    def image_repository(self) -> str:
        return f"{self.region}-docker.pkg.dev/{self.project}/{self.repository_id}"

    @property
    def bucket(self) -> str:
        return f"{self.project}-kn-{self.cluster}-jobs"

    @property
    def store(self) -> str:
        return f"gs://{self.bucket}/{STORE_PREFIX}"

    @property
    def workload_pool(self) -> str:
        return f"{self.project}.svc.id.goog"

    def bucket_members(self, project_number: int | str) -> list[str]:
        """The Workload Identity principals given the bucket: the job pods' ServiceAccount, and the in-cluster
        worker's when ``up`` deploys one (it reads outcomes and uploads build contexts); never the namespace's
        every account (a principalSet), nor ``default``'s."""
        accounts = [self.job_service_account] + ([WORKER_SERVICE_ACCOUNT] if self.worker_image else [])
        return [
            f"principal://iam.googleapis.com/projects/{project_number}/locations/global/workloadIdentityPools/"
            f"{self.workload_pool}/subject/ns/{self.namespace}/sa/{account}"
            for account in accounts
        ]

    @property
    def kube_context(self) -> str:
        return f"gke_{self.project}_{self.zone}_{self.cluster}"  # what `gcloud ... get-credentials` names it

    def pool_defaults(self) -> dict[str, Any]:
        """The kinetic-gke pool's job variables that point at what ``up`` made."""
        return {
            "gcp_project": self.project,
            "gcp_region": self.region,
            "image_repository": self.image_repository,
            "image_builder": "cloud-build",
            "build_staging_bucket": self.bucket,
            "store": self.store,
            "kube_context": self.kube_context,
            "namespace": self.namespace,
            "service_account_name": self.job_service_account,
        }


def region_of(zone: str) -> str:
    match = _ZONE_RE.fullmatch(zone or "")
    if not match:
        raise ProvisionError(f"--zone {zone!r} is not a zone: give one like us-central1-a (its region: us-central1)")
    return match.group(1)


_DISK_IMAGE_RE = re.compile(
    r"((projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/)?global/images/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
)


def check_project(project: str | None) -> str:
    if not project:
        raise ProvisionError(
            "no project: give --project PROJECT_ID (or set GOOGLE_CLOUD_PROJECT); `gcloud projects list` shows yours"
        )
    if not _PROJECT_RE.fullmatch(project):
        raise ProvisionError(
            f"--project {project!r} is not a project ID (6-30 lowercase letters, digits, hyphens; the ID, not the "
            "display name or number): `gcloud projects list` shows the IDs"
        )
    return project


def check_gke_name(option: str, name: str) -> str:
    if not _GKE_NAME_RE.fullmatch(name or ""):
        raise ProvisionError(
            f"{option} {name!r}: GKE names are 1-40 lowercase letters, digits and hyphens, starting with a letter "
            "and not ending with a hyphen"
        )
    return name


def check_disk_image(image: str) -> str:
    """``--preload-disk-image``: a Compute Engine disk image as ``node_pool_request`` names it
    (``projects/P/global/images/NAME`` or ``global/images/NAME``; a bare NAME is this project's)."""
    if _DISK_IMAGE_RE.fullmatch(image):
        return image if "/" in image else f"global/images/{image}"
    raise ProvisionError(
        f"--preload-disk-image {image!r}: give a disk image made with GKE's disk image builder, as NAME, "
        "global/images/NAME or projects/PROJECT/global/images/NAME"
    )


def node_pool_spec(
    name: str,
    *,
    spot: bool = False,
    reservation: str | None = None,
    min_nodes: int = 0,
    preload_disk_image: str | None = None,
) -> NodePoolSpec:
    """The node pool for an accelerator name, or :class:`ProvisionError` naming what cannot work."""
    try:
        spec = accelerators.resolve(name)
    except accelerators.UnknownAcceleratorError as exc:
        raise ProvisionError(f"--accelerator: {exc}") from None
    if spec.family == "cpu":
        raise ProvisionError(
            f"--accelerator {name!r}: cpu jobs run on the cluster's own {DEFAULT_NODE_MACHINE} pool, which `up` "
            "makes; a node pool is for a GPU or TPU (`kinetic-prefect accelerators` lists them)"
        )
    spec = spec.with_spot(spec.spot or spot)
    if reservation and spec.spot:
        raise ProvisionError(
            f"--reservation {reservation!r} with Spot ({name!r}): a reservation's VMs are not Spot VMs; drop --spot "
            "(or :spot) to use the reservation, or drop --reservation for Spot capacity"
        )
    if min_nodes < 0:
        raise ProvisionError(f"--min-nodes {min_nodes}: give 0 (scale to zero when idle) or more")
    if spec.multi_host and min_nodes not in (0, spec.hosts):
        raise ProvisionError(
            f"--min-nodes {min_nodes} for {spec.name}: its pool is one slice of {spec.hosts} hosts, made whole or "
            f"not at all; give --min-nodes 0 (made when a job needs it) or {spec.hosts} (kept running)"
        )
    if spec.multi_host and spec.gke_accelerator == "tpu7x":
        raise ProvisionError(
            f"--accelerator {spec.name}: GKE makes multi-host TPU7x pools from a workload policy, which `up` does not "
            "create; make it with `gcloud compute resource-policies create workload-policy` and the node pool with "
            "`gcloud container node-pools create --placement-policy` (docs/gke.md, the manual way)"
        )
    preload = check_disk_image(preload_disk_image) if preload_disk_image else None
    pool = NodePoolSpec(spec, min_nodes, reservation or None, preload)
    check_gke_name("node pool", pool.name)
    return pool


def settings(
    project: str | None,
    zone: str,
    cluster: str = DEFAULT_CLUSTER,
    accelerator_names: list[str] | tuple[str, ...] = (),
    *,
    spot: bool = False,
    reservation: str | None = None,
    min_nodes: int = 0,
    work_pool: str | None = DEFAULT_WORK_POOL,
    worker_image: str | None = None,
) -> Settings:
    """``up``'s options checked together; raises :class:`ProvisionError` before anything is asked of Google.
    ``work_pool`` None: DEFAULT_WORK_POOL."""
    work_pool = work_pool or DEFAULT_WORK_POOL
    check_project(project)
    assert project is not None
    region_of(zone)
    check_gke_name("--cluster", cluster)
    pools = [node_pool_spec(n, spot=spot, reservation=reservation, min_nodes=min_nodes) for n in accelerator_names]
    result = Settings(project, zone, cluster, tuple(dict.fromkeys(pools)), work_pool, worker_image)
    if len(result.bucket) > _BUCKET_MAX:
        raise ProvisionError(
            f"the store bucket's name {result.bucket!r} is over {_BUCKET_MAX} characters: give a shorter --cluster"
        )
    return result


# ------------------------------------------------------------------------------------------------ GKE requests


def _node_config(pool: NodePoolSpec) -> container_v1.NodeConfig:
    spec = pool.accelerator
    config = container_v1.NodeConfig(
        machine_type=spec.machine_type,
        oauth_scopes=[CLOUD_PLATFORM],
        # Pods get their own identity (Workload Identity), never the node's service account.
        workload_metadata_config=container_v1.WorkloadMetadataConfig(
            mode=container_v1.WorkloadMetadataConfig.Mode.GKE_METADATA
        ),
        labels={ACCELERATOR_NODE_LABEL: spec.name},
        spot=spec.spot,
        # Image streaming: a pod starts before its image is all on the node (images in Artifact Registry; the
        # Container File System API on). https://cloud.google.com/kubernetes-engine/docs/how-to/image-streaming
        gcfs_config=container_v1.GcfsConfig(enabled=True),
    )
    if pool.preload_disk_image:  # images already on the node: https://cloud.google.com/kubernetes-engine/docs/
        # how-to/data-container-image-preloading (a disk image made with gke-disk-image-builder)
        config.secondary_boot_disks = [
            container_v1.SecondaryBootDisk(
                disk_image=pool.preload_disk_image, mode=container_v1.SecondaryBootDisk.Mode.CONTAINER_IMAGE_CACHE
            )
        ]
    if spec.family == "gpu":  # a TPU machine type carries its chips; a GPU is attached to the VM
        config.accelerators = [
            container_v1.AcceleratorConfig(
                accelerator_type=spec.gke_accelerator,
                accelerator_count=spec.chips_per_host,
                gpu_driver_installation_config=container_v1.GPUDriverInstallationConfig(
                    gpu_driver_version=container_v1.GPUDriverInstallationConfig.GPUDriverVersion.DEFAULT
                ),
            )
        ]
    if pool.reservation:
        config.reservation_affinity = container_v1.ReservationAffinity(
            consume_reservation_type=container_v1.ReservationAffinity.Type.SPECIFIC_RESERVATION,
            key=RESERVATION_KEY,
            values=[pool.reservation],
        )
    return config


def node_pool_request(pool: NodePoolSpec) -> container_v1.NodePool:
    """The node pool GKE is asked to create: autoscaling from ``min_nodes`` (0: none until a job needs one)."""
    request = container_v1.NodePool(
        name=pool.name,
        initial_node_count=pool.min_nodes,
        config=_node_config(pool),
        autoscaling=container_v1.NodePoolAutoscaling(
            enabled=True, min_node_count=pool.min_nodes, max_node_count=pool.max_nodes
        ),
        management=container_v1.NodeManagement(auto_repair=True, auto_upgrade=True),
    )
    if pool.accelerator.multi_host:  # the slice's hosts placed together, with the topology the pods select
        request.placement_policy = container_v1.NodePool.PlacementPolicy(
            type_=container_v1.NodePool.PlacementPolicy.Type.COMPACT, tpu_topology=pool.accelerator.tpu_topology
        )
    return request


def cluster_request(settings: Settings) -> container_v1.Cluster:
    """The cluster: Workload Identity (pods reach the bucket as themselves), the GCS FUSE CSI driver (Data
    mounts), and one small always-on pool for the system pods, the worker and cpu jobs."""
    return container_v1.Cluster(
        name=settings.cluster,
        description="kinetic-prefect: jobs of the kinetic-gke work pool",
        resource_labels=dict(settings.labels),
        node_pools=[
            container_v1.NodePool(
                name="default-pool",
                initial_node_count=1,
                config=container_v1.NodeConfig(
                    machine_type=DEFAULT_NODE_MACHINE,
                    oauth_scopes=[CLOUD_PLATFORM],
                    workload_metadata_config=container_v1.WorkloadMetadataConfig(
                        mode=container_v1.WorkloadMetadataConfig.Mode.GKE_METADATA
                    ),
                ),
                autoscaling=container_v1.NodePoolAutoscaling(enabled=True, min_node_count=1, max_node_count=3),
            )
        ],
        workload_identity_config=container_v1.WorkloadIdentityConfig(workload_pool=f"{settings.project}.svc.id.goog"),
        addons_config=container_v1.AddonsConfig(
            gcs_fuse_csi_driver_config=container_v1.GcsFuseCsiDriverConfig(enabled=True)
        ),
        release_channel=container_v1.ReleaseChannel(channel=container_v1.ReleaseChannel.Channel.REGULAR),
    )


def cluster_shortfalls(cluster: Any, project: str) -> list[str]:
    """What an existing cluster lacks that kinetic jobs use, each with its fix (``up`` never changes a cluster)."""
    missing = []
    if cluster.workload_identity_config.workload_pool != f"{project}.svc.id.goog":
        missing.append(
            f"Workload Identity is off: `gcloud container clusters update {cluster.name} --location "
            f"{cluster.location} --workload-pool={project}.svc.id.goog`"
        )
    if not cluster.addons_config.gcs_fuse_csi_driver_config.enabled:
        missing.append(
            f"the GCS FUSE CSI driver is off: `gcloud container clusters update {cluster.name} --location "
            f"{cluster.location} --update-addons GcsFuseCsiDriver=ENABLED`"
        )
    return missing


def accelerator_of(node_pool: Any) -> AcceleratorSpec | None:
    """The catalog entry a node pool runs (ours or one made by hand or by Keras Kinetic), from its machine type,
    attached GPUs and TPU topology; None for a pool of no catalog accelerator (the default pool)."""
    config = node_pool.config
    attached = list(config.accelerators)
    topology = node_pool.placement_policy.tpu_topology if node_pool.placement_policy else ""
    for spec in accelerators.catalog():
        if spec.machine_type != config.machine_type or spec.family == "cpu":
            continue
        if spec.family == "gpu":
            if (
                attached
                and attached[0].accelerator_type == spec.gke_accelerator
                and attached[0].accelerator_count == spec.chips_per_host
            ):
                return spec.with_spot(config.spot)
        elif (topology and spec.tpu_topology == topology) or (not topology and not spec.multi_host):
            return spec.with_spot(config.spot)
    return None
