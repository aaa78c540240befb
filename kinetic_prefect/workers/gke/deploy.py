"""Worker side: manifests that run a long-lived ``kinetic-gke`` worker inside the cluster.

Least privilege: the worker's ServiceAccount may manage Jobs, read Pods and their logs, read Events, read Kueue's
Workloads and LocalQueues (why a queued Job waits), and create (never read) the per-Job Secrets that carry forwarded
env values, in its own namespace only.
The Prefect API URL and key come from a Secret the user creates
(`kubectl create secret generic prefect-api --from-literal=url=... --from-literal=key=...`).
"""

from __future__ import annotations

from typing import Any

from kinetic_prefect.contract import GKE_WORKER_TYPE

JOB_RULES = [
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]},
    # A multi-host group's pods find each other through a headless Service owned by its Job.
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create"]},
    # Forwarded env values travel in a per-Job Secret: the worker writes them, never reads any secret.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "patch"]},
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
                    "spec": {"serviceAccountName": name, "containers": [_worker_container(pool, image, api_secret)]},
                },
            },
        },
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
    }
