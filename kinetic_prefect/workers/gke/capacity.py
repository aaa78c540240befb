"""kinetic-gke: the capacity parts of a Job (preemption record, reservations, flex-start, queued provisioning) and
what the cluster says about capacity (cannot place it, took it away).

GKE documents used (field names as GKE's "Consuming reserved zonal resources", "flex-start" and "flex-start with
queued provisioning" pages give them): a specific reservation is selected by the node labels
``cloud.google.com/reservation-name`` / ``-affinity`` (``-project`` for a shared one); flex-start VMs by
``cloud.google.com/gke-flex-start: "true"``; queued provisioning through Kueue by the Job label
``kueue.x-k8s.io/queue-name`` plus the ``cloud.google.com/gke-queued`` toleration, the Job created suspended
(Kueue admits it once the ProvisioningRequest it makes is provisioned).
"""

from __future__ import annotations

from typing import Any

from kinetic_prefect.shared import capacity
from kinetic_prefect.accelerators import AcceleratorSpec

RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT_LABEL = "cloud.google.com/reservation-project"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
QUEUED_TAINT = "cloud.google.com/gke-queued"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ATTEMPT_LABEL = "kinetic.prefect.io/attempt"

# The Job fails at once when its pod is disrupted, and says so in its own Failed condition (reason
# PodFailurePolicy): that record outlives the pod, which the pod GC deletes together with a deleted node.
# The retry is the worker's (a new Job per attempt): only it can move to on-demand capacity or keep a budget.
POD_FAILURE_POLICY = {
    "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
}

SCALE_UP_TRIGGERED = "TriggeredScaleUp"  # the cluster autoscaler (or node auto-provisioning) is adding a node


def check_settings(pool_name: str, settings: dict[str, Any]) -> None:
    """Capacity settings that cannot work together, refused before anything is uploaded."""
    spot = bool(settings.get("spot"))
    if settings.get("reservation") and spot:
        raise ValueError(
            f"work pool {pool_name!r}: reservation={settings['reservation']!r} with spot=true cannot "
            "be placed: Spot VMs never consume reservations. Drop spot, or drop the reservation "
            f"(`kinetic-prefect pool-set {pool_name} reservation=`)"
        )
    if (settings.get("flex_start") or settings.get("queued_provisioning")) and spot:
        raise ValueError(
            f"work pool {pool_name!r}: flex-start capacity is its own provisioning model, not Spot: "
            "set spot=false, or drop flex_start / queued_provisioning"
        )
    if settings.get("reservation") and (settings.get("flex_start") or settings.get("queued_provisioning")):
        raise ValueError(
            f"work pool {pool_name!r}: a reservation and flex-start are two ways to get capacity; set one of them"
        )
    retries = settings.get("preemption_retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(
            f"preemption_retries={retries!r}: give a whole number >= 0 (0: a preemption crashes the "
            "run, and the task's own `retries` decide)"
        )
    wait = settings.get("capacity_wait_seconds")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0):
        raise ValueError(f"capacity_wait_seconds={wait!r}: give seconds >= 0")


def render(manifest: dict[str, Any], configuration: Any, spec: AcceleratorSpec, attempt: int) -> None:
    """Add the capacity documents to a rendered Job manifest (in place)."""
    job_spec = manifest["spec"]
    job_spec["podFailurePolicy"] = POD_FAILURE_POLICY
    manifest["metadata"].setdefault("labels", {})[ATTEMPT_LABEL] = str(attempt)
    pod = job_spec["template"]["spec"]
    selector = pod.setdefault("nodeSelector", {})
    tolerations = list(pod.get("tolerations") or [])
    # A reservation holds one machine shape: it is for the first accelerator of a fallback list (and its retries).
    first = not configuration._accelerator_choices or spec.name == configuration._accelerator_choices[0].split(":")[0]
    if configuration.reservation and first and not spec.spot:
        selector[RESERVATION_NAME_LABEL] = configuration.reservation
        selector[RESERVATION_AFFINITY_LABEL] = "specific"
        if configuration.reservation_project:
            selector[RESERVATION_PROJECT_LABEL] = configuration.reservation_project
    if (configuration.flex_start or configuration.queued_provisioning) and not spec.spot:
        selector[FLEX_START_LABEL] = "true"
        tolerations.append({"key": FLEX_START_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if configuration.queued_provisioning and not spec.spot:
        manifest["metadata"]["labels"][KUEUE_QUEUE_LABEL] = configuration.queued_provisioning
        tolerations.append({"key": QUEUED_TAINT, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
        job_spec["suspend"] = True  # Kueue unsuspends it once the capacity is provisioned
    pod["tolerations"] = tolerations or None


def pending_capacity(pod: dict[str, Any] | None, event_reasons: list[str]) -> str | None:
    """Why a pending pod is not placed, in capacity terms: no node pool has the accelerator (move on at once),
    or its nodes are full / the autoscaler could not add one (move on after the capacity wait). Read from the
    scheduler's own message: "Insufficient nvidia.com/gpu" names a node that has the accelerator but no room,
    "didn't match Pod's node affinity/selector" (or an untolerated taint) on every node means none has it."""
    if "FailedScaleUp" in event_reasons or SCALE_UP_TRIGGERED in event_reasons:
        return capacity.INSUFFICIENT_CAPACITY  # a stockout, or a node on its way (node auto-provisioning too)
    message = ""
    for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = (condition.get("message") or "").lower()
    if "insufficient" in message:
        return capacity.INSUFFICIENT_CAPACITY
    if (
        "affinity/selector" in message
        or "node selector" in message
        or "taint" in message
        or "NotTriggerScaleUp" in event_reasons
    ):
        return capacity.NO_NODE_POOL
    return None
