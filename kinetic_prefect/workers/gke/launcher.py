"""``GKEJobLauncher``: creating, finding, following, cancelling and cleaning up the Kubernetes Jobs of kinetic calls.

What prefect-kubernetes lacks and this launcher keeps: following a Job to its end from any worker (reattach after
a restart), the kinetic outcome record, pending pods diagnosed with prefect-kubernetes' vocabulary, and
cancellation that deletes the Job.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.diagnostics import diagnose_k8s_pod

from kinetic_prefect import accelerators
from kinetic_prefect.contract import (
    GKE_WORKER_TYPE,
    STARTUP_FINISHED,
    STARTUP_IMAGE_READY,
    STARTUP_SCALE_UP_ASKED,
    STARTUP_SUBMITTED,
    Env,
)
from kinetic_prefect.shared import builders, capacity
from kinetic_prefect.workers.base import open_job_store
from kinetic_prefect.workers.gke import capacity as gke_capacity
from kinetic_prefect.workers.gke import placeholder, prebuilt, warm
from kinetic_prefect.workers.gke import startup as gke_startup
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.follower import (
    DELETED_POD_MARGIN_SECONDS,
    JobFollower,
    deleted_for,
    pod_exit,
    pod_span,
)
from kinetic_prefect.workers.gke.kube import (
    FLOW_RUN_LABEL,
    GROUP_STOP_SECONDS,
    INDEX_ANNOTATION,
    POOL_LABEL,
    JobGone,
    is_transient_kube_error,
    kube_retry,
    label_value,
)
from kinetic_prefect.workers.gke.warm import WarmPods
from kinetic_prefect.workers.lifecycle import JobLauncher, JobStatus
from kinetic_prefect.workers.owner_heartbeat import Heartbeats, owned_here
from kinetic_prefect.workers.startup import Timeline

# How long a look at whether the cluster runs the cluster autoscaler stands.
AUTOSCALER_LOOK_SECONDS = 60.0


def _unschedulable(pod: Any) -> bool:
    """The scheduler has said it cannot place the pod (PodScheduled False)."""
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "PodScheduled" and c.status == "False" for c in conditions)


class GKEJobLauncher(JobLauncher):
    """A kinetic job as one Kubernetes Job (one pod, ``backoffLimit: 0``); identifiers are ``namespace:name``."""

    job_kind = "Kubernetes Job"

    def __init__(self) -> None:
        self._followers: dict[str, JobFollower] = {}
        self._emitters: dict[str, Callable[[str], None]] = {}
        self._pending_since: dict[str, float] = {}
        self._group_failed_at: dict[str, float] = {}
        # Per job: seconds a node was on its way for its pod (the autoscaler's TriggeredScaleUp), and since when
        # the current scale-up has been seen. That time counts against the provisioning timeout, not the others.
        self._scaling_up: dict[str, tuple[float, float | None]] = {}
        self._autoscaler_seen: dict[str, tuple[float, bool | None]] = {}  # per cluster: when looked, and found
        self._api: dict[str, Any] = {}
        self.warm = WarmPods(self.api)
        self._startup: dict[str, Timeline] = {}  # per job this worker submitted: its start-up as far as marked
        # In-process submission: the calling process's proof of life for its Jobs (owner_heartbeat.py)
        self.heartbeats = Heartbeats()
        self._run_ids: dict[str, str] = {}  # identifier -> the run id its heartbeat is kept under

    def api(self, configuration: KineticGKEJobConfiguration):
        key = configuration.cluster_key
        if key not in self._api:
            self._api[key] = configuration.kube_client()
        return self._api[key]

    def follower(self, identifier: str, configuration: KineticGKEJobConfiguration) -> JobFollower:
        if identifier not in self._followers:
            namespace, _, job_name = identifier.partition(":")
            emit = self._emitters.get(identifier, lambda line: None)
            self._followers[identifier] = JobFollower(
                self.api(configuration), namespace, job_name, lambda line: self._emitters.get(identifier, emit)(line)
            )
        return self._followers[identifier]

    async def submit(
        self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration, log: Callable[[str], None]
    ) -> str:
        configuration.image_given()  # decided before the image is set below
        timeline = Timeline()
        timeline.mark(STARTUP_SUBMITTED, flow_run.created.timestamp() if flow_run.created else None)
        image = await self._image_while_a_node_comes(flow_run, configuration, log, timeline)
        configuration.image = image
        configuration.job_manifest["spec"]["template"]["spec"]["containers"][0]["image"] = image
        api = await anyio.to_thread.run_sync(self.api, configuration)
        if warm.is_slot(configuration):
            warm.prepare_slot_pod(configuration)
        elif warm.wanted(configuration):
            handed, floor_pods = await self.warm.hand_over(flow_run, configuration, log)
            if handed is not None:
                gke_startup.reused_warm_pod(timeline, handed.partition("@")[0].replace(":", "/", 1))
                self._startup[handed] = timeline
                return handed
            identifier = self.warm.prepare_new_pod(flow_run, configuration, floor_pods < configuration.min_warm)
            await self.warm.record_new_pod(flow_run, configuration, identifier)
        run_id = str(configuration.env[Env.RUN_ID])
        # a plain Job of this process's own call (a warm pod or a slot outlives one call: it has its own limits)
        beating = not warm.wanted(configuration) and not warm.is_slot(configuration) and owned_here(flow_run)
        if beating and not self.heartbeats.following(run_id):
            store = await open_job_store(configuration)
            await anyio.to_thread.run_sync(self.heartbeats.start, run_id, store)  # before the pod can look
            configuration.add_secret_env(self.heartbeats.job_env())
        try:
            job_name = await anyio.to_thread.run_sync(self._create_job, api, configuration)
        except BaseException:
            self.heartbeats.stop(run_id)
            raise
        kind = "slot Job" if warm.is_slot(configuration) else "warm pod Job" if warm.wanted(configuration) else "Job"
        log(f"Created {kind} {configuration.namespace}/{job_name} for accelerator {configuration.accelerator}")
        identifier = f"{configuration.namespace}:{job_name}" + (f"@{flow_run.id}" if warm.wanted(configuration) else "")
        self._startup[identifier] = timeline
        if beating:
            self._run_ids[identifier] = run_id
        return identifier

    async def _image_while_a_node_comes(
        self,
        flow_run: FlowRun,
        configuration: KineticGKEJobConfiguration,
        log: Callable[[str], None],
        timeline: Timeline,
    ) -> str:
        """The job's image (ensure_image); while it builds, a placeholder asks for the job's node (placeholder.py),
        deleted before this returns, so the job's pod takes its place. The build's thread is abandoned on a cancel
        (a Ctrl-C does not wait for the build to end, and the build is told to stop), and the placeholder is deleted
        at once."""
        hold = None
        if placeholder.wanted(configuration) and not warm.is_slot(configuration):
            api = await anyio.to_thread.run_sync(self.api, configuration)
            hold = placeholder.NodeHold(api, configuration, str(flow_run.id), log)
        given, started = bool(configuration.image), time.monotonic()
        image = await placeholder.build_holding_a_node(
            hold, lambda: builders.ensure_interruptibly(lambda stop: self.ensure_image(configuration, log, stop))
        )
        took = time.monotonic() - started
        found = "found in the registry" if took < placeholder.HOLD_AFTER_SECONDS else f"built in {took:.0f} s"
        timeline.mark(STARTUP_IMAGE_READY, note="given (image=)" if given else found)
        if hold is not None and hold.asked_at is not None:
            timeline.mark(STARTUP_SCALE_UP_ASKED, hold.asked_at, "a placeholder, while the image built")
        return image

    async def find(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration) -> str | None:
        if warm.wanted(configuration) and (found := await self.warm.find(flow_run, configuration)):
            return found
        api = await anyio.to_thread.run_sync(self.api, configuration)
        name = await anyio.to_thread.run_sync(self._existing_job, api, configuration.namespace, flow_run)
        return f"{configuration.namespace}:{name}" if name else None

    def host_follower(self, identifier: str, index: int, configuration: KineticGKEJobConfiguration) -> JobFollower:
        """Host 0's follower is the Job's own; each other host's lines are forwarded tagged ``[host i]``."""
        if index == 0:
            return self.follower(identifier, configuration)
        key = f"{identifier}#{index}"
        if key not in self._followers:
            namespace, _, job_name = identifier.partition(":")
            self._followers[key] = JobFollower(
                self.api(configuration),
                namespace,
                job_name,
                lambda line: self._emitters.get(identifier, lambda _: None)(f"[host {index}] {line}"),
            )
        return self._followers[key]

    async def group_status(self, identifier: str, configuration: KineticGKEJobConfiguration) -> JobStatus:
        """A group is all or nothing: it has exited when any host failed, or when every host has finished."""
        hosts = configuration.host_count
        try:
            pods = await anyio.to_thread.run_sync(self.follower(identifier, configuration).pods)
        except JobGone:
            return JobStatus("gone", detail="the Job was deleted")
        if not pods and (ended := await self._podless_status(identifier, self.follower(identifier, configuration))):
            return ended
        phases = {i: (pod.status.phase if pod.status else None) for i, pod in pods.items()}
        for i, pod in sorted(pods.items()):
            if phases[i] in ("Running", "Succeeded", "Failed"):
                self.host_follower(identifier, i, configuration).stream_logs(pod.metadata.name)
        failed = [i for i, phase in sorted(phases.items()) if phase == "Failed"]
        finished = len(pods) == hosts and all(phase in ("Succeeded", "Failed") for phase in phases.values())
        if failed and not finished:
            # The Job controller stops the other hosts; wait for them (bounded), so that the coordinator's last
            # checkpoint is in the store before the task's retry starts a new group that resumes from it.
            since = self._group_failed_at.setdefault(identifier, time.monotonic())
            still = [i for i, phase in phases.items() if phase in ("Pending", "Running", None)]
            if still and time.monotonic() - since < GROUP_STOP_SECONDS:
                return JobStatus("running", detail=f"host {failed[0]} failed; stopping hosts {still}")
            finished = True
        if failed or finished:
            await self._drain_logs(identifier, pods, configuration)
            return await self._group_exited(identifier, pods, failed, configuration)
        waiting = [i for i in range(hosts) if phases.get(i) in (None, "Pending")]
        if waiting:
            return await self._group_pending(identifier, pods, waiting, configuration)
        nodes = ", ".join(sorted({pod.spec.node_name or "?" for pod in pods.values()}))
        return JobStatus("running", detail=f"{hosts} hosts running on {nodes}")

    async def _group_exited(
        self, identifier: str, pods: dict[int, Any], failed: list[int], configuration: KineticGKEJobConfiguration
    ) -> JobStatus:
        """The group's end: the first failed host's exit (and whether a disruption stopped one), else host 0's."""
        hosts = configuration.host_count
        if failed:
            pod = pods[failed[0]]
            code, reason = pod_exit(pod)
            follower = self.follower(identifier, configuration)
            disrupted = [
                found for i in failed if (found := await anyio.to_thread.run_sync(follower.disruption, pods[i]))
            ]
            return JobStatus(
                "exited",
                exit_code=code or 1,
                diagnosis=self.diagnose(pod, configuration),
                failed_host=failed[0] or None,
                preempted=disrupted[0] if disrupted else None,
                detail=f"host {failed[0]} of {hosts} (pod {pod.metadata.name}) failed: {reason}; "
                "the group fails with it",
            )
        code, reason = pod_exit(pods[0])
        return JobStatus("exited", exit_code=code, detail=f"all {hosts} hosts finished (host 0: {reason})")

    async def _group_pending(
        self, identifier: str, pods: dict[int, Any], waiting: list[int], configuration: KineticGKEJobConfiguration
    ) -> JobStatus:
        """Hosts still unscheduled: the first one's problem or capacity, fatal once it waited too long."""
        hosts = configuration.host_count
        pod = pods.get(waiting[0])
        diagnosis = self.diagnose(pod, configuration)
        since = self._pending_since.setdefault(identifier, time.monotonic())
        problem = JobFollower.pending_problem(pod) if pod is not None else None
        follower = self.follower(identifier, configuration)
        placing = await self._pending_capacity(follower, pod, configuration)
        if problem:
            return JobStatus("pending", detail=f"host {waiting[0]}: {problem}", fatal=True, diagnosis=diagnosis)
        waited = time.monotonic() - since
        scaling = self._scaling_clock(identifier, placing == capacity.SCALING_UP)
        if overdue := self._overdue(configuration, waited, scaling):
            text = await anyio.to_thread.run_sync(follower.diagnose_pending, pod, placing)
            return JobStatus(
                "pending",
                fatal=True,
                diagnosis=diagnosis,
                capacity=placing,
                scaling_up_seconds=scaling,
                detail=f"host {waiting[0]} of {hosts} {overdue}: {text}",
            )
        return JobStatus(
            "pending",
            diagnosis=diagnosis,
            capacity=placing,
            scaling_up_seconds=scaling,
            detail=f"{hosts - len(waiting)} of {hosts} hosts scheduled",
        )

    async def _drain_logs(self, identifier: str, pods: dict[int, Any], configuration) -> None:
        """Every host's last lines, the hosts side by side (one after another costs a round trip per host)."""

        async def drain(index: int, pod: Any) -> None:
            follower = self.host_follower(identifier, index, configuration)
            follower.stream_logs(pod.metadata.name)
            await anyio.to_thread.run_sync(follower.finish_logs)
            follower.stream_logs(pod.metadata.name, again=True)  # whatever a broken stream missed
            await anyio.to_thread.run_sync(follower.finish_logs)

        async with anyio.create_task_group() as group:
            for index, pod in sorted(pods.items()):
                group.start_soon(drain, index, pod)

    async def status(self, identifier: str, configuration: KineticGKEJobConfiguration) -> JobStatus:
        if warm.is_warm(identifier):
            return await self.warm.status(identifier, configuration, lambda job: self.status(job, configuration))
        if configuration.host_count > 1:
            return await self.group_status(identifier, configuration)
        follower = self.follower(identifier, configuration)
        try:
            pod = await anyio.to_thread.run_sync(follower.pod)
        except JobGone:
            return JobStatus("gone", detail="the Job was deleted")
        phase = pod.status.phase if pod is not None and pod.status else None
        diagnosis = self.diagnose(pod, configuration)
        if pod is None and (ended := await self._podless_status(identifier, follower)) is not None:
            return ended
        if phase in (None, "Pending"):
            since = self._pending_since.setdefault(identifier, time.monotonic())
            problem = follower.pending_problem(pod) if pod is not None else None
            placing = await self._pending_capacity(follower, pod, configuration)
            if problem:
                return JobStatus("pending", detail=problem, fatal=True, diagnosis=diagnosis)
            waited = time.monotonic() - since
            scaling = self._scaling_clock(identifier, placing == capacity.SCALING_UP)
            if overdue := self._overdue(configuration, waited, scaling):
                text = await anyio.to_thread.run_sync(follower.diagnose_pending, pod, placing)
                return JobStatus(
                    "pending",
                    detail=f"{overdue}: {text}",
                    fatal=True,
                    diagnosis=diagnosis,
                    capacity=placing,
                    scaling_up_seconds=scaling,
                )
            return JobStatus("pending", diagnosis=diagnosis, capacity=placing, scaling_up_seconds=scaling)
        gone = phase == "Running" and (deleted_for(pod) or 0.0) > DELETED_POD_MARGIN_SECONDS
        if phase == "Running" and not gone:
            follower.stream_logs(pod.metadata.name)
            return JobStatus("running", detail=f"Pod {pod.metadata.name} running on {pod.spec.node_name or '?'}")
        follower.stream_logs(pod.metadata.name)
        await anyio.to_thread.run_sync(follower.finish_logs)
        follower.stream_logs(pod.metadata.name, again=True)  # whatever a broken stream missed
        await anyio.to_thread.run_sync(follower.finish_logs)
        if gone:  # deleted, and no kubelet reported its end (a lost node, a forced delete): its process is gone
            return JobStatus("exited", exit_code=137, detail=f"pod {pod.metadata.name} was deleted while it ran")
        exit_code, reason = pod_exit(pod)
        preempted = await anyio.to_thread.run_sync(follower.disruption, pod) if phase == "Failed" else None
        return JobStatus(
            "exited",
            exit_code=exit_code,
            detail=f"pod {pod.metadata.name} {phase}: {reason}",
            diagnosis=diagnosis,
            preempted=preempted,
        )

    async def _podless_status(self, identifier: str, follower: JobFollower) -> JobStatus | None:
        """A Job without a pod: queued (suspended until Kueue admits it), or failed with its pod gone (the pod
        GC deletes the pods of a deleted node); None when the Job controller has simply not made the pod yet, or
        the Job was left suspended by a worker stopped between creating it and its Secret (its pod then waits out
        pod_watch_timeout_seconds like any pod that never starts)."""
        job = follower.last_job
        if job is None or job.spec is None:
            return None
        queued = (job.metadata.labels or {}).get(gke_capacity.KUEUE_QUEUE_LABEL) if job.metadata else None
        if job.spec.suspend and queued:
            self._pending_since[identifier] = time.monotonic()  # waiting in a queue is not a stuck pod
            queued = await anyio.to_thread.run_sync(follower.kueue_queued)
            return JobStatus(
                "pending", detail=queued or "queued: waiting for its capacity (Kueue / queued provisioning)"
            )
        conditions = {c.type: c for c in (job.status.conditions or []) if c.status == "True"} if job.status else {}
        failed = conditions.get("Failed") or conditions.get("FailureTarget")
        if failed is None:
            return None
        preempted = await anyio.to_thread.run_sync(follower.disruption, None)
        return JobStatus(
            "exited",
            exit_code=None,
            detail=f"Job failed ({failed.reason}: {failed.message}); its pod is gone",
            preempted=preempted
            or ("its pod was deleted with its node" if failed.reason == "PodFailurePolicy" else None),
        )

    async def _pending_capacity(self, follower: JobFollower, pod, configuration) -> str | None:
        """``capacity.*`` for a pod the scheduler cannot place (gke_capacity.pending_capacity): its events (the
        autoscaler's verdict) are read while it is unschedulable; whether the cluster has an autoscaler at all only
        when a fallback list makes the difference (no node matches and no verdict yet)."""
        if pod is None or not _unschedulable(pod):
            return None
        from kubernetes.client import ApiClient

        as_dict = ApiClient().sanitize_for_serialization(pod)
        events = await anyio.to_thread.run_sync(follower.pod_events, pod.metadata.name)
        placing = gke_capacity.pending_capacity(as_dict, events)
        if placing == capacity.AWAITING_AUTOSCALER and len(configuration.accelerator_choices) > 1:
            present = await self._autoscaler_present(follower, configuration)
            placing = gke_capacity.pending_capacity(as_dict, events, present)
        return placing

    async def _autoscaler_present(self, follower: JobFollower, configuration) -> bool | None:
        """follower.autoscaler_present, looked up once a minute per cluster (it is a cluster's setup)."""
        key = configuration.cluster_key
        looked, present = self._autoscaler_seen.get(key, (0.0, None))
        if not looked or time.monotonic() - looked > AUTOSCALER_LOOK_SECONDS:
            try:
                present = await anyio.to_thread.run_sync(follower.autoscaler_present)
            except Exception:  # not known: wait for a verdict as if it were there
                present = None
            self._autoscaler_seen[key] = (time.monotonic(), present)
        return present

    def _scaling_clock(self, identifier: str, scaling: bool) -> float:
        """Seconds a node has been on its way for this job's pod, this look included."""
        now = time.monotonic()
        total, since = self._scaling_up.get(identifier, (0.0, None))
        if since is not None:
            total += now - since
        self._scaling_up[identifier] = (total, now if scaling else None)
        return total

    @staticmethod
    def _overdue(configuration: KineticGKEJobConfiguration, waited: float, scaling: float) -> str | None:
        """Why the pod has been pending too long, or None: pod_watch_timeout_seconds counts the time no node was on
        its way; the time the autoscaler was adding one counts against the provisioning timeout instead."""
        timeout = capacity.provisioning_timeout(
            configuration.accelerator_spec, configuration.provisioning_timeout_seconds
        )
        if scaling > timeout:
            return f"still pending: the node the autoscaler was adding did not join in {scaling:.0f}s"
        if waited - scaling > configuration.pod_watch_timeout_seconds:
            return f"still pending after {waited:.0f}s"
        return None

    def diagnose(self, pod, configuration: KineticGKEJobConfiguration) -> dict[str, str] | None:
        """prefect-kubernetes' diagnosis of the pod (its categories are what automations match on), with
        the accelerator named where the cause is a missing node pool."""
        if pod is None or pod.status is None:
            return None
        from kubernetes.client import ApiClient

        found = diagnose_k8s_pod(ApiClient().sanitize_for_serialization(pod.status))
        if found is None:
            return None
        resolution = found.resolution
        spec = configuration.accelerator_spec
        if found.category.value in ("Unschedulable.NodeAffinity", "Unschedulable.Taint") and spec.node_selector:
            labels = ", ".join(f"{k}={v}" for k, v in spec.node_selector.items())
            resolution = (
                f"no node pool has accelerator {spec.name} ({labels}): create one, or enable node "
                f"auto-provisioning. {resolution}"
            )
        elif found.category.value == "Unschedulable.InsufficientResources" and spec.resource_name:
            resolution = (
                f"every {spec.name} node is busy or the quota is used up: try spot, another zone, or wait. {resolution}"
            )
        return {
            "category": found.category.value,
            "level": found.level.value,
            "summary": found.summary,
            "detail": found.detail,
            "resolution": resolution,
        }

    async def forward_logs(
        self,
        identifier: str,
        configuration: KineticGKEJobConfiguration,
        emit: Callable[[str], None],
        final: bool = False,
    ) -> None:
        # Each pod's log is streamed by a thread (JobFollower.stream_logs) straight into ``emit``.
        if (timeline := self._startup.get(identifier)) is not None:
            emit = gke_startup.first_line_marker(timeline, emit)
        if warm.is_warm(identifier):
            self.warm.forward_logs(identifier, emit)
            return
        self._emitters[identifier] = emit
        if final:
            for key, follower in list(self._followers.items()):
                if key == identifier or key.startswith(f"{identifier}#"):
                    await anyio.to_thread.run_sync(follower.finish_logs)

    async def cancel(self, identifier: str, configuration: KineticGKEJobConfiguration, grace_seconds: float) -> None:
        if warm.is_warm(identifier):
            await self.warm.cancel(identifier, configuration)
            return
        follower = self.follower(identifier, configuration)
        await anyio.to_thread.run_sync(follower.delete)

    can_relaunch = True

    async def relaunch(
        self,
        flow_run: FlowRun,
        configuration: KineticGKEJobConfiguration,
        identifier: str,
        spec: accelerators.AcceleratorSpec,
        attempt: int,
        log: Callable[[str], None],
    ) -> str:
        """A new Job (``-a<attempt>``) for the same run on ``spec``: the old one is deleted first (its pod is
        pending, or gone with its node), so one run never holds two accelerators."""
        await self.cancel(identifier, configuration, 0)
        await self.cleanup(identifier, configuration)
        configuration.accelerator, configuration.spot = capacity.label(spec.with_spot(False)), spec.spot
        if not configuration.image_given():
            configuration.image = None  # built (or found) again for this accelerator's family
        configuration.labels["kinetic.prefect.io/accelerator"] = configuration.labels["kinetic.accelerator"] = spec.name
        configuration.job_manifest = configuration.render_manifest(spec, flow_run, attempt)
        return await self.submit(flow_run, configuration, log)

    async def cleanup(self, identifier: str, configuration: KineticGKEJobConfiguration) -> None:
        run_id = self._run_ids.pop(identifier, None)
        if run_id is not None and run_id not in self._run_ids.values():  # a relaunch keeps the run's heartbeat
            await anyio.to_thread.run_sync(self.heartbeats.stop, run_id)
        if warm.is_warm(identifier):
            await self.warm.cleanup(identifier, configuration)
            identifier = identifier.partition("@")[0]
        for table in (self._followers, self._emitters, self._pending_since, self._group_failed_at, self._scaling_up):
            table.pop(identifier, None)
        for key in [k for k in self._followers if k.startswith(f"{identifier}#")]:
            self._followers.pop(key, None)

    async def startup_timeline(self, identifier: str, configuration: KineticGKEJobConfiguration) -> Timeline | None:
        """The job's start-up (workers/startup.py): what this launcher marked from submission, and the rest from
        its pod's conditions, container state and events (one read of the events). None for a job this worker did
        not start (a reattach: its submission is not known here)."""
        timeline = self._startup.pop(identifier, None)
        if timeline is None:
            return None
        follower = self._followers.get(identifier)
        pod = follower.last_pods[0] if follower is not None and follower.last_pods else None
        if pod is not None:
            try:
                events = await anyio.to_thread.run_sync(
                    gke_startup.read_events, self.api(configuration), pod.metadata.namespace, pod.metadata.name
                )
            except Exception:  # the timeline is a nicety: what the pod holds is enough
                events = []
            gke_startup.from_pod(timeline, pod, events)
        timeline.mark(STARTUP_FINISHED)  # kept when the container's own end was read
        return timeline

    async def host_spans(self, identifier: str, configuration: KineticGKEJobConfiguration) -> list[Any]:
        """Each host pod's start and end as the last status read saw them (metering; no extra API call)."""
        if warm.is_warm(identifier):
            return await self.warm.host_spans(identifier, configuration)
        follower = self._followers.get(identifier)
        if follower is None:
            return []
        newest: dict[int, Any] = {}
        for pod in follower.last_pods:
            newest[int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, 0))] = pod
        spans = [pod_span(pod, follower.gone_at) for _, pod in sorted(newest.items())]
        return [span for span in spans if span is not None]

    async def unfinished_jobs(self, work_pool: Any) -> list[tuple[str, str]]:
        from kubernetes import client

        # The pool's own settings (cluster config block included), as a run with no overrides would get them.
        base: KineticGKEJobConfiguration = await KineticGKEJobConfiguration.from_template_and_values(
            work_pool.base_job_template, {}
        )
        namespace = getattr(base, "namespace", None) or "default"
        api = await anyio.to_thread.run_sync(self.api, base)
        pool_label = label_value(work_pool.name)
        jobs = await anyio.to_thread.run_sync(
            lambda: (
                client.BatchV1Api(api).list_namespaced_job(namespace, label_selector=f"{POOL_LABEL}={pool_label}").items
            )
        )
        found = []
        for job in jobs:
            labels = (job.metadata.labels if job.metadata else None) or {}
            # finished Jobs too: one that ended while no worker watched still has an outcome to collect
            if labels.get(POOL_LABEL) == pool_label and labels.get(FLOW_RUN_LABEL):
                found.append((labels[FLOW_RUN_LABEL], f"{namespace}:{job.metadata.name}"))  # type: ignore[union-attr]
        if base.keep_warm_seconds > 0 and base.store:  # warm calls are recorded in the pool's store
            base.env[Env.STORE] = base.store
            found += await self.warm.unfinished_calls(base)
        return found

    # ------------------------------------------------------------------ images
    @staticmethod
    def ensure_image(
        configuration: KineticGKEJobConfiguration, log: Callable[[str], None], stop: threading.Event | None = None
    ) -> str:
        """The job's image: given, or found or built by the pool's builder; a set ``stop`` ends the build."""
        if configuration.image:
            return configuration.image
        configuration.check_build_variables()  # a flow run made over the API has skipped the caller's checks
        spec = configuration.image_spec
        if configuration.install_requirements_at_start:  # the pod installs them: the image holds the runner alone
            spec = prebuilt.runner_only(spec)
        if configuration.image_builder == "docker" and configuration.image_repository:
            return builders.DockerBuilder(configuration.image_repository, stop=stop).ensure(spec, log)
        if configuration.image_builder == "cloud-build" and configuration.image_repository:
            from kinetic_prefect.shared import gcp

            credentials = None
            if configuration.gcp_credentials:  # ensure_image runs in a worker thread of the worker's event loop
                block = anyio.from_thread.run(gcp.credentials_block, GKE_WORKER_TYPE, configuration.gcp_credentials)
                credentials = gcp.google_credentials(block)
            project, region = configuration.gcp_project, configuration.gcp_region
            bucket = configuration.build_staging_bucket
            assert project and region and bucket, "check_pool_settings refuses a cloud-build pool without them"
            return builders.CloudBuildBuilder(
                project=project,
                region=region,
                repository=configuration.image_repository,
                staging_bucket=bucket,
                credentials=credentials,
                stop=stop,
            ).ensure(spec, log)
        raise ValueError(
            "kinetic-gke needs an image: pass image= to @kinetic_task, or set the pool's image_builder "
            "('cloud-build' or 'docker') and image_repository (e.g. us-docker.pkg.dev/PROJECT/REPO)."
        )

    @staticmethod
    def _existing_job(api, namespace: str, flow_run: FlowRun) -> str | None:
        from kubernetes import client

        jobs = (
            client.BatchV1Api(api)
            .list_namespaced_job(namespace, label_selector=f"{FLOW_RUN_LABEL}={flow_run.id}")
            .items
        )
        mine = [
            j
            for j in jobs
            if j.metadata
            and (j.metadata.labels or {}).get(FLOW_RUN_LABEL) == str(flow_run.id)
            and j.metadata.deletion_timestamp is None
        ]
        mine.sort(key=lambda j: int((j.metadata.labels or {}).get("kinetic.prefect.io/attempt") or 1))  # type: ignore[union-attr]
        return mine[-1].metadata.name if mine else None  # type: ignore[union-attr]  # filtered above

    @staticmethod
    def _create_job(api, configuration: KineticGKEJobConfiguration) -> str:
        """Create the Job, then the Secret of its environment values (owned by the Job from its creation, so deleted
        with it), then the Service of a group. A Job with a Secret is created suspended and resumed once the Secret
        exists (a queued one is resumed by Kueue): no pod starts without its values, and a Job that could not be
        created leaves no Secret behind. Whatever fails after the Job was made deletes it, and its Secret with it.
        The worker only ever creates Secrets (its Role lets it read, change or delete none). Every call is retried
        through transient errors, and each is idempotent: a retried create that finds what its own earlier (lost)
        try made goes on."""
        from kubernetes import client

        manifest = configuration.job_manifest
        core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
        namespace = configuration.namespace
        secret_env = configuration.secret_env
        secret_name = f"{manifest['metadata']['name']}-env"[:253]
        queued = bool(manifest["spec"].get("suspend"))  # Kueue resumes it, not the worker
        if secret_env:
            container = manifest["spec"]["template"]["spec"]["containers"][0]
            container["envFrom"] = [*(container.get("envFrom") or []), {"secretRef": {"name": secret_name}}]
            manifest["spec"]["suspend"] = True
        created, made_now = _create_or_find_job(batch, namespace, manifest)
        try:
            if secret_env:
                _create_env_secret(core, namespace, secret_name, secret_env, created, adopt=not made_now)
            service = configuration.service_manifest(created.metadata.uid)
            if service is not None:
                _create_or_keep(core.create_namespaced_service, namespace, service)
            if secret_env and not queued:
                kube_retry(batch.patch_namespaced_job)(created.metadata.name, namespace, {"spec": {"suspend": False}})
        except BaseException:
            if made_now:  # not a Job left suspended for good, or started without its values
                with contextlib.suppress(Exception):
                    kube_retry(batch.delete_namespaced_job)(
                        created.metadata.name, namespace, propagation_policy="Background"
                    )
            raise
        return created.metadata.name


def _create_or_find_job(batch: Any, namespace: str, manifest: dict[str, Any]) -> tuple[Any, bool]:
    """The Job created, and True; or, when its name is taken (409) by this flow run's Job (an earlier try whose
    answer was lost, or a worker racing this one), that Job and False."""
    from kubernetes.client.exceptions import ApiException

    try:
        return kube_retry(batch.create_namespaced_job)(namespace, manifest), True
    except ApiException as exc:
        if exc.status != 409:
            raise
        found = kube_retry(batch.read_namespaced_job)(manifest["metadata"]["name"], namespace)
        if (found.metadata.labels or {}).get(FLOW_RUN_LABEL) != manifest["metadata"]["labels"].get(FLOW_RUN_LABEL):
            raise
        return found, False


def _create_or_keep(create: Callable[..., Any], namespace: str, body: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        kube_retry(create)(namespace, body)
    except ApiException as exc:
        if exc.status != 409:  # 409: an earlier attempt made it
            raise


class SecretTaken(RuntimeError):
    """A Secret of the name a Job's environment needs exists and was not made by this worker for that Job."""


def _create_env_secret(
    core: Any, namespace: str, secret_name: str, secret_env: dict[str, str], job: Any, adopt: bool = False
) -> None:
    """Create the Secret holding a job's environment values, owned by ``job``. A 409 is accepted only when an
    earlier try of this call may have made it (its answer lost) or ``adopt`` (the Job itself was made earlier): a
    Secret someone else made under the Job's name is never used, since the worker cannot read what it holds."""
    from kubernetes.client.exceptions import ApiException

    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "kinetic-prefect"},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job.metadata.name,
                    "uid": job.metadata.uid or "",
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "stringData": secret_env,
    }
    tried = adopt

    def create() -> None:
        nonlocal tried
        try:
            core.create_namespaced_secret(namespace, body)
        except ApiException as exc:
            if exc.status == 409 and tried:
                return
            if exc.status == 409:
                raise SecretTaken(
                    f"a Secret named {secret_name} already exists in namespace {namespace}, not made for this job: "
                    "refusing to start the job with environment values someone else chose (delete that Secret)"
                ) from None
            tried = tried or is_transient_kube_error(exc)
            raise
        except Exception as exc:
            tried = tried or is_transient_kube_error(exc)
            raise

    kube_retry(create)()
