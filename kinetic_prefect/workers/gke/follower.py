"""Following one Job: its pods, their log streams, events and exits, and each pod's billed span."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.workers.gke import kube
from kinetic_prefect.workers.gke.capacity import (
    AUTOSCALER_STATUS_CONFIGMAP,
    KUEUE_GROUP,
    KUEUE_JOB_UID_LABEL,
    KUEUE_QUEUE_LABEL,
    KUEUE_VERSIONS,
    kueue_queued,
    pending_hint,
)
from kinetic_prefect.workers.gke.kube import CONFIG_ERRORS, IMAGE_PULL_ERRORS, INDEX_ANNOTATION, JobGone, kube_retry
from kinetic_prefect.workers.gke.variables import CONTAINER


class JobFollower:
    """Follows one Job to its end through the Kubernetes API (blocking calls, run in a thread)."""

    def __init__(self, api_client, namespace: str, job_name: str, on_line: Callable[[str], None]):
        from kubernetes import client

        self.batch, self.core = client.BatchV1Api(api_client), client.CoreV1Api(api_client)
        self.namespace, self.job_name, self.on_line = namespace, job_name, on_line
        self._log_thread: threading.Thread | None = None
        self._log_failed = False
        self._lines_forwarded = 0
        self.last_pods: list[Any] = []  # what the last read saw: metering reads it (no extra API call)
        self.gone_at: float | None = None  # when the Job was first seen deleted
        self.last_job: Any = None  # the Job as last read (its conditions outlive a pod the pod GC deleted)
        self.timeout = kube.READ_TIMEOUT

    @property
    def log_failed(self) -> bool:
        """Whether the last log stream broke (``stream_logs(again=True)`` then opens a new one)."""
        return self._log_failed

    def _job_pods(self) -> list[Any]:
        """The Job's pods, oldest first; JobGone when the Job itself was deleted."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.last_job = self.batch.read_namespaced_job(self.job_name, self.namespace, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                self.gone_at = self.gone_at or time.time()
                raise JobGone(self.job_name) from None
            raise
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"job-name={self.job_name}", _request_timeout=self.timeout
        ).items
        # Filter here too: some API servers (and emulators) ignore label selectors.
        mine = [p for p in pods if p.metadata and (p.metadata.labels or {}).get("job-name") == self.job_name]
        self.last_pods = sorted(mine, key=lambda p: p.metadata.creation_timestamp or 0)
        return self.last_pods

    def pod(self):
        """A single-pod Job's newest pod (None before the Job controller made one)."""
        pods = self._job_pods()
        return pods[-1] if pods else None

    def pods(self) -> dict[int, Any]:
        """A group's pods by host index (the newest pod of each index)."""
        by_index: dict[int, Any] = {}
        for pod in self._job_pods():
            by_index[int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, 0))] = pod
        return by_index

    def pod_events(self, name: str) -> list[tuple[str, str]]:
        """The pod's events as ``(reason, message)``, oldest first by when each was last seen (a repeated event is
        one object whose lastTimestamp moves): the autoscaler's latest verdict is the last of its reasons."""
        events = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}", _request_timeout=self.timeout
        ).items
        # Filter here too: some API servers (and emulators) ignore field selectors.
        mine = [e for e in events if e.involved_object is not None and e.involved_object.name == name]

        def seen(event: Any) -> float:
            at = event.last_timestamp or event.event_time or event.first_timestamp or event.metadata.creation_timestamp
            return at.timestamp() if at is not None else 0.0

        return [(e.reason or "", e.message or "") for e in sorted(mine, key=seen)]

    def autoscaler_present(self) -> bool | None:
        """Whether the cluster runs the cluster autoscaler (its status ConfigMap exists); None: not known (the
        worker's namespaced Role may not read kube-system)."""
        namespace, name = AUTOSCALER_STATUS_CONFIGMAP
        return _exists(self.core.read_namespaced_config_map, name, namespace, _request_timeout=self.timeout)

    def kueue_queued(self) -> str | None:
        """Where the suspended Job waits in Kueue (capacity.kueue_queued); None when the worker may not read
        Kueue's objects (its Role predates them); a warning when the cluster serves no Kueue API at all."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        job = self.last_job
        queue = (job.metadata.labels or {}).get(KUEUE_QUEUE_LABEL, "")
        custom = client.CustomObjectsApi(self.batch.api_client)
        for version in KUEUE_VERSIONS:
            try:
                found: Any = custom.list_namespaced_custom_object(
                    KUEUE_GROUP,
                    version,
                    self.namespace,
                    "workloads",
                    label_selector=f"{KUEUE_JOB_UID_LABEL}={job.metadata.uid}",
                    _request_timeout=self.timeout,
                )
                workload = next(iter(found.get("items") or []), None)
            except ApiException as exc:
                if exc.status == 404:
                    continue  # this Kueue API version is not served
                return None
            admission = ((workload or {}).get("status") or {}).get("admission") or {}
            cluster_queue = admission.get("clusterQueue") or (queue and self._cluster_queue(custom, version, queue))
            return kueue_queued(queue, workload, cluster_queue or None)
        return (
            f"queued for Kueue, but the cluster serves no {KUEUE_GROUP} API: the Job stays suspended until Kueue "
            "is installed (or the pool's queued_provisioning is cleared)"
        )

    def _cluster_queue(self, custom, version: str, queue: str) -> str | None:
        """The ClusterQueue behind a LocalQueue; None when it is missing (its Workload then says so) or unreadable."""
        from kubernetes.client.exceptions import ApiException

        try:
            local = custom.get_namespaced_custom_object(
                KUEUE_GROUP, version, self.namespace, "localqueues", queue, _request_timeout=self.timeout
            )
        except ApiException:
            return None
        return (local.get("spec") or {}).get("clusterQueue")

    def node_exists(self, name: str) -> bool | None:
        """None: not known (the worker's namespaced Role may not read nodes, which are cluster-wide)."""
        return _exists(self.core.read_node, name, _request_timeout=self.timeout)

    def disruption(self, pod) -> str | None:
        """Why the infrastructure took the pod away (capacity.pod_disruption), or the Job's own record of it."""
        from kubernetes.client import ApiClient

        from kinetic_prefect.shared import capacity

        as_dict = ApiClient().sanitize_for_serialization(pod) if pod is not None else None
        node = pod.spec.node_name if pod is not None and pod.spec else None
        found = capacity.pod_disruption(as_dict, self.node_exists(node) if node else None)
        if found is None and not (as_dict and capacity.oom_killed(as_dict)):
            found = capacity.job_disruption(ApiClient().sanitize_for_serialization(self.last_job))
        return found

    def events_for(self, name: str) -> list[str]:
        events = self.core.list_namespaced_event(self.namespace, _request_timeout=self.timeout).items
        return [
            f"{e.reason}: {e.message}"
            for e in events
            if e.involved_object is not None and e.involved_object.name == name and e.type != "Normal"
        ]

    def stream_logs(self, pod_name: str, again: bool = False) -> None:
        """Follow the container's log in a thread. ``again`` (once the pod has ended) reads the whole
        log once more and forwards only lines not yet forwarded: a stream that broke or ended early
        loses nothing, and a complete one adds nothing."""
        if self._log_thread is not None and not (again or self._log_failed):
            return
        if self._log_thread is not None:
            self._log_thread.join(5)
        self._log_failed = False

        def pump() -> None:
            seen = 0
            try:
                response: Any = self.core.read_namespaced_pod_log(
                    pod_name, self.namespace, container=CONTAINER, follow=True, _preload_content=False
                )
                if "json" in (response.headers.get("Content-Type") or ""):
                    raise RuntimeError("not a log yet")  # an object/Status instead of text: try again later
                buffer = b""
                for chunk in response.stream(4096):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        seen += 1
                        if seen > self._lines_forwarded:
                            self._lines_forwarded += 1
                            self.on_line(line.decode(errors="replace"))
                if buffer and seen + 1 > self._lines_forwarded:
                    self._lines_forwarded += 1
                    self.on_line(buffer.decode(errors="replace"))
            except Exception:  # not readable yet (or the stream broke): the next call retries
                self._log_failed = True

        self._log_thread = threading.Thread(target=pump, name=f"logs-{pod_name}", daemon=True)
        self._log_thread.start()

    def finish_logs(self, timeout: float = 10) -> None:
        if self._log_thread is not None:
            self._log_thread.join(timeout)

    @staticmethod
    def pending_problem(pod) -> str | None:
        """A reason that will not fix itself (bad image, bad config): fail now, not at the timeout."""
        for status in (pod.status.container_statuses or []) if pod.status else []:
            waiting = status.state.waiting if status.state else None
            if waiting and waiting.reason in IMAGE_PULL_ERRORS | CONFIG_ERRORS:
                return f"{waiting.reason}: {waiting.message or ''}".strip()
        return None

    def diagnose_pending(self, pod, placing: str | None = None) -> str:
        """Why the pod is still pending (its conditions and warning events) and what to do, by the autoscaler's
        verdict ``placing`` (``capacity.*``) when there is one."""
        reasons = []
        for condition in (pod.status.conditions or []) if pod and pod.status else []:
            if condition.status == "False" and condition.reason:
                reasons.append(f"{condition.reason}: {condition.message or ''}".strip())
        if pod is not None:
            reasons.extend(self.events_for(pod.metadata.name))
        text = "; ".join(dict.fromkeys(reasons)) or "no scheduling information from the cluster"
        hint = pending_hint(placing, text)
        return text + (f" ({hint})" if hint else "")

    def delete(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            kube_retry(self.batch.delete_namespaced_job)(self.job_name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise


# A pod being deleted whose process wrote no outcome this long after its grace period ran out: the process is gone
# (killed before it could write, or its node lost) even if no kubelet ever reports the pod's end.
DELETED_POD_MARGIN_SECONDS = 15.0


def deleted_for(pod: Any) -> float | None:
    """Seconds since a pod being deleted ran out of its grace period (negative while within it); None: not deleted."""
    when = pod.metadata.deletion_timestamp if pod.metadata is not None else None
    return None if when is None else time.time() - when.timestamp()


def pod_exit(pod: Any) -> tuple[int, str]:
    """A finished pod's container exit code and reason (the phase's, when no container recorded one)."""
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            return int(terminated.exit_code), terminated.reason or "terminated"
    return (0, "Succeeded") if pod.status.phase == "Succeeded" else (1, pod.status.reason or "Failed")


def pod_span(pod: Any, gone_at: float | None = None) -> Any:
    """A pod's billed span (``cost.HostSpan``): from its start (``status.startTime``) to its containers' end (the
    latest ``finishedAt``; else when the Job was seen deleted), at the spot rate when the pod was bound to spot
    nodes (its ``cloud.google.com/gke-spot`` node selector, as the manifest asks). None: it never started."""
    from kinetic_prefect.shared.cost import HostSpan

    status = pod.status
    if status is None or status.start_time is None:
        return None
    finished = [
        c.state.terminated.finished_at
        for c in (status.container_statuses or [])
        if c.state is not None and c.state.terminated is not None and c.state.terminated.finished_at
    ]
    running = [c for c in (status.container_statuses or []) if c.state is not None and c.state.terminated is None]
    end = max(finished).timestamp() if finished and not running else gone_at
    spot = ((pod.spec.node_selector or {}) if pod.spec is not None else {}).get(accelerators.SPOT_LABEL) == "true"
    return HostSpan(status.start_time.timestamp(), end, spot, _ran_at(status))


def _ran_at(status: Any) -> float | None:
    """When the pod's first container began to run (``state.running.startedAt``, kept as the terminated state's
    ``startedAt``): after the kubelet pulled the image. None while it has not run yet."""
    started = []
    for container in status.container_statuses or []:
        state = container.state
        for part in (state.running, state.terminated) if state is not None else ():
            if part is not None and part.started_at:
                started.append(part.started_at.timestamp())
    return min(started) if started else None


def _exists(read: Any, *args: Any, **kwargs: Any) -> bool | None:
    """Whether ``read(*args)`` finds its object: False on 404, None when the worker may not read it (401/403)."""
    from kubernetes.client.exceptions import ApiException

    try:
        read(*args, **kwargs)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        if exc.status in (401, 403):
            return None
        raise
