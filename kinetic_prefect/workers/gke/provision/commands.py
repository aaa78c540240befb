"""Provisioning, what each command does: the plans of ``up``, ``down``, ``pool add`` / ``remove`` and the rows of
``pool list``, built from the steps (each one a look-up first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.workers import provisioning
from kinetic_prefect.workers.gke.provision import plan, steps
from kinetic_prefect.workers.gke.provision.plan import NodePoolSpec, ProvisionError, Settings
from kinetic_prefect.workers.gke.provision.steps import Clients, Step


def plan_up(clients: Clients, settings: Settings, api: dict[str, str] | None = None) -> list[Step]:
    """Every resource ``up`` makes, looked up: the cluster, its node pools, the registry, the bucket, the jobs'
    namespace and service account, the bucket granted to that account alone, the signing key, the work pool, the
    in-cluster worker. Nothing is changed until :func:`provisioning.apply`."""
    cluster = steps.find_cluster(clients, settings)
    existing = steps.node_pools(clients, settings) if cluster is not None else {}
    return [
        steps.cluster_step(clients, settings, cluster),
        *(steps.node_pool_step(clients, settings, pool, existing) for pool in settings.node_pools),
        steps.repository_step(clients, settings),
        steps.bucket_step(clients, settings),
        steps.namespace_step(clients, settings, cluster),
        steps.bucket_access_step(clients, settings),
        provisioning.signing_key_step(clients),
        steps.work_pool_step(clients, settings),
        steps.worker_step(clients, settings, cluster, api),
    ]


def plan_down(
    clients: Clients, settings: Settings, delete_data: bool = False, delete_signing_key: bool = False
) -> list[Step]:
    """What ``down`` deletes: the work pool, the cluster (its node pools, namespace and worker go with it), the
    registry (its images with it) and the bucket, which is kept while it holds objects unless ``delete_data``; the
    signing key is kept unless ``delete_signing_key``."""
    from google.api_core import exceptions as google_errors

    cluster = steps.find_cluster(clients, settings)
    if cluster is None:
        cluster_step = Step("cluster", settings.cluster, steps.ABSENT)
    else:
        pools = sorted(steps.node_pools(clients, settings))
        cluster_step = Step("cluster", settings.cluster, steps.DELETE, f"with node pools {', '.join(pools)}")
        cluster_step.action = lambda: _delete_cluster(clients, settings)
    try:
        clients.registry.get_repository(name=settings.repository_path)
    except google_errors.NotFound:
        registry_step = Step("registry", settings.image_repository, steps.ABSENT)
    else:
        registry_step = Step("registry", settings.image_repository, steps.DELETE, "and its images")
        registry_step.action = lambda: clients.registry.delete_repository(name=settings.repository_path).result(
            timeout=600
        )
    return [
        steps.delete_work_pool_step(clients, settings),
        cluster_step,
        registry_step,
        steps.delete_bucket_step(clients, settings, delete_data),
        provisioning.delete_signing_key_step(clients, delete_signing_key),
    ]


def _delete_cluster(clients: Clients, settings: Settings) -> None:
    operation = clients.container.delete_cluster(name=settings.cluster_path)
    steps.wait(clients, settings, operation, f"cluster {settings.cluster}")


def _existing_cluster(clients: Clients, settings: Settings) -> Any:
    cluster = steps.find_cluster(clients, settings)
    if cluster is None:
        raise ProvisionError(
            f"no cluster {settings.cluster!r} in {settings.project}/{settings.zone}: make it with `kinetic-prefect up "
            f"--project {settings.project} --zone {settings.zone} --cluster {settings.cluster}`, or give the "
            "--cluster / --zone it is in"
        )
    return cluster


def plan_pool_add(clients: Clients, settings: Settings, pool: NodePoolSpec) -> list[Step]:
    _existing_cluster(clients, settings)
    return [steps.node_pool_step(clients, settings, pool, steps.node_pools(clients, settings))]


def plan_pool_remove(clients: Clients, settings: Settings, target: str, spot: bool = False) -> list[Step]:
    """The node pools ``pool remove TARGET`` deletes: the pool named TARGET, else every pool running the
    accelerator TARGET (with ``spot`` or ``:spot``: its Spot pools, else its on-demand ones)."""
    _existing_cluster(clients, settings)
    existing = steps.node_pools(clients, settings)
    if target in existing:
        chosen = [existing[target]]
    else:
        try:
            wanted = accelerators.resolve(target)
        except accelerators.UnknownAcceleratorError as exc:
            raise ProvisionError(
                f"{target!r} names no node pool of {settings.cluster} ({', '.join(existing)}); {exc}"
            ) from None
        wanted = wanted.with_spot(wanted.spot or spot)
        chosen = [pool for pool in existing.values() if plan.accelerator_of(pool) == wanted]
        if not chosen:
            raise ProvisionError(
                f"cluster {settings.cluster} has no node pool for {wanted.name}{' (spot)' if wanted.spot else ''}; "
                "`kinetic-prefect pool list` shows its pools"
            )
    return [steps.delete_node_pool_step(clients, settings, pool) for pool in chosen]


@dataclass(frozen=True)
class PoolRow:
    name: str
    accelerator: str
    spot: bool
    reservation: str
    min_nodes: int
    max_nodes: int
    nodes: int | None  # None: the cluster's nodes could not be read
    status: str


def pool_rows(clients: Clients, settings: Settings) -> list[PoolRow]:
    cluster = _existing_cluster(clients, settings)
    counts: dict[str, int] | None = None
    if clients.clusters is not None:
        try:
            counts = clients.clusters.node_counts(cluster)
        except Exception:  # noqa: BLE001 - a list without sizes is still worth showing
            counts = None
    rows = []
    for pool in steps.node_pools(clients, settings).values():
        spec = plan.accelerator_of(pool)
        affinity = pool.config.reservation_affinity
        rows.append(
            PoolRow(
                pool.name,
                spec.name if spec else f"- ({pool.config.machine_type})",
                bool(pool.config.spot),
                ", ".join(affinity.values) if affinity and affinity.values else "",
                pool.autoscaling.min_node_count,
                pool.autoscaling.max_node_count,
                None if counts is None else counts.get(pool.name, 0),
                pool.status.name.lower(),
            )
        )
    return rows
