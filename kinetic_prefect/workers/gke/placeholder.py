"""A node asked for while the job's image builds: a placeholder Job with the job's node selector, tolerations and
resources, at a priority below every job, deleted before the job's own Job is created.

A call with new requirements on a node pool at zero nodes otherwise waits for the build and then for the scale-up,
one after the other; with the placeholder pending, the cluster autoscaler starts the scale-up while the image
builds, so the call waits for the longer of the two. This is the overprovisioning pattern of GKE's "Provision extra
compute capacity for rapid Pod scaling" (https://cloud.google.com/kubernetes-engine/docs/how-to/capacity-provisioning:
"each new node takes approximately 80 to 120 seconds to boot"; balloon pods of a negative PriorityClass) and of the
cluster autoscaler's FAQ ("How can I configure overprovisioning with Cluster Autoscaler?"), for one call at a time.

Why a Job and not a bare pod: the worker's Role may create and delete Jobs and nothing that makes pods by itself,
and the Job controller bounds a placeholder that nobody deleted (a worker killed mid-build): ``activeDeadlineSeconds``
ends it, ``ttlSecondsAfterFinished`` removes it. Its priority (``PLACEHOLDER_PRIORITY``) is the lowest that still
makes the autoscaler scale up (pods under ``--expendable-pods-priority-cutoff``, -10, never do), and its
PriorityClass never preempts anything (``preemptionPolicy: Never``): a placeholder only takes free room.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kinetic_prefect.contract import PLACEHOLDER_LABEL, PLACEHOLDER_PRIORITY_CLASS
from kinetic_prefect.workers.gke.kube import POOL_LABEL, kube_retry, label_value

# The cluster autoscaler's --expendable-pods-priority-cutoff is -10: a pod below it never triggers a scale-up.
PLACEHOLDER_PRIORITY = -10
# Only a build asks for a node ahead: an image already in the registry is found within this many seconds, and a
# call that finds its image creates no placeholder.
HOLD_AFTER_SECONDS = 2.0
# A placeholder nobody deleted (its worker was killed) ends by itself after this long; a build that takes longer
# loses its head start, nothing else.
HOLD_MAX_SECONDS = 1800
# How long the release waits for the placeholder's pod to leave its node, so that the job's pod finds the node free.
RELEASE_WAIT_SECONDS = 15.0


def priority_class_manifest() -> dict[str, Any]:
    """The cluster-wide PriorityClass of placeholders (``gke-worker-manifests`` has it; an in-process caller makes it
    on first use)."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": PLACEHOLDER_PRIORITY_CLASS, "labels": {"app.kubernetes.io/managed-by": "kinetic-prefect"}},
        "value": PLACEHOLDER_PRIORITY,
        "preemptionPolicy": "Never",
        "globalDefault": False,
        "description": "kinetic-prefect: a node asked for while a job's image builds; any job's pod takes its place.",
    }


def wanted(configuration: Any) -> bool:
    """A placeholder is made for a one-pod Job the worker starts itself: not a group (its hosts come as one slice),
    not a Job queued in Kueue (its capacity is provisioned at once when admitted), not when the image is given."""
    if not getattr(configuration, "hold_node_during_build", True) or configuration.image:
        return False
    manifest = configuration.job_manifest
    return configuration.host_count == 1 and not manifest["spec"].get("suspend")


def manifest(configuration: Any, flow_run_id: str) -> dict[str, Any]:
    """The placeholder Job: the job's pod scheduling (node selector, tolerations, affinity, resources, security
    context) around a container that sleeps in the job's base image (the node pulls its layers meanwhile)."""
    job = configuration.job_manifest
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    spec = configuration.image_spec
    labels = {
        "app.kubernetes.io/managed-by": "kinetic-prefect",
        PLACEHOLDER_LABEL: label_value(flow_run_id),
        **({POOL_LABEL: job["metadata"]["labels"][POOL_LABEL]} if POOL_LABEL in job["metadata"]["labels"] else {}),
    }
    hold_pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "priorityClassName": PLACEHOLDER_PRIORITY_CLASS,
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "hold",
                "image": spec.base_image or f"python:{spec.python}-slim",
                "imagePullPolicy": "IfNotPresent",
                "command": ["python3", "-c", "import time; time.sleep(1e9)"],
                "resources": copy.deepcopy(container.get("resources") or {}),
                "securityContext": copy.deepcopy(container.get("securityContext") or {}),
            }
        ],
    }
    for key in ("nodeSelector", "tolerations", "affinity", "securityContext", "serviceAccountName"):
        if pod.get(key):
            hold_pod[key] = copy.deepcopy(pod[key])
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"{job['metadata']['name'][:58]}-hold",
            "namespace": configuration.namespace,
            "labels": labels,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": HOLD_MAX_SECONDS,
            "ttlSecondsAfterFinished": 60,
            "template": {"metadata": {"labels": labels}, "spec": hold_pod},
        },
    }


def _ensure_priority_class(api: Any) -> None:
    """The placeholders' PriorityClass, made by whoever may (a caller submitting in-process with their own
    credentials); an in-cluster worker's Role may not, and gke-worker-manifests brings it instead. Without it the
    placeholder's pod is never made and the call goes on as if there were none."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with contextlib.suppress(ApiException):  # 409: there already; 403: not this identity's to make
        scheduling: Any = client.SchedulingV1Api(api)  # the client takes the manifest as a dict
        scheduling.create_priority_class(priority_class_manifest())


class NodeHold:
    """One call's placeholder: ``hold_after`` makes it once the build has taken ``HOLD_AFTER_SECONDS``, ``release``
    deletes it (idempotent; every way out of the launcher's submit calls it)."""

    def __init__(self, api: Any, configuration: Any, flow_run_id: str, log: Callable[[str], None]):
        self.api, self.log = api, log
        self.body = manifest(configuration, flow_run_id)
        self.namespace = configuration.namespace
        self.made = False
        self.asked_at: float | None = None  # wall-clock time the placeholder was created

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    async def hold_after(self, delay: float = HOLD_AFTER_SECONDS) -> None:
        await anyio.sleep(delay)
        try:
            await anyio.to_thread.run_sync(self._create)
        except Exception as exc:  # the head start is a nicety: the build and the call go on without it
            self.log(f"Could not ask for a node while the image builds ({type(exc).__name__}: {exc}); going on")

    def _create(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        _ensure_priority_class(self.api)
        self.made = True  # before the call: a create whose answer is lost is still released
        try:
            kube_retry(client.BatchV1Api(self.api).create_namespaced_job)(self.namespace, self.body)
        except ApiException as exc:
            if exc.status != 409:  # 409: an earlier try of this call made it
                self.made = False
                self.log(f"Could not ask for a node while the image builds ({exc.status} {exc.reason}); going on")
                return
        self.asked_at = time.time()
        self.log(f"Asked for a node while the image builds (placeholder Job {self.namespace}/{self.name})")

    async def release(self) -> None:
        if self.made:
            self.made = False
            await anyio.to_thread.run_sync(self._delete)

    def _delete(self) -> None:
        """Delete the placeholder and its pod (foreground: the Job goes once its pod has), waiting a bounded time for
        the pod to leave, so the job's pod does not find the node still taken."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        batch = client.BatchV1Api(self.api)
        try:
            kube_retry(batch.delete_namespaced_job)(self.name, self.namespace, propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        deadline = time.monotonic() + RELEASE_WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                batch.read_namespaced_job(self.name, self.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return
            except Exception:  # a transient error: look again
                pass
            time.sleep(0.25)


async def build_holding_a_node(hold: NodeHold | None, build: Callable[[], Awaitable[str]]) -> str:
    """``build()`` (the image build) with the placeholder made after HOLD_AFTER_SECONDS of it; whatever ends the
    build (done, failed, cancelled), the placeholder is deleted before this returns or raises."""
    if hold is None:
        return await build()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(hold.hold_after)
            image = await build()
            group.cancel_scope.cancel()
        return image
    except BaseExceptionGroup as errors:  # the build's own error (hold_after raises none), as the build raised it
        if len(errors.exceptions) == 1:
            raise errors.exceptions[0] from None
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await hold.release()
