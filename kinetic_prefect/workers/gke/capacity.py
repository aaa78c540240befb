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

from collections.abc import Sequence
from typing import Any

from kinetic_prefect.accelerators import AcceleratorSpec
from kinetic_prefect.shared import capacity

RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT_LABEL = "cloud.google.com/reservation-project"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
QUEUED_TAINT = "cloud.google.com/gke-queued"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's Workload for a Job: labelled with the Job's uid (Kueue's controller constants, JobUIDLabel); its conditions
# say why it is not admitted (QuotaReserved False, "couldn't assign flavors to pod set main: insufficient unused
# quota for nvidia.com/gpu in flavor l4, 1 more needed"). v1beta2 from Kueue 0.15 on, v1beta1 before.
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
ATTEMPT_LABEL = "kinetic.prefect.io/attempt"

# The Job fails at once when its pod is disrupted, and says so in its own Failed condition (reason
# PodFailurePolicy): that record outlives the pod, which the pod GC deletes together with a deleted node.
# The retry is the worker's (a new Job per attempt): only it can move to on-demand capacity or keep a budget.
POD_FAILURE_POLICY = {
    "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
}

# The cluster autoscaler's events on a pod it considered, and its status ConfigMap (cluster-autoscaler FAQ, "What
# events are emitted by CA?"; GKE's "Cluster autoscaler" and "Viewing cluster autoscaler events" pages).
SCALE_UP_TRIGGERED = "TriggeredScaleUp"  # "pod triggered scale-up: [{<node group> 0->1 (max: 3)}]": a node is coming
SCALE_UP_NOT_TRIGGERED = "NotTriggerScaleUp"  # "pod didn't trigger scale-up: <reason per node group>, ..."
SCALE_UP_FAILED = "FailedScaleUp"  # the VM could not be created: "... GCE out of resources" (a stockout), quota
AUTOSCALER_REASONS = (SCALE_UP_TRIGGERED, SCALE_UP_NOT_TRIGGERED, SCALE_UP_FAILED)
AUTOSCALER_STATUS_CONFIGMAP = ("kube-system", "cluster-autoscaler-status")
# A NotTriggerScaleUp naming a node group that has the accelerator but cannot grow now (backed off after a failed
# scale-up, at its maximum size): the pool exists and is out of capacity, not missing.
_POOL_CANNOT_GROW = ("backoff", "max node group size", "max limit", "max size")


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
    for name in ("capacity_wait_seconds", "provisioning_timeout_seconds"):
        wait = settings.get(name)
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0):
            raise ValueError(f"{name}={wait!r}: give seconds >= 0")


def render(manifest: dict[str, Any], configuration: Any, spec: AcceleratorSpec, attempt: int) -> None:
    """Add the capacity documents to a rendered Job manifest (in place)."""
    job_spec = manifest["spec"]
    job_spec["podFailurePolicy"] = POD_FAILURE_POLICY
    manifest["metadata"].setdefault("labels", {})[ATTEMPT_LABEL] = str(attempt)
    pod = job_spec["template"]["spec"]
    selector = pod.setdefault("nodeSelector", {})
    tolerations = list(pod.get("tolerations") or [])
    # A reservation holds one machine shape: it is for the first accelerator of a fallback list (and its retries).
    choices = configuration.accelerator_choices
    first = not choices or spec.name == choices[0].split(":")[0]
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


def pending_capacity(
    pod: dict[str, Any] | None, events: Sequence[tuple[str, str]], autoscaler: bool | None = None
) -> str | None:
    """Why a pending pod is not placed, in capacity terms (``capacity.*``), or None when it is not a capacity matter.

    ``events``: the pod's events as ``(reason, message)``, oldest first; the autoscaler's latest verdict decides:
    ``TriggeredScaleUp`` (a node is coming: SCALING_UP), ``FailedScaleUp`` (a stockout or the quota:
    INSUFFICIENT_CAPACITY), ``NotTriggerScaleUp`` (no node group would take it: NO_NODE_POOL; unless it names one
    that cannot grow now, backed off or at its maximum: INSUFFICIENT_CAPACITY). Without a verdict, the scheduler's
    own message: "Insufficient nvidia.com/gpu" names a node that has the accelerator but no room; "didn't match
    Pod's node affinity/selector" (or an untolerated taint) on every node means none has it *now*: a pool at zero
    nodes looks the same until the autoscaler answers, so that is NO_NODE_POOL only where the cluster has no
    autoscaler (``autoscaler`` False), else AWAITING_AUTOSCALER."""
    message = ""
    for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = (condition.get("message") or "").lower()
    if not message:
        return None  # scheduled (or not looked at yet): whatever the autoscaler said before no longer applies
    verdicts = [(reason, text) for reason, text in events if reason in AUTOSCALER_REASONS]
    if verdicts:
        reason, text = verdicts[-1]
        if reason == SCALE_UP_TRIGGERED:
            return capacity.SCALING_UP
        if reason == SCALE_UP_FAILED:
            return capacity.INSUFFICIENT_CAPACITY
        if "insufficient" in message or any(word in (text or "").lower() for word in _POOL_CANNOT_GROW):
            return capacity.INSUFFICIENT_CAPACITY
        return capacity.NO_NODE_POOL
    if "insufficient" in message:
        return capacity.INSUFFICIENT_CAPACITY
    if "affinity/selector" in message or "node selector" in message or "taint" in message:
        return capacity.NO_NODE_POOL if autoscaler is False else capacity.AWAITING_AUTOSCALER
    return None


def kueue_queued(queue: str, workload: dict[str, Any] | None, cluster_queue: str | None) -> str:
    """What a suspended Job waits for, said from its Kueue Workload: the ClusterQueue it queues in (the Workload's
    admission, else its LocalQueue's ``spec.clusterQueue``) and the Workload's latest word on why it waits."""
    where = f"Kueue ClusterQueue {cluster_queue}" if cluster_queue else f"Kueue LocalQueue {queue}"
    if workload is None:
        return f"queued in {where} (Kueue has not made its Workload yet)"
    conditions = (workload.get("status") or {}).get("conditions") or []
    by_type = {c.get("type"): c for c in conditions}
    said = by_type.get("QuotaReserved") or (conditions[-1] if conditions else None)
    why = f"{said.get('reason')}: {said.get('message')}" if said else "no word from Kueue yet"
    return f"queued in {where} (Workload {workload['metadata']['name']}: {why})"


def pending_hint(placing: str | None, text: str) -> str | None:
    """What to do about a pod still pending at its timeout: from the autoscaler's verdict (``pending_capacity``)
    where it gave one, else from the scheduler's words in ``text`` (the pod's conditions and warning events)."""
    lowered = text.lower()
    if placing == capacity.INSUFFICIENT_CAPACITY and (SCALE_UP_FAILED in text or "out of resources" in lowered):
        return (
            "the cluster autoscaler's scale-up failed: GCE is out of resources for this machine type in the zone "
            "(a stockout): give the task a fallback list (accelerator=[...]), try Spot or another zone, or wait"
        )
    if "insufficient nvidia.com/gpu" in lowered or "insufficient google.com/tpu" in lowered:
        return "the accelerator is exhausted in this zone/quota: try spot, another zone, or wait"
    if placing == capacity.INSUFFICIENT_CAPACITY:
        return (
            "the node pool with this accelerator cannot grow now (backed off after a failed scale-up, or at its "
            "maximum size): give the task a fallback list, raise the pool's maximum, or wait"
        )
    if placing == capacity.SCALING_UP:
        return "the cluster autoscaler was still adding a node for it: raise provisioning_timeout_seconds"
    if "node affinity/selector" in lowered or "didn't match" in lowered:
        return "no node pool has this accelerator: create one, or enable node auto-provisioning"
    return None
