"""Capacity: accelerator fallback lists, and telling a preemption from a failure.

Leaf module (stdlib and the catalog only): the caller validates fallback lists with it at decoration, the worker
decides with it what to try next, and the pod never needs it. Kubernetes objects are read as plain dicts
(``ApiClient().sanitize_for_serialization``), so every rule here is testable without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.accelerators import AcceleratorSpec

# How the accelerators of a fallback list travel in the pool's `accelerator` variable: one string, in order.
SEPARATOR = ","
DEFAULT_PREEMPTION_RETRIES = 3
DEFAULT_CAPACITY_WAIT_SECONDS = 300

# How long the cluster autoscaler may take to say whether it adds a node for a pod no node matches: its scan runs
# every 10 s and its documented scale-up latency is within 30 s (60 s on large clusters). A pool at zero nodes looks,
# to the scheduler, exactly like no pool at all until then.
DEFAULT_AUTOSCALER_VERDICT_SECONDS = 60
# How long a node the autoscaler is adding may take to join: the autoscaler's own --max-node-provision-time is 15
# minutes; a TPU slice's nodes are created together and take longer, so they get twice that.
DEFAULT_PROVISIONING_TIMEOUT_SECONDS = 900
DEFAULT_TPU_PROVISIONING_TIMEOUT_SECONDS = 1800

# What the cluster said about a pod that is not placed (JobStatus.capacity).
NO_NODE_POOL = "no-node-pool"  # no node carries the accelerator: nothing will change by waiting
INSUFFICIENT_CAPACITY = "insufficient"  # nodes exist but are full, or the autoscaler failed to add one
AWAITING_AUTOSCALER = "awaiting-autoscaler"  # no node matches yet, and the autoscaler has not said whether it adds one
SCALING_UP = "scaling-up"  # the autoscaler is adding a node for it

# The reasons Kubernetes gives a pod's DisruptionTarget condition, said for a person.
DISRUPTION_REASONS = {
    "TerminationByKubelet": "its node shut down (spot preemption, maintenance or node-pressure eviction)",
    "DeletionByPodGC": "its node was deleted",
    "DeletionByTaintManager": "its node became unreachable (NoExecute taint)",
    "PreemptionByScheduler": "a higher-priority pod took its place",
    "EvictionByEvictionAPI": "it was evicted (node drain or upgrade)",
}
GRACEFUL_SHUTDOWN_REASONS = ("Terminated", "Shutdown", "NodeShutdown")


def choices(
    accelerator: str | AcceleratorSpec | Sequence[str | AcceleratorSpec], hosts: int | None = None
) -> list[AcceleratorSpec]:
    """Resolve one accelerator or a fallback list (a list, or names joined by commas), in order.

    Every name must be in the catalog, none twice, and every entry must run the same number of hosts: the body
    cannot be written for one process on an l4 and four on a multi-host slice at once."""
    if isinstance(accelerator, (str, AcceleratorSpec)):
        items: list[Any] = split(accelerator) if isinstance(accelerator, str) else [accelerator]
    elif isinstance(accelerator, (list, tuple)):
        items = list(accelerator)
    else:
        raise TypeError(f"accelerator must be a name or a list of names, not {type(accelerator).__name__}")
    if not items:
        raise ValueError("accelerator=[]: give at least one accelerator name, e.g. accelerator=['a100x4', 'l4x4']")
    specs: list[AcceleratorSpec] = []
    for item in items:
        try:
            specs.append(accelerators.resolve(item))
        except accelerators.UnknownAcceleratorError as exc:
            if len(items) == 1:
                raise
            raise accelerators.UnknownAcceleratorError(f"in the fallback list {items!r}: {exc}") from None
    seen: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if label(spec) in seen:
            raise ValueError(
                f"accelerator list {items!r} names {label(spec)!r} twice (positions {seen[label(spec)]}"
                f" and {index}): drop the repeat"
            )
        seen[label(spec)] = index
    counts = {label(spec): accelerators.host_count(spec, hosts) for spec in specs}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name}: {count}" for name, count in counts.items())
        multi = max(counts.values())
        raise ValueError(
            f"accelerator list {items!r} mixes host counts ({shown}): one body cannot expect both. "
            f"List accelerators with the same hosts, or set hosts={multi} so every single-host entry "
            f"runs as a group of {multi} (a multi-host slice must have exactly that many hosts)"
        )
    return specs


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(SEPARATOR) if part.strip()] or [text]


def label(spec: AcceleratorSpec) -> str:
    """The spelling that round-trips through `resolve` (``:spot`` kept)."""
    return spec.name + (":spot" if spec.spot else "")


def join(specs: Iterable[AcceleratorSpec]) -> str:
    return SEPARATOR.join(label(spec) for spec in specs)


def provisioning_timeout(spec: AcceleratorSpec, configured: float | None) -> float:
    """How long a node the autoscaler is adding for ``spec`` may take: the pool's setting, else by family."""
    if configured is not None:
        return float(configured)
    return DEFAULT_TPU_PROVISIONING_TIMEOUT_SECONDS if spec.family == "tpu" else DEFAULT_PROVISIONING_TIMEOUT_SECONDS


def chip_count(spec: AcceleratorSpec) -> int:
    """Chips one host of the job sees (what the body sizes its per-host batch by); 0 on the CPU."""
    return spec.chips_per_host if spec.resource_name else 0


# ----------------------------------------------------------------------------- preemption


def _conditions(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("status") or {}).get("conditions") or [])


def oom_killed(pod: dict[str, Any]) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated") or {}
        if terminated.get("reason") == "OOMKilled":
            return True
    return False


def pod_disruption(pod: dict[str, Any] | None, node_exists: bool | None = None) -> str | None:
    """Why the infrastructure took this pod away (a preemption), or None when it ended by itself.

    The signals, as Kubernetes gives them: the ``DisruptionTarget`` condition with its reason (set by the kubelet
    on a graceful node shutdown, by the pod GC when the node is deleted, by the taint manager, the scheduler and
    the eviction API); a graceful node shutdown's pod reason from kubelets that predate the condition; a pod
    bound to a node that no longer exists. A container the kernel OOM-killed is the job's own doing, never a
    preemption, whatever else is set."""
    if not pod:
        return None
    if oom_killed(pod):
        return None
    for condition in _conditions(pod):
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            reason = condition.get("reason") or ""
            said = DISRUPTION_REASONS.get(reason, condition.get("message") or "it was disrupted")
            return f"{said} [DisruptionTarget: {reason or '?'}]"
    status = pod.get("status") or {}
    message = (status.get("message") or "").lower()
    if status.get("reason") in GRACEFUL_SHUTDOWN_REASONS and "shutdown" in message:
        return f"its node shut down [{status.get('reason')}: {status.get('message')}]"
    node = (pod.get("spec") or {}).get("nodeName")
    if node and node_exists is False:
        return f"its node {node} was deleted under it"
    return None


def job_disruption(job: dict[str, Any] | None) -> str | None:
    """The Job's own record of a disruption: a ``podFailurePolicy`` rule on ``DisruptionTarget`` matched (the
    record survives the pod, which the pod GC deletes with its node)."""
    for condition in ((job or {}).get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") in ("Failed", "FailureTarget")
            and condition.get("status") == "True"
            and condition.get("reason") == "PodFailurePolicy"
            and "DisruptionTarget" in (condition.get("message") or "")
        ):
            return f"its pod was disrupted [{condition.get('message')}]"
    return None


# ----------------------------------------------------------------------------- the plan of attempts


@dataclass
class Attempt:
    accelerator: str
    spot: bool
    ended: str = ""  # why the next attempt was made ("no node pool", "preempted: ..."), empty for the last


def _within(seconds: float) -> str:
    """``in N s``, or, for the endless wait the lifecycle passes when the pod watch has timed out, that."""
    return "before the pod watch timed out" if math.isinf(seconds) else f"in {seconds:.0f}s"


@dataclass
class CapacityPlan:
    """What to try next, for one job's run: the fallback list in order until one is placed, then, once the job
    has started, the same accelerator again after each preemption while the budget lasts (on-demand for the last
    attempt with ``spot_fallback``); a retry that cannot be placed in its turn moves on down the list, as a first
    attempt does. Pure bookkeeping: the worker feeds it what the cluster says."""

    specs: list[AcceleratorSpec]
    preemption_retries: int = DEFAULT_PREEMPTION_RETRIES
    spot_fallback: bool = False
    capacity_wait_seconds: float = DEFAULT_CAPACITY_WAIT_SECONDS
    provisioning_timeout_seconds: float | None = None  # None: by family (provisioning_timeout)
    verdict_seconds: float = DEFAULT_AUTOSCALER_VERDICT_SECONDS
    index: int = 0
    started: bool = False
    preemptions: int = 0
    on_demand: bool = False
    resumed: str | None = None  # how far the last preempted attempt had come ("step 1,200")
    attempts: list[Attempt] = field(default_factory=list)
    instead_of: str | None = None  # kinetic-local: the accelerator asked for, which this machine lacks (ran on cpu)

    def __post_init__(self) -> None:
        if not self.attempts:
            self.attempts.append(Attempt(label(self.current), self.current.spot))

    @property
    def current(self) -> AcceleratorSpec:
        spec = self.specs[self.index]
        return spec.with_spot(False) if self.on_demand else spec

    @property
    def has_fallback(self) -> bool:
        return not self.started and self.index + 1 < len(self.specs)

    def fallback_after(
        self, capacity: str | None, waited_seconds: float, scaling_up_seconds: float = 0.0
    ) -> AcceleratorSpec | None:
        """The next accelerator when this one cannot be placed, or None (keep waiting): at once when no node pool
        has it; after the autoscaler's verdict window when no node matches and the autoscaler has not answered;
        after the provisioning timeout when the node it is adding does not come; after the capacity wait when
        nodes are full or a scale-up failed (a stockout). ``waited_seconds``: this attempt's time pending;
        ``scaling_up_seconds``: the part of it a node was on its way, which the capacity wait does not count.
        Never while the job runs, never past the list's end."""
        if not capacity or not self.has_fallback:
            return None
        without_capacity = waited_seconds - scaling_up_seconds
        if capacity == NO_NODE_POOL:
            why = "no node pool has it"
        elif capacity == AWAITING_AUTOSCALER:
            if waited_seconds < self.verdict_seconds:
                return None
            why = f"no node pool has it (no node matched and the autoscaler added none in {waited_seconds:.0f}s)"
        elif capacity == SCALING_UP:
            timeout = provisioning_timeout(self.current, self.provisioning_timeout_seconds)
            if scaling_up_seconds < timeout:
                return None
            why = f"the node the autoscaler was adding did not join {_within(scaling_up_seconds)}"
        elif without_capacity < self.capacity_wait_seconds:
            return None
        else:
            why = (
                "no capacity before the pod watch timed out"
                if math.isinf(without_capacity)
                else f"no capacity for {without_capacity:.0f}s (capacity_wait_seconds={self.capacity_wait_seconds:g})"
            )
        self.attempts[-1].ended = why
        self.index += 1
        self.attempts.append(Attempt(label(self.current), self.current.spot))
        return self.current

    def retry_after_preemption(self, reason: str) -> AcceleratorSpec | None:
        """The spec for the next attempt after a preemption, or None when the budget is spent."""
        self.preemptions += 1
        self.attempts[-1].ended = f"preempted: {reason}"
        if self.preemptions > self.preemption_retries:
            return None
        # The retry is placed like a first attempt: when the preempted accelerator's capacity is gone with the
        # reclaimed VMs, the list's next entries are there for it (the body handles each of them).
        self.started = False
        last = self.preemptions == self.preemption_retries
        if last and self.spot_fallback and self.specs[self.index].spot:
            self.on_demand = True
        self.attempts.append(Attempt(label(self.current), self.current.spot))
        return self.current

    def summary(self) -> str:
        """One line for a state message and the artifact: which accelerator ran, what was tried before it."""
        parts = [f"ran on {label(self.current)}"]
        if self.instead_of:
            parts[0] += f" ({self.instead_of} was asked for; this machine has none)"
        tried = [f"{a.accelerator} ({a.ended})" for a in self.attempts[:-1] if not a.ended.startswith("preempted")]
        if tried:
            parts.append("after " + ", ".join(tried))
        if self.preemptions:
            text = f"preempted {self.preemptions}×"
            if self.resumed:
                text += f", resumed from {self.resumed}"
            parts.append(text)
        return "; ".join(parts)

    @property
    def eventful(self) -> bool:
        return len(self.attempts) > 1 or self.preemptions > 0
