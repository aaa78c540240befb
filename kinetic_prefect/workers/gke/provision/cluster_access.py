"""Provisioning, the clients: Google's (Application Default Credentials) and the new cluster's Kubernetes API.

The Kubernetes client is made from what GKE returns for the cluster (its endpoint and CA certificate) and a
Google access token, so ``up`` needs no kubeconfig and no ``gcloud``.
"""

from __future__ import annotations

import base64
import tempfile
from typing import Any

from kinetic_prefect.workers.gke.provision.steps import API_SECRET, WORKER_NAME, Clients

NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"


def google_clients(project: str) -> Clients:
    """The real clients, authenticated with Application Default Credentials."""
    from google.cloud import artifactregistry_v1, container_v1, storage  # type: ignore[attr-defined]

    return Clients(
        container=container_v1.ClusterManagerClient(),
        registry=artifactregistry_v1.ArtifactRegistryClient(),
        storage=storage.Client(project=project),
        clusters=KubeClusterAccess(),
    )


def _google_token() -> str:
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    credentials.refresh(google.auth.transport.requests.Request())
    return str(credentials.token)


class KubeClusterAccess:
    """The cluster's Kubernetes API, reached from its GKE description; ``api_client`` may be given (tests)."""

    def __init__(self, api_client: Any = None):
        self._api_client = api_client

    def api_client(self, cluster: Any) -> Any:
        if self._api_client is not None:
            return self._api_client
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = f"https://{cluster.endpoint}"
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as ca:
            ca.write(base64.b64decode(cluster.master_auth.cluster_ca_certificate))
        configuration.ssl_ca_cert = ca.name
        configuration.api_key = {"authorization": f"Bearer {_google_token()}"}
        return client.ApiClient(configuration)

    def worker_exists(self, cluster: Any, namespace: str) -> bool:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            client.AppsV1Api(self.api_client(cluster)).read_namespaced_deployment(WORKER_NAME, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def namespace_exists(self, cluster: Any, namespace: str) -> bool:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            client.CoreV1Api(self.api_client(cluster)).read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def apply(self, cluster: Any, manifests: list[dict[str, Any]]) -> None:
        """Each manifest created in order; what exists already (409) is left as it is."""
        from kubernetes import utils

        api_client = self.api_client(cluster)
        for manifest in manifests:
            try:
                utils.create_from_dict(api_client, manifest, namespace=manifest["metadata"].get("namespace"))
            except utils.FailToCreateError as exc:
                if any(getattr(e, "status", None) != 409 for e in exc.api_exceptions):
                    raise

    def deploy_worker(self, cluster: Any, manifests: list[dict[str, Any]], api: dict[str, str]) -> None:
        """The API Secret, then each manifest; what exists already (409) is left as it is."""
        namespace = manifests[0]["metadata"]["namespace"]
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": API_SECRET, "namespace": namespace},
            "stringData": api,
        }
        self.apply(cluster, [secret, *manifests])

    def node_counts(self, cluster: Any) -> dict[str, int]:
        from kubernetes import client

        counts: dict[str, int] = {}
        for node in client.CoreV1Api(self.api_client(cluster)).list_node().items:
            pool = ((node.metadata and node.metadata.labels) or {}).get(NODE_POOL_LABEL)
            if pool:
                counts[pool] = counts.get(pool, 0) + 1
        return counts
