"""kinetic-gke's provisioning as a platform (``workers/gke/commands.py``'s ``provisioning()``): ``up`` / ``down
--platform gke``, the cluster, node pools, registry, bucket, namespace, signing key, work pool and in-cluster
worker of ``commands``."""

from __future__ import annotations

from typing import Any

from kinetic_prefect import signing
from kinetic_prefect.contract import Env
from kinetic_prefect.workers.gke.provision import commands, plan, steps
from kinetic_prefect.workers.provisioning import ClientsFor, Options, Plan, ProvisionError


class GKEPlatform:
    name = "gke"

    def make_clients(self, project: str) -> Any:
        from kinetic_prefect.workers.gke.provision.cluster_access import google_clients

        return google_clients(project)

    def plan_up(self, options: Options, clients: ClientsFor) -> Plan:
        if not options.zone:
            raise ProvisionError("--zone is required (the cluster's zone, e.g. us-central1-a)")
        settings = plan.settings(
            options.project,
            options.zone,
            options.cluster or plan.DEFAULT_CLUSTER,
            list(options.accelerators),
            spot=options.spot,
            reservation=options.reservation,
            min_nodes=options.min_nodes,
            work_pool=options.pool_name,
            worker_image=options.worker_image,
        )
        api = steps.prefect_api_for_the_cluster() if options.worker_image else None
        planned = commands.plan_up(clients(settings.project), settings, api)
        return Plan(
            f"kinetic-prefect up: {settings.project}/{settings.zone}/{settings.cluster}",
            planned,
            question="Create or update {n} resource(s)?",
            rerun="Run the same `kinetic-prefect up` again to resume: what exists is kept.",
            next_steps=_next_steps(settings),
        )

    def plan_down(self, options: Options, clients: ClientsFor) -> Plan:
        if not options.zone:
            raise ProvisionError("--zone is required (the cluster's zone, e.g. us-central1-a)")
        settings = plan.settings(
            options.project, options.zone, options.cluster or plan.DEFAULT_CLUSTER, work_pool=options.pool_name
        )
        planned = commands.plan_down(
            clients(settings.project), settings, options.delete_data, options.delete_signing_key
        )
        return Plan(
            f"kinetic-prefect down: {settings.project}/{settings.zone}/{settings.cluster}",
            planned,
            question="Delete {n} resource(s)? This cannot be undone",
            rerun="Run the same `kinetic-prefect down` again to finish: what is gone is skipped.",
        )


def _next_steps(settings: plan.Settings) -> list[str]:
    return [
        f"\nSubmit with work_pool={settings.work_pool!r} (or {Env.WORK_POOL}={settings.work_pool}).",
        "kubectl and in-process submission: `gcloud container clusters get-credentials "
        f"{settings.cluster} --zone {settings.zone} --project {settings.project}` (context {settings.kube_context}).",
        f"Jobs run in namespace {settings.namespace} (Pod Security: restricted) as the service account "
        f"{settings.job_service_account}, the only job account given gs://{settings.bucket} (Workload Identity); "
        f"calls are signed with the Prefect Secret block {signing.SECRET_BLOCK!r}.",
    ]
