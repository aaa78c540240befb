"""Test-only: GKE's node pools and cluster autoscaler as they behave, on the test control plane (kube_cluster).

The fixed nodes of ``kube_cluster.GKE_NODE_POOLS`` are always there; real accelerator node pools are not. This model
adds node pools that start at zero nodes and an autoscaler loop (a thread in the test process, talking to the real
kube-apiserver through the kubernetes client) that does what GKE's cluster autoscaler documents:

* it looks at pods the scheduler marked unschedulable (``PodScheduled=False``, reason ``Unschedulable``) every scan,
  and after ``verdict_seconds`` says on the pod what it decided, as Kubernetes Events from ``cluster-autoscaler``:
  ``TriggeredScaleUp`` ("pod triggered scale-up: [{<MIG> 0->1 (max: 3)}]"), ``NotTriggerScaleUp`` ("pod didn't
  trigger scale-up: ...", with the reasons per node group: no node group matches the pod's node affinity/selector,
  a group is at its max size, a group is in backoff after a failed scale-up), ``FailedScaleUp`` when the VM could
  not be created (GCE stockout: "Node scale up in zones <zone> associated with this pod failed: GCE out of
  resources. Pod is at risk of not being scheduled."). Repeats are aggregated (count, lastTimestamp) as client-go's
  event recorder does;
* a triggered node joins after ``provisioning_seconds`` (labels, capacity and taints as GKE sets them on that node
  pool; registered with the Docker kubelet so pods run on it), unless the pool is stocked out: then the scale-up
  fails after ``failure_seconds`` and the node group is backed off for ``backoff_seconds``;
* a triggered scale-up raises the node group's target size: the node joins even when the pod that asked for it is
  gone (deleted, or placed elsewhere) — the FAQ's "How does scale-up work?": the autoscaler asks the cloud provider
  for nodes, which register in their own time — and a pod that comes unschedulable meanwhile and fits that node
  waits for it without another scale-up (the autoscaler simulates its upcoming nodes before it scales up again);
* a node with no pod left is removed after ``scale_down_seconds`` (down to the pool's ``min_nodes``);
* the status ConfigMap ``kube-system/cluster-autoscaler-status`` is kept up to date (cluster-wide and per node
  group health, ``cloudProviderTarget``, ``minSize``/``maxSize``, scale-up ``InProgress``/``NoActivity``/``Backoff``);
* a Spot node is reclaimed as GKE does it: a graceful node shutdown (the kubelet gives its pods the
  ``DisruptionTarget`` condition, SIGTERM, phase Failed), then the node is deleted (``DockerKubelet.shut_down_node``).

* each pool as the GKE API describes it (``NodePool.gke_node_pool``: a ``container_v1.NodePool`` with its machine
  type, attached GPUs, Spot, autoscaling bounds and instance group), for a fake of the API; a pool with
  ``autoscaling=False`` is one the autoscaler does not know (kept at its size by hand).

Every knob is a constructor argument (or ``NodePool`` field) a test sets in a line; ``back_off`` puts a pool's
node group in backoff at once; ``stock_out`` and ``restock``
change a pool's capacity while a test runs. Defaults follow the autoscaler's documented defaults scaled down for
tests; the documented ones are named beside them.

Sources:
  https://github.com/kubernetes/autoscaler/blob/master/cluster-autoscaler/FAQ.md ("What events are emitted by CA?":
  TriggeredScaleUp / NotTriggerScaleUp / FailedScaleUp on pods; the kube-system/cluster-autoscaler-status
  ConfigMap; scan interval 10 s; --max-node-provision-time 15 min; --scale-down-unneeded-time 10 min;
  --initial-node-group-backoff-duration 5 min)
  https://cloud.google.com/kubernetes-engine/docs/concepts/cluster-autoscaler (node pools scale between their
  minimum and maximum, from zero; the autoscaler works per node pool, on the pods' requests and node selectors)
  https://cloud.google.com/kubernetes-engine/docs/how-to/cluster-autoscaler-visibility (scale-up errors such as
  scale.up.error.out.of.resources: the zone has no capacity for the VM)
  https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms (Spot nodes: label cloud.google.com/gke-spot,
  reclaimed with a graceful node shutdown; pods get DisruptionTarget)
The event wording is the autoscaler's (as in the FAQ and in the events users quote from GKE clusters, e.g.
kubernetes/autoscaler#5938, #5692, 2i2c-org/infrastructure#2185).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml
from kubernetes import client

from kinetic_prefect import accelerators

STATUS_CONFIGMAP = ("kube-system", "cluster-autoscaler-status")
SOURCE = "cluster-autoscaler"
PROJECT = "kinetic-test"


def _now() -> datetime:
    return datetime.now(UTC)


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class NodePool:
    """One GKE node pool: one accelerator shape (its labels, capacity and taints from the catalog), Spot or not,
    scaled between ``min_nodes`` and ``max_nodes``. ``stocked_out``: the zone has no VM of this shape to give."""

    name: str
    accelerator: str  # a catalog name: "t4", "h100", "tpu-v6e-1"...
    spot: bool = False
    min_nodes: int = 0
    max_nodes: int = 3
    zone: str = "us-central1-a"
    stocked_out: bool = False
    autoscaling: bool = True  # False: a pool kept at its size by hand, which the autoscaler never grows
    nodes: list[str] = field(default_factory=list)
    backoff_until: float = 0.0
    backoff_reason: str = ""

    @property
    def spec(self) -> accelerators.AcceleratorSpec:
        return accelerators.resolve(self.accelerator)

    @property
    def instance_group(self) -> str:
        """The node group as the autoscaler names it on GKE: the pool's managed instance group URL."""
        return (
            f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/zones/{self.zone}/instanceGroups/"
            f"gke-{PROJECT}-{self.name}-grp"
        )

    def gke_node_pool(self) -> Any:
        """The pool as the GKE API's nodePools.list describes it (container_v1.NodePool): its machine type and
        attached GPUs, Spot, autoscaling bounds, the managed instance group the autoscaler names it by."""
        from google.cloud import container_v1

        spec = self.spec
        config = container_v1.NodeConfig(machine_type=spec.machine_type, spot=self.spot)
        if spec.family == "gpu":
            config.accelerators = [
                container_v1.AcceleratorConfig(
                    accelerator_type=spec.gke_accelerator, accelerator_count=spec.chips_per_host
                )
            ]
        autoscaling = container_v1.NodePoolAutoscaling(
            enabled=True, min_node_count=self.min_nodes, max_node_count=self.max_nodes
        )
        pool = container_v1.NodePool(
            name=self.name,
            config=config,
            initial_node_count=self.min_nodes,
            autoscaling=autoscaling if self.autoscaling else container_v1.NodePoolAutoscaling(),
            instance_group_urls=[self.instance_group.replace("/instanceGroups/", "/instanceGroupManagers/")],
            status=container_v1.NodePool.Status.RUNNING,
        )
        if spec.multi_host:
            pool.placement_policy = container_v1.NodePool.PlacementPolicy(
                type_=container_v1.NodePool.PlacementPolicy.Type.COMPACT, tpu_topology=spec.tpu_topology
            )
        return pool

    def labels(self) -> dict[str, str]:
        spec = self.spec
        labels = {
            "cloud.google.com/gke-nodepool": self.name,
            "node.kubernetes.io/instance-type": spec.machine_type,
            "topology.kubernetes.io/zone": self.zone,
            **spec.node_selector,
        }
        if self.spot:
            labels[accelerators.SPOT_LABEL] = "true"
        return labels

    def capacity(self) -> dict[str, str]:
        spec = self.spec
        return {spec.resource_name: str(spec.chips_per_host)} if spec.resource_name else {}

    def taints(self) -> list[dict[str, str]]:
        spec = self.spec
        taints = [{"key": spec.resource_name, "value": "present", "effect": "NoSchedule"}] if spec.resource_name else []
        if self.spot:
            taints.append({"key": accelerators.SPOT_LABEL, "value": "true", "effect": "NoSchedule"})
        return taints

    def fits(self, pod: Any) -> bool:
        """Would a new node of this pool take the pod: its node selector, its tolerations, its requests."""
        labels = self.labels()
        if any(labels.get(key) != value for key, value in (pod.spec.node_selector or {}).items()):
            return False
        for taint in self.taints():
            if not any(_tolerates(t, taint) for t in pod.spec.tolerations or []):
                return False
        capacity = self.capacity()
        for container in pod.spec.containers:
            for name, value in ((container.resources and container.resources.limits) or {}).items():
                if "/" in name and int(capacity.get(name, 0)) < int(value):
                    return False
        return True


def _tolerates(toleration: Any, taint: dict[str, str]) -> bool:
    if toleration.effect and toleration.effect != taint["effect"]:
        return False
    if toleration.operator == "Exists":
        return toleration.key in (None, "", taint["key"])
    return toleration.key == taint["key"] and (toleration.value or "") == taint["value"]


@dataclass
class _Waiting:
    """One unschedulable pod as the autoscaler tracks it."""

    namespace: str
    name: str
    uid: str
    seen_at: float
    decided_at: float = 0.0
    scale_up: tuple[NodePool, float] | None = None  # the pool it triggered and when


class GKEAutoscaler:
    """The model (see the module docstring). ``start()`` runs the loop; ``stop()`` removes its nodes and ConfigMap."""

    def __init__(
        self,
        kube: Any,
        pools: list[NodePool],
        verdict_seconds: float = 2.0,  # GKE: the scan runs every 10 s; a verdict comes within ~30 s (FAQ's SLO)
        provisioning_seconds: float = 3.0,  # GKE GPU nodes: minutes; TPU slices: longer
        failure_seconds: float = 1.0,  # how long GCE takes to say the VM cannot be created
        backoff_seconds: float = 300.0,  # --initial-node-group-backoff-duration: 5 min
        scale_down_seconds: float = 30.0,  # --scale-down-unneeded-time: 10 min
        scan_seconds: float = 0.5,
    ):
        self.kube, self.pools = kube, pools
        self.verdict_seconds, self.provisioning_seconds = verdict_seconds, provisioning_seconds
        self.failure_seconds, self.backoff_seconds = failure_seconds, backoff_seconds
        self.scale_down_seconds, self.scan_seconds = scale_down_seconds, scan_seconds
        self.core = client.CoreV1Api(kube.api())
        self.waiting: dict[str, _Waiting] = {}
        self.upcoming: list[tuple[NodePool, float]] = []  # scale-ups whose pod left before their node joined
        self.empty_since: dict[str, float] = {}
        self.events: list[tuple[str, str, str]] = []  # (pod, reason, message), for the tests' own assertions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gke-autoscaler", daemon=True)

    # ------------------------------------------------------------------ what a test does
    def start(self) -> GKEAutoscaler:
        for pool in self.pools:
            while len(pool.nodes) < pool.min_nodes:
                self._add_node(pool)
        self._write_status()
        self._thread.start()
        return self

    def pool(self, name: str) -> NodePool:
        return next(p for p in self.pools if p.name == name)

    def stock_out(self, name: str) -> None:
        self.pool(name).stocked_out = True

    def back_off(self, name: str, reason: str = "out of resources") -> None:
        """The pool's node group backed off, as after a failed scale-up (its status ConfigMap says so at once)."""
        pool = self.pool(name)
        pool.backoff_until, pool.backoff_reason = time.monotonic() + self.backoff_seconds, reason
        self._write_status()

    def restock(self, name: str) -> None:
        pool = self.pool(name)
        pool.stocked_out, pool.backoff_until = False, 0.0

    def reclaim(self, node: str, grace: int = 10) -> None:
        """Compute Engine reclaims a Spot VM: a graceful node shutdown, then the node leaves the cluster."""
        [pool] = [p for p in self.pools if node in p.nodes]  # never one of the session's fixed nodes
        assert pool.spot, f"{node} is not a Spot node: only Spot VMs are reclaimed"
        pool.nodes.remove(node)
        self.empty_since.pop(node, None)
        self.kube.kubelet.shut_down_node(node, grace)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for pool in self.pools:
            for node in list(pool.nodes):
                self._remove_node(pool, node)
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.delete_namespaced_config_map(STATUS_CONFIGMAP[1], STATUS_CONFIGMAP[0])

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._scan()
            except Exception as exc:  # keep going: tests assert on outcomes, and the log says why
                print(f"gke-autoscaler: {exc!r}")
            self._stop.wait(self.scan_seconds)

    def _scan(self) -> None:
        now = time.monotonic()
        pods = self.core.list_pod_for_all_namespaces().items
        unschedulable = {p.metadata.uid: p for p in pods if _unschedulable(p)}
        for uid in set(self.waiting) - set(unschedulable):
            gone = self.waiting.pop(uid)  # placed, or deleted
            if gone.scale_up is not None:  # its node is on its way all the same
                self.upcoming.append(gone.scale_up)
        for pool, since in list(self.upcoming):
            if pool.stocked_out or now - since >= self.provisioning_seconds:
                self.upcoming.remove((pool, since))
                if not pool.stocked_out:
                    self._add_node(pool)
        for uid, pod in unschedulable.items():
            entry = self.waiting.setdefault(uid, _Waiting(pod.metadata.namespace, pod.metadata.name, uid, now))
            self._consider(entry, pod, now)
        self._scale_down(pods, now)
        self._write_status()

    def _consider(self, entry: _Waiting, pod: Any, now: float) -> None:
        if entry.scale_up is not None:
            pool, since = entry.scale_up
            if pool.stocked_out and now - since >= self.failure_seconds:
                pool.backoff_until, pool.backoff_reason = now + self.backoff_seconds, "out of resources"
                entry.scale_up, entry.decided_at = None, now
                self._event(
                    entry,
                    "Warning",
                    "FailedScaleUp",
                    f"Node scale up in zones {pool.zone} associated with this pod failed: GCE out of resources. "
                    "Pod is at risk of not being scheduled.",
                )
            elif not pool.stocked_out and now - since >= self.provisioning_seconds:
                self._add_node(pool)
                entry.scale_up, entry.decided_at = None, now  # the scheduler places it on the new node
            return
        if not entry.decided_at and (claimed := next((u for u in self.upcoming if u[0].fits(pod)), None)):
            self.upcoming.remove(claimed)  # the node on its way is this pod's: no new scale-up
            entry.scale_up, entry.decided_at = claimed, now
            return
        if now - (entry.decided_at or entry.seen_at) < self.verdict_seconds:
            return
        entry.decided_at = now
        matching = [p for p in self.pools if p.autoscaling and p.fits(pod)]
        ready = [p for p in matching if p.backoff_until <= now and len(p.nodes) < p.max_nodes]
        if ready:
            pool = ready[0]
            size = len(pool.nodes)
            entry.scale_up = (pool, now)
            self._event(
                entry,
                "Normal",
                "TriggeredScaleUp",
                f"pod triggered scale-up: [{{{pool.instance_group} {size}->{size + 1} (max: {pool.max_nodes})}}]",
            )
            return
        reasons = []
        if len(self.pools) > len(matching):
            reasons.append(f"{len(self.pools) - len(matching)} node(s) didn't match Pod's node affinity/selector")
        if backed_off := [p for p in matching if p.backoff_until > now]:
            reasons.append(f"{len(backed_off)} in backoff after failed scale-up")
        if at_max := [p for p in matching if p.backoff_until <= now and len(p.nodes) >= p.max_nodes]:
            reasons.append(f"{len(at_max)} max node group size reached")
        self._event(entry, "Normal", "NotTriggerScaleUp", "pod didn't trigger scale-up: " + ", ".join(reasons))

    def _scale_down(self, pods: list[Any], now: float) -> None:
        busy = {p.spec.node_name for p in pods if p.spec.node_name and p.status.phase in ("Pending", "Running")}
        for pool in self.pools:
            for node in list(pool.nodes):
                if node in busy:
                    self.empty_since.pop(node, None)
                    continue
                since = self.empty_since.setdefault(node, now)
                if now - since >= self.scale_down_seconds and len(pool.nodes) > pool.min_nodes:
                    self._remove_node(pool, node)

    # ------------------------------------------------------------------ nodes, events, status
    def _add_node(self, pool: NodePool) -> str:
        name = f"gke-{PROJECT}-{pool.name}-{uuid.uuid4().hex[:4]}"
        self.kube.plane.add_node(
            name, pool.labels(), pool.capacity(), pool.taints(), kubelet_port=self.kube.kubelet.port
        )
        self.kube.kubelet.nodes.add(name)
        pool.nodes.append(name)
        return name

    def _remove_node(self, pool: NodePool, node: str) -> None:
        pool.nodes.remove(node)
        self.empty_since.pop(node, None)
        self.kube.kubelet.nodes.discard(node)
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.delete_node(node)

    def _event(self, entry: _Waiting, kind: str, reason: str, message: str) -> None:
        """An Event on the pod from the autoscaler; a repeat of the same reason and message is counted on it."""
        self.events.append((entry.name, reason, message))
        stamp = _stamp(_now())
        name = f"{entry.name}.{uuid.uuid5(uuid.NAMESPACE_URL, entry.uid + reason + message).hex[:16]}"
        try:
            found = self.core.read_namespaced_event(name, entry.namespace)
            self.core.patch_namespaced_event(
                name, entry.namespace, {"count": (found.count or 1) + 1, "lastTimestamp": stamp}
            )
            return
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
        self.core.create_namespaced_event(
            entry.namespace,
            {
                "metadata": {"name": name, "namespace": entry.namespace},
                "involvedObject": {
                    "kind": "Pod",
                    "namespace": entry.namespace,
                    "name": entry.name,
                    "uid": entry.uid,
                    "apiVersion": "v1",
                },
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": SOURCE},
                "reportingComponent": SOURCE,
                "count": 1,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
            },
        )

    def _write_status(self) -> None:
        """kube-system/cluster-autoscaler-status in the autoscaler's YAML form."""
        now = time.monotonic()
        stamp = _stamp(_now())
        in_flight = [entry.scale_up[0].name for entry in self.waiting.values() if entry.scale_up]
        in_flight += [pool.name for pool, _ in self.upcoming]
        groups = []
        for pool in [p for p in self.pools if p.autoscaling]:  # the autoscaler knows the pools it scales
            target = len(pool.nodes) + sum(1 for name in in_flight if name == pool.name)
            if pool.backoff_until > now:
                scale_up: dict[str, Any] = {
                    "status": "Backoff",
                    "backoffInfo": {"errorCode": "OUT_OF_RESOURCES", "errorMessage": pool.backoff_reason},
                }
            else:
                scale_up = {"status": "InProgress" if pool.name in in_flight else "NoActivity"}
            groups.append(
                {
                    "name": pool.instance_group,
                    "health": {
                        "status": "Healthy",
                        "nodeCounts": {"registered": {"total": len(pool.nodes), "ready": len(pool.nodes)}},
                        "cloudProviderTarget": target,
                        "minSize": pool.min_nodes,
                        "maxSize": pool.max_nodes,
                    },
                    "scaleUp": {**scale_up, "lastProbeTime": stamp},
                    "scaleDown": {"status": "NoCandidates", "lastProbeTime": stamp},
                }
            )
        status = {
            "time": stamp,
            "autoscalerStatus": "Running",
            "clusterWide": {
                "health": {"status": "Healthy", "lastProbeTime": stamp},
                "scaleUp": {"status": "InProgress" if in_flight else "NoActivity", "lastProbeTime": stamp},
                "scaleDown": {"status": "NoCandidates", "lastProbeTime": stamp},
            },
            "nodeGroups": groups,
        }
        namespace, name = STATUS_CONFIGMAP
        body = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "annotations": {"cluster-autoscaler.kubernetes.io/last-updated": stamp},
            },
            "data": {"status": yaml.safe_dump(status, sort_keys=False)},
        }
        try:
            self.core.replace_namespaced_config_map(name, namespace, body)
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
            self.core.create_namespaced_config_map(namespace, body)


def _unschedulable(pod: Any) -> bool:
    if pod.spec.node_name or pod.metadata.deletion_timestamp is not None or pod.status.phase != "Pending":
        return False
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in pod.status.conditions or []
    )
