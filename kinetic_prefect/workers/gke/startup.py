"""A kinetic-gke job's start-up timeline (workers/startup.py) from what Kubernetes recorded on its pod: the
scheduler's PodScheduled condition (node ready), the cluster autoscaler's TriggeredScaleUp event (scale-up asked),
the kubelet's Pulled event (image pulled), the container's state (started, finished)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kinetic_prefect.contract import (
    STARTUP_CONTAINER_STARTED,
    STARTUP_FINISHED,
    STARTUP_FIRST_LINE,
    STARTUP_IMAGE_PULLED,
    STARTUP_NODE_READY,
    STARTUP_SCALE_UP_ASKED,
)
from kinetic_prefect.workers.startup import Timeline


def first_line_marker(timeline: Timeline, emit: Callable[[str], None]) -> Callable[[str], None]:
    """``emit`` that marks the first line of output it is handed."""

    def marked(text: str) -> None:
        if text.strip():
            timeline.mark(STARTUP_FIRST_LINE)
        emit(text)

    return marked


def _stamp(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def from_pod(timeline: Timeline, pod: Any, events: list[Any]) -> None:
    """The steps the pod's own record holds; ``events`` are the pod's Events (kubernetes client objects)."""
    status = pod.status
    scheduled = next((c for c in (status.conditions or []) if c.type == "PodScheduled" and c.status == "True"), None)
    if scheduled is not None and scheduled.last_transition_time is not None:
        timeline.mark(STARTUP_NODE_READY, _stamp(scheduled.last_transition_time), pod.spec.node_name)
    by_reason: dict[str, Any] = {}
    for event in events:
        by_reason.setdefault(event.reason or "", event)
    if (asked := by_reason.get("TriggeredScaleUp")) is not None:
        at = _stamp(asked.first_timestamp or asked.event_time or asked.metadata.creation_timestamp)
        timeline.mark(STARTUP_SCALE_UP_ASKED, at, "the cluster autoscaler, for the job's pod")
    elif STARTUP_SCALE_UP_ASKED not in timeline.at:
        timeline.note(STARTUP_SCALE_UP_ASKED, "none: a node had room")
    if (pulled := by_reason.get("Pulled")) is not None:
        at = _stamp(pulled.last_timestamp or pulled.event_time or pulled.metadata.creation_timestamp)
        timeline.mark(STARTUP_IMAGE_PULLED, at, (pulled.message or "")[:120])
    else:
        timeline.note(STARTUP_IMAGE_PULLED, "no Pulled event seen")
    container = (status.container_statuses or [None])[0]
    state = container.state if container is not None else None
    running = state.running if state is not None else None
    ended = state.terminated if state is not None else None
    started = (running.started_at if running is not None else None) or (ended.started_at if ended else None)
    if started is not None:
        timeline.mark(STARTUP_CONTAINER_STARTED, _stamp(started))
    if ended is not None and ended.finished_at is not None:
        timeline.mark(STARTUP_FINISHED, _stamp(ended.finished_at), f"exit {ended.exit_code}")


def read_events(api: Any, namespace: str, pod_name: str) -> list[Any]:
    """The pod's Events, oldest first (one list call)."""
    from kubernetes import client

    items = client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod_name}")
    mine = [e for e in items.items if e.involved_object is not None and e.involved_object.name == pod_name]
    return sorted(mine, key=lambda e: _stamp(e.first_timestamp or e.metadata.creation_timestamp) or 0.0)


def reused_warm_pod(timeline: Timeline, where: str) -> None:
    """A call handed to a warm pod: no node, no pull, no container start of its own."""
    for step in (STARTUP_SCALE_UP_ASKED, STARTUP_NODE_READY, STARTUP_IMAGE_PULLED, STARTUP_CONTAINER_STARTED):
        timeline.note(step, f"reused warm pod {where}")
