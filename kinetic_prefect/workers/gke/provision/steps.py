"""Provisioning, the requests: each resource looked up, then created (``up``) or deleted (``down``), in order.

A plan is a list of :class:`Step` (``workers.provisioning``, the framework every platform shares): what the
resource is, whether it exists, and what applying the plan does to it. Only the steps that change something carry
an action, so a second ``up`` makes no create request at all and an ``up`` that failed halfway resumes with what is
still missing. GKE's long-running operations are waited on here, with their progress reported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from google.api_core import exceptions as google_errors
from google.cloud import artifactregistry_v1, container_v1

from kinetic_prefect import config
from kinetic_prefect.contract import GKE_WORKER_TYPE
from kinetic_prefect.workers.gke.deploy import namespace_manifests, worker_manifests
from kinetic_prefect.workers.gke.provision import plan
from kinetic_prefect.workers.gke.provision.plan import NodePoolSpec, ProvisionError, Settings
from kinetic_prefect.workers.provisioning import (  # the step framework every platform shares
    ABSENT,
    CREATE,
    DELETE,
    EXISTS,
    KEEP,
    SKIP,
    UPDATE,
    Step,
)

POOL_TYPE = GKE_WORKER_TYPE
WORKER_NAME = plan.WORKER_SERVICE_ACCOUNT
API_SECRET = "prefect-api"


class ClusterAccess(Protocol):
    """The new cluster's Kubernetes API, for what only it knows (``cluster_access.KubeClusterAccess``)."""

    def worker_exists(self, cluster: Any, namespace: str) -> bool: ...

    def namespace_exists(self, cluster: Any, namespace: str) -> bool: ...

    def apply(self, cluster: Any, manifests: list[dict[str, Any]]) -> None: ...

    def deploy_worker(self, cluster: Any, manifests: list[dict[str, Any]], api: dict[str, str]) -> None: ...

    def node_counts(self, cluster: Any) -> dict[str, int]: ...


@dataclass
class Clients:
    """The Google clients (``google-cloud-container``, ``-artifact-registry``, ``-storage``), the cluster's
    Kubernetes access and Prefect's client; tests inject fakes that record the requests."""

    container: Any
    registry: Any
    storage: Any
    clusters: ClusterAccess | None = None
    prefect: Callable[[], Any] | None = None  # a context manager giving a sync Prefect client
    sleep: Callable[[float], None] = time.sleep
    poll_seconds: float = 10.0
    say: Callable[[str], None] = print

    @contextlib.contextmanager
    def prefect_client(self) -> Iterator[Any]:
        if self.prefect is not None:
            with self.prefect() as client:
                yield client
            return
        from prefect import get_client

        with get_client(sync_client=True) as client:
            yield client


# ------------------------------------------------------------------------------------------------ GKE


def wait(clients: Clients, settings: Settings, operation: Any, what: str) -> None:
    """Wait for a GKE operation, saying where it is now and then; raises when it ends in an error."""
    name = f"{settings.location_path}/operations/{operation.name}"
    started = time.monotonic()
    while operation.status != container_v1.Operation.Status.DONE:
        clients.sleep(clients.poll_seconds)
        operation = clients.container.get_operation(name=name)
        elapsed = int(time.monotonic() - started)
        clients.say(f"  {what}: {operation.status.name.lower()} ({elapsed // 60} min {elapsed % 60} s)")
    error = operation.error.message if operation.error else ""
    if error or operation.status_message:
        raise ProvisionError(f"{what}: GKE says {error or operation.status_message}")


def find_cluster(clients: Clients, settings: Settings) -> Any | None:
    try:
        return clients.container.get_cluster(name=settings.cluster_path)
    except google_errors.NotFound:
        return None


def node_pools(clients: Clients, settings: Settings) -> dict[str, Any]:
    response = clients.container.list_node_pools(parent=settings.cluster_path)
    return {pool.name: pool for pool in response.node_pools}


def cluster_step(clients: Clients, settings: Settings, cluster: Any | None) -> Step:
    if cluster is not None:
        shortfalls = plan.cluster_shortfalls(cluster, settings.project)
        note = "; ".join(shortfalls) if shortfalls else f"{cluster.status.name.lower()}, {cluster.location}"
        return Step("cluster", settings.cluster, EXISTS, note)

    def create() -> None:
        request = plan.cluster_request(settings)
        operation = clients.container.create_cluster(parent=settings.location_path, cluster=request)
        wait(clients, settings, operation, f"cluster {settings.cluster}")

    return Step("cluster", settings.cluster, CREATE, f"{settings.zone}, Workload Identity, GCS FUSE", create)


def describe_pool(pool: NodePoolSpec) -> str:
    spec = pool.accelerator
    shape = f"{spec.machine_type}" + (f", {spec.hosts} hosts {spec.tpu_topology}" if spec.multi_host else "")
    extra = ", spot" if spec.spot else ""
    extra += f", reservation {pool.reservation}" if pool.reservation else ""
    return f"{spec.name} ({shape}{extra}), {pool.min_nodes}..{pool.max_nodes} nodes"


def node_pool_step(clients: Clients, settings: Settings, pool: NodePoolSpec, existing: dict[str, Any]) -> Step:
    if pool.name in existing:
        return Step("node pool", pool.name, EXISTS, describe_pool(pool))

    def create() -> None:
        operation = clients.container.create_node_pool(
            parent=settings.cluster_path, node_pool=plan.node_pool_request(pool)
        )
        wait(clients, settings, operation, f"node pool {pool.name}")

    return Step("node pool", pool.name, CREATE, describe_pool(pool), create)


def delete_node_pool_step(clients: Clients, settings: Settings, node_pool: Any) -> Step:
    def delete() -> None:
        operation = clients.container.delete_node_pool(name=f"{settings.cluster_path}/nodePools/{node_pool.name}")
        wait(clients, settings, operation, f"node pool {node_pool.name}")

    spec = plan.accelerator_of(node_pool)
    return Step("node pool", node_pool.name, DELETE, spec.name if spec else "", delete)


# ------------------------------------------------------------------------------------------------ registry, bucket


def repository_step(clients: Clients, settings: Settings) -> Step:
    try:
        clients.registry.get_repository(name=settings.repository_path)
        return Step("registry", settings.image_repository, EXISTS, "Artifact Registry, Docker")
    except google_errors.NotFound:
        pass

    def create() -> None:
        repository = artifactregistry_v1.Repository(
            format_=artifactregistry_v1.Repository.Format.DOCKER,
            description="kinetic-prefect: job images",
            labels=dict(settings.labels),
        )
        operation = clients.registry.create_repository(
            parent=f"projects/{settings.project}/locations/{settings.region}",
            repository_id=settings.repository_id,
            repository=repository,
        )
        operation.result(timeout=600)

    return Step("registry", settings.image_repository, CREATE, "Artifact Registry, Docker", create)


def find_bucket(clients: Clients, settings: Settings) -> Any | None:
    try:
        return clients.storage.lookup_bucket(settings.bucket)
    except google_errors.Forbidden:
        raise ProvisionError(
            f"bucket gs://{settings.bucket} exists but this identity may not read it (another project's, or no "
            "storage.buckets.get): give another --cluster (the bucket is named after it) or get access to it"
        ) from None


def bucket_step(clients: Clients, settings: Settings) -> Step:
    if find_bucket(clients, settings) is not None:
        return Step("bucket", f"gs://{settings.bucket}", EXISTS, f"store {settings.store}")

    def create() -> None:
        bucket = clients.storage.bucket(settings.bucket)
        bucket.iam_configuration.uniform_bucket_level_access_enabled = True
        bucket.labels = dict(settings.labels)
        clients.storage.create_bucket(bucket, project=settings.project, location=settings.region)

    return Step("bucket", f"gs://{settings.bucket}", CREATE, f"{settings.region}, store {settings.store}", create)


def bucket_holds_objects(bucket: Any) -> bool:
    return any(True for _ in bucket.list_blobs(max_results=1))


def delete_bucket_step(clients: Clients, settings: Settings, delete_data: bool) -> Step:
    name = f"gs://{settings.bucket}"
    bucket = find_bucket(clients, settings)
    if bucket is None:
        return Step("bucket", name, ABSENT)
    if bucket_holds_objects(bucket) and not delete_data:
        return Step("bucket", name, KEEP, "holds objects: --delete-data deletes them with the bucket")

    def delete() -> None:
        for blob in bucket.list_blobs():  # Bucket.delete(force=True) gives up past 256 objects
            blob.delete()
        bucket.delete()

    return Step("bucket", name, DELETE, "and every object in it" if delete_data else "empty", delete)


# ------------------------------------------------------------------------------------------------ Prefect, worker


def _pool_template(settings: Settings, base: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``base`` with ``up``'s defaults set where unset: (template, variables set, variables kept as they were)."""
    import json

    template = json.loads(json.dumps(base))
    properties = template["variables"]["properties"]
    shipped = config.pool_template(POOL_TYPE)["variables"]["properties"]
    changed, kept = [], []
    for key, value in settings.pool_defaults().items():
        current = properties[key].get("default")
        if current in (None, "", shipped[key].get("default")) and current != value:  # not the operator's choice
            properties[key]["default"] = value
            changed.append(key)
        elif current != value:  # the operator's own setting wins; the plan shows it
            kept.append(f"{key}={current!r}")
    return template, changed, kept


def work_pool_step(clients: Clients, settings: Settings) -> Step:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    with clients.prefect_client() as client:
        try:
            pool = client.read_work_pool(settings.work_pool)
        except ObjectNotFound:
            pool = None
    if pool is None:
        template, _, _ = _pool_template(settings, config.pool_template(POOL_TYPE))

        def create() -> None:
            description = f"kinetic-prefect up: GKE cluster {settings.cluster} ({settings.project}, {settings.zone})"
            with clients.prefect_client() as client:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=settings.work_pool, type=POOL_TYPE, base_job_template=template, description=description
                    )
                )

        return Step("work pool", settings.work_pool, CREATE, f"{POOL_TYPE}, store {settings.store}", create)
    if pool.type != POOL_TYPE:
        raise ProvisionError(
            f"--pool-name {settings.work_pool!r}: that work pool exists and is of type {pool.type}, not {POOL_TYPE}; "
            "give another --pool-name"
        )
    template, changed, kept = _pool_template(settings, pool.base_job_template)
    note = f"keeps {', '.join(kept)}" if kept else ""
    if not changed:
        return Step("work pool", settings.work_pool, EXISTS, note)

    def update() -> None:
        with clients.prefect_client() as client:
            client.update_work_pool(settings.work_pool, WorkPoolUpdate(base_job_template=template))

    return Step(
        "work pool", settings.work_pool, UPDATE, "; ".join(filter(None, [f"sets {', '.join(changed)}", note])), update
    )


def delete_work_pool_step(clients: Clients, settings: Settings) -> Step:
    from prefect.exceptions import ObjectNotFound

    with clients.prefect_client() as client:
        try:
            pool = client.read_work_pool(settings.work_pool)
        except ObjectNotFound:
            return Step("work pool", settings.work_pool, ABSENT)
    if pool.type != POOL_TYPE:
        return Step("work pool", settings.work_pool, KEEP, f"of type {pool.type}, not made by up")

    def delete() -> None:
        with clients.prefect_client() as client:
            client.delete_work_pool(settings.work_pool)

    return Step("work pool", settings.work_pool, DELETE, "", delete)


def prefect_api_for_the_cluster() -> dict[str, str]:
    """The Prefect API the in-cluster worker talks to: this one, which must be reachable from the cluster."""
    from urllib.parse import urlparse

    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL

    url = PREFECT_API_URL.value()
    host = urlparse(url or "").hostname or ""
    if not url or host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        raise ProvisionError(
            f"--worker-image: PREFECT_API_URL is {url or 'unset'}, which a worker in the cluster cannot reach; set "
            "it to an address the cluster reaches (Prefect Cloud, or a server the cluster can route to), or leave "
            "out --worker-image and submit in-process"
        )
    key = PREFECT_API_KEY.value()
    return {"url": url, **({"key": key.get_secret_value() if hasattr(key, "get_secret_value") else key} if key else {})}


def worker_step(clients: Clients, settings: Settings, cluster: Any | None, api: dict[str, str] | None) -> Step:
    """The in-cluster worker (``workers.gke.deploy``'s manifests); skipped without ``--worker-image``."""
    name = f"{settings.namespace}/{WORKER_NAME}"
    if not settings.worker_image:
        return Step(
            "worker",
            name,
            SKIP,
            "no --worker-image: calls submit in-process, or give one (`kinetic-prefect gke-worker-image "
            f"--repository {settings.image_repository} --push`)",
        )
    if clients.clusters is None:
        raise ProvisionError("no Kubernetes access to deploy the worker with (install the k8s extra)")
    access = clients.clusters
    if cluster is not None and access.worker_exists(cluster, settings.namespace):
        return Step("worker", name, EXISTS, "Deployment")
    manifests = worker_manifests(
        settings.work_pool, namespace=settings.namespace, image=settings.worker_image, api_secret=API_SECRET
    )

    def deploy() -> None:
        access.deploy_worker(cluster or find_cluster(clients, settings), manifests, api or {})

    return Step("worker", name, CREATE, f"{settings.worker_image}, pool {settings.work_pool}", deploy)


# ------------------------------------------------------------------------------------------------ who may do what


def namespace_step(clients: Clients, settings: Settings, cluster: Any | None) -> Step:
    """kinetic's namespace, enforcing the restricted Pod Security Standard, with the job pods' ServiceAccount
    (``workers.gke.deploy.namespace_manifests``); the worker's own ServiceAccount and Role come with the worker."""
    note = f"Pod Security restricted; job service account {settings.job_service_account}"
    if clients.clusters is None:
        raise ProvisionError("no Kubernetes access to make the jobs' namespace with (install the k8s extra)")
    access = clients.clusters
    if cluster is not None and access.namespace_exists(cluster, settings.namespace):
        return Step("namespace", settings.namespace, EXISTS, note)
    manifests = namespace_manifests(settings.namespace, settings.job_service_account)

    def create() -> None:
        access.apply(cluster or find_cluster(clients, settings), manifests)

    return Step("namespace", settings.namespace, CREATE, note, create)


def bucket_access_step(clients: Clients, settings: Settings) -> Step:
    """``plan.BUCKET_ROLE`` on the bucket for the jobs' ServiceAccount (and the worker's), each named by its
    Workload Identity principal: not a principalSet of the namespace, so no other pod's account reaches the store."""
    who = ", ".join(
        f"{settings.namespace}/{a}"
        for a in [settings.job_service_account] + ([WORKER_NAME] if settings.worker_image else [])
    )
    name = f"gs://{settings.bucket} {plan.BUCKET_ROLE}"
    bucket = find_bucket(clients, settings)
    if bucket is not None and not _missing_members(bucket, settings):
        return Step("bucket access", name, EXISTS, who)

    def grant() -> None:
        found = find_bucket(clients, settings)
        if found is None:
            raise ProvisionError(f"bucket gs://{settings.bucket} is missing: its step comes first")
        policy = found.get_iam_policy(requested_policy_version=3)
        missing = _missing_members(found, settings, policy)
        if missing:
            policy.bindings.append({"role": plan.BUCKET_ROLE, "members": set(missing)})
            found.set_iam_policy(policy)

    return Step("bucket access", name, CREATE, f"{who} (Workload Identity), no other account", grant)


def _missing_members(bucket: Any, settings: Settings, policy: Any = None) -> list[str]:
    number = bucket.project_number
    if not number:
        bucket.reload()
        number = bucket.project_number
    if not number:
        raise ProvisionError(f"bucket gs://{settings.bucket}: GCS gave no project number to name the principals by")
    policy = policy if policy is not None else bucket.get_iam_policy(requested_policy_version=3)
    granted = {m for b in policy.bindings if b.get("role") == plan.BUCKET_ROLE for m in b.get("members", ())}
    return [m for m in settings.bucket_members(number) if m not in granted]
