"""The Kubernetes API as the kinetic-gke worker uses it: the client from a pool's settings, retries through
transient errors, and the labels and annotations its Jobs carry."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prefect_kubernetes.credentials import KubernetesClusterConfig

from kinetic_prefect.contract import Env

FLOW_RUN_LABEL = "prefect.io/flow-run-id"
POOL_LABEL = "kinetic.prefect.io/work-pool"
GROUP_STOP_SECONDS = 60.0  # how long the other hosts of a failed group get to stop (and save) before it is over
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on each pod
# Never written into a manifest (anyone who can read Jobs could read them): they go in the Job's Secret.
SECRET_ENV_NAMES = frozenset({"PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", Env.PREFECT_API_KEY})
IMAGE_PULL_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}
# (connect, read) seconds for the follower's short reads: the client sets no timeout of its own, so a read whose
# answer never comes (a dropped connection the kernel has not noticed, an overloaded API server) would hold its
# thread for good; timed out, it is a transient error the worker retries on its next look.
READ_TIMEOUT: tuple[float, float] = (10.0, 30.0)


def is_transient_kube_error(exc: BaseException) -> bool:
    """A Kubernetes API error that may pass by itself: 429, a 5xx, a dropped or refused connection."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        return exc.status in (0, 429, 500, 502, 503, 504)
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError))


def kube_retry(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` retried through transient API errors with exponential backoff (0.5 s .. 8 s, two minutes in all);
    a decided answer (403, 404, 409, 422) is raised at once."""
    import tenacity

    return tenacity.retry(
        retry=tenacity.retry_if_exception(is_transient_kube_error),
        wait=tenacity.wait_exponential(multiplier=0.5, max=8),
        stop=tenacity.stop_after_delay(120),
        reraise=True,
    )(call)


class JobGone(Exception):
    """The Job was deleted under us (cancellation, TTL, a person with kubectl)."""


def label_value(value: Any) -> str:
    """Kubernetes label values: at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    text = re.sub(r"[^A-Za-z0-9_.-]", "-", str(value))[:63]
    return text.strip("-_.") or "x"


def prune(value: Any) -> Any:
    """Drop None/empty placeholders left by the template, so the manifest stays schema-valid."""
    if isinstance(value, dict):
        pruned = {k: prune(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v is not None and v != {} and v != ""}
    if isinstance(value, list):
        return [prune(v) for v in value if v is not None]
    return value


def kube_client(
    cluster_config: KubernetesClusterConfig | None = None,
    kubeconfig_path: str | None = None,
    kube_context: str | None = None,
):
    """A (blocking) Kubernetes API client: the pool's KubernetesClusterConfig block, else a kubeconfig
    path, else in-cluster credentials (the in-cluster worker), else ~/.kube/config."""
    from kubernetes import client, config

    if cluster_config is not None:
        return config.new_client_from_config_dict(cluster_config.config, context=cluster_config.context_name)
    if kubeconfig_path:
        return config.new_client_from_config(config_file=kubeconfig_path, context=kube_context)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(context=kube_context)
    return client.ApiClient()


CLUSTER_VARIABLES = ("cluster_config", "kubeconfig_path", "kube_context")  # a pool's variables naming its cluster


def pool_kube_client(cluster_config: Any = None, kubeconfig_path: str | None = None, kube_context: str | None = None):
    """The client for a pool's cluster from its variables' defaults (``CLUSTER_VARIABLES``): ``cluster_config`` as
    the template holds it (``{"$ref": ...}`` to a saved KubernetesClusterConfig block), else kubeconfig and context."""
    block = None
    if isinstance(cluster_config, dict) and "$ref" in cluster_config:
        block = KubernetesClusterConfig.load_from_ref(cluster_config["$ref"])
    return kube_client(block, kubeconfig_path, kube_context)
