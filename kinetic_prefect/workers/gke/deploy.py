"""Worker side: manifests that run a long-lived ``kinetic-gke`` worker inside the cluster.

Least privilege: the worker's ServiceAccount may manage Jobs, read Pods and their logs, read Events, read Kueue's
Workloads and LocalQueues (why a queued Job waits), and create the per-Job Secrets that carry a job's environment
values, in its own namespace only. Create, and nothing else, on Secrets: it may not read, list, change or delete
any Secret (the per-Job names are not known beforehand, so a Role cannot name them; a Job's Secret is made owned by
its Job and goes with it). The worker's pod, like every job pod, meets the Pod Security Standards' restricted
profile (``kube.POD_SECURITY_CONTEXT``); :func:`namespace_manifests` makes the namespace that enforces it, with the
job pods' own ServiceAccount (no token mounted, no Role: a job never calls the Kubernetes API).
The Prefect API URL and key come from a Secret the user creates
(`kubectl create secret generic prefect-api --from-literal=url=... --from-literal=key=...`).
"""

from __future__ import annotations

from typing import Any

from kinetic_prefect.contract import GKE_WORKER_TYPE
from kinetic_prefect.workers.gke import placeholder
from kinetic_prefect.workers.gke.kube import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT

JOB_SERVICE_ACCOUNT = "kinetic-job"  # the job pods' ServiceAccount that `up` makes (Workload Identity: the bucket)
POD_SECURITY_LABELS = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")}

JOB_RULES = [
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]},
    # A multi-host group's pods find each other through a headless Service owned by its Job.
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create"]},
    # A job's environment values travel in a per-Job Secret, made owned by its Job: the worker creates it, and may
    # not read, change or delete any Secret (a Role cannot name per-Job Secrets ahead of time).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # A Job queued in Kueue (queued_provisioning): its Workload and LocalQueue say where and why it waits.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads", "localqueues"], "verbs": ["get", "list"]},
]


def worker_manifests(
    pool: str,
    *,
    namespace: str = "default",
    image: str,
    name: str = "kinetic-gke-worker",
    api_secret: str = "prefect-api",
    replicas: int = 1,
) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding and Deployment for ``prefect worker start --type kinetic-gke``.

    ``image`` must contain kinetic-prefect with the ``gcp`` and ``k8s`` extras: the image
    ``kinetic-prefect gke-worker-image`` builds (``docker/kinetic-gke-worker.Dockerfile``, see ``gke_worker_image``).
    """
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "kinetic-prefect"}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": JOB_RULES},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": name,
                        "securityContext": dict(POD_SECURITY_CONTEXT),
                        "containers": [_worker_container(pool, image, api_secret)],
                    },
                },
            },
        },
        # cluster-wide, applied with the rest by an admin: the worker's Role cannot make it
        placeholder.priority_class_manifest(),
    ]


def _worker_container(pool: str, image: str, api_secret: str) -> dict[str, Any]:
    """``prefect worker start`` on the pool with its health check, the API's URL and key read from ``api_secret``."""
    secret_env = [
        {"name": "PREFECT_API_URL", "valueFrom": {"secretKeyRef": {"name": api_secret, "key": "url"}}},
        {
            "name": "PREFECT_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": api_secret, "key": "key", "optional": True}},
        },
    ]
    return {
        "name": "worker",
        "image": image,
        "args": ["prefect", "worker", "start", "--type", GKE_WORKER_TYPE, "--pool", pool, "--with-healthcheck"],
        "env": [*secret_env, {"name": "PREFECT_WORKER_WEBSERVER_PORT", "value": "8080"}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "initialDelaySeconds": 30, "periodSeconds": 30},
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def namespace_manifests(namespace: str, job_service_account: str = JOB_SERVICE_ACCOUNT) -> list[dict[str, Any]]:
    """The namespace of kinetic's Jobs and worker, enforcing the Pod Security Standards' restricted profile (a pod
    that runs as root, or may gain privileges, is refused by the API server), and the job pods' ServiceAccount:
    no token mounted and no Role bound (a job never calls the Kubernetes API); its Workload Identity principal
    alone is given the store bucket."""
    labels = {"app.kubernetes.io/part-of": "kinetic-prefect"}
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {**labels, **POD_SECURITY_LABELS}},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": job_service_account, "namespace": namespace, "labels": labels},
            "automountServiceAccountToken": False,
        },
    ]
