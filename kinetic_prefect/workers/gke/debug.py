"""kinetic-gke, debug mode: what a debug job's manifest adds (the caller asked with ``KINETIC_DEBUG=1``), and how
``kinetic-prefect jobs debug`` reaches it (``debug_connector``: a port-forward through the API server).

* the debugpy port, named ``debugpy``, on the job's container, and the pod's own name and namespace (downward
  API) for the runner's record, which ``kinetic-prefect jobs debug`` port-forwards to through the API server;
* no ``activeDeadlineSeconds``: the pool's ``job_watch_timeout_seconds`` would stop the job while it waits for a
  debugger or sits at a breakpoint. The pod watch timeout only counts while the pod is Pending, which a job
  waiting for a debugger is not (it runs); a cancel still deletes the Job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kinetic_prefect.contract import DEBUG_PORT, Env

PORT_NAME = "debugpy"


def is_debug(manifest: dict[str, Any]) -> bool:
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return any(e.get("name") == Env.DEBUG and e.get("value") == "1" for e in container.get("env") or [])


def render(manifest: dict[str, Any]) -> None:
    if not is_debug(manifest):
        return
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    ports = [p for p in container.get("ports") or [] if p.get("name") != PORT_NAME]
    container["ports"] = [*ports, {"name": PORT_NAME, "containerPort": DEBUG_PORT}]
    own = {Env.POD_NAME: "metadata.name", Env.POD_NAMESPACE: "metadata.namespace"}
    env = [e for e in container.get("env") or [] if e.get("name") not in own]
    container["env"] = env + [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in own.items()]
    manifest["spec"].pop("activeDeadlineSeconds", None)


def kube_connector(record: dict[str, Any], api_client: Any, portforward: Any = None) -> Callable[[], Any]:
    """``kinetic-prefect jobs debug``: a socket through the API server's port-forward to the pod's debugpy port
    (what ``kubectl port-forward`` does)."""
    from kubernetes import client as kube

    if portforward is None:
        from kubernetes.stream import portforward
    if not record.get("pod") or not record.get("namespace"):
        raise RuntimeError("the job's debugger record names no pod: it was not started by a kinetic-gke worker")
    core = kube.CoreV1Api(api_client)
    port = int(record["port"])

    def connect() -> Any:
        forward = portforward(
            core.connect_get_namespaced_pod_portforward, record["pod"], record["namespace"], ports=str(port)
        )
        return forward.socket(port)

    return connect


def job_kube_client(values: dict[str, Any]) -> Any:
    """The Kubernetes client for a job, as its worker makes one, from its variables (the run's, else the pool's
    defaults; a block reference already resolved to the block's fields): the ``cluster_config`` block (a
    KubernetesClusterConfig), else ``kubeconfig_path`` and ``kube_context``, else in-cluster credentials, else
    ~/.kube/config."""
    from kubernetes import client, config

    cluster = values.get("cluster_config")
    if isinstance(cluster, dict) and cluster.get("config"):
        return config.new_client_from_config_dict(cluster["config"], context=cluster.get("context_name"))
    if values.get("kubeconfig_path"):
        return config.new_client_from_config(config_file=values["kubeconfig_path"], context=values.get("kube_context"))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(context=values.get("kube_context"))
    return client.ApiClient()


def debug_connector(record: dict[str, Any], variables: Callable[[], dict[str, Any]]) -> tuple[Callable[[], Any], str]:
    """(what opens a connection to the debug job's debugpy, where that is) for ``kinetic-prefect jobs debug``."""
    where = f"pod {record.get('namespace')}/{record.get('pod')} port {record.get('port')} (Kubernetes port-forward)"
    return kube_connector(record, job_kube_client(variables())), where
