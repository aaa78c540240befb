"""The Kubernetes API as the kinetic-gke worker uses it: the client from a pool's settings, retries through
transient errors, and the labels and annotations its Jobs carry."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prefect_kubernetes.credentials import KubernetesClusterConfig

from kinetic_prefect.contract import Env
from kinetic_prefect.contract.job_variables import never_a_jobs
from kinetic_prefect.shared.image import JOB_USER_ID

FLOW_RUN_LABEL = "prefect.io/flow-run-id"
POOL_LABEL = "kinetic.prefect.io/work-pool"
GROUP_STOP_SECONDS = 60.0  # how long the other hosts of a failed group get to stop (and save) before it is over
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on each pod
# A job's environment: the kinetic wire names the worker sets (contract ``Env``, none of them secret) and Prefect's
# per-run ``PREFECT__*`` ids are written into the manifest (a warm pod takes the per-call ones from it); every other
# value (the pool's and the call's ``env``, ``JAX_PLATFORMS`` included) goes in the Job's Secret, since anyone who
# can read Jobs reads their manifests. The contract names that hold keys are never plain.
SECRET_CONTRACT_ENV = frozenset({Env.SIGNING_KEY, Env.SIGNING_KEY_PREVIOUS, Env.PREFECT_API_KEY})
PLAIN_ENV_NAMES = (
    frozenset(value for name, value in vars(Env).items() if name.isupper() and isinstance(value, str))
    - SECRET_CONTRACT_ENV
)
PLAIN_ENV_PREFIXES = ("PREFECT__",)
# Pod Security Standards, restricted profile (https://kubernetes.io/docs/concepts/security/pod-security-standards/):
# what every kinetic-gke pod runs with, the job's and the in-cluster worker's. The user is the one built images run
# as (``shared.image.JOB_USER_ID``); an image of one's own must let that user write its HOME.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": JOB_USER_ID,
    "runAsGroup": JOB_USER_ID,
    "fsGroup": JOB_USER_ID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
IMAGE_PULL_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}
# (connect, read) seconds for the follower's short reads: the client sets no timeout of its own, so a read whose
# answer never comes (a dropped connection the kernel has not noticed, an overloaded API server) would hold its
# thread for good; timed out, it is a transient error the worker retries on its next look.
READ_TIMEOUT: tuple[float, float] = (10.0, 30.0)


def is_plain_env(name: str) -> bool:
    """A variable written into the manifest as it is (a kinetic wire name or a Prefect run id), not into the Secret."""
    return name in PLAIN_ENV_NAMES or name.startswith(PLAIN_ENV_PREFIXES)


def is_worker_only_env(name: str) -> bool:
    """One of the worker's own Prefect settings, never passed to a pod at all: its credentials and its server's and
    database's settings (``contract.job_variables.never_a_jobs``; a job runs no Prefect, and the key would let code
    in a job act on the worker's whole Prefect account)."""
    return never_a_jobs(name)


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
