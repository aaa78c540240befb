"""Worker side, ``kinetic-gke``: the job is a Kubernetes Job on a GKE node with the named accelerator.

Built on prefect-kubernetes: the job configuration *is* its ``KubernetesWorkerJobConfiguration`` (cluster
config block, namespace, annotations, ``job_manifest`` validated by it, labels and env filled by it) plus
the kinetic fields; the pool's form is prefect-kubernetes' form plus the kinetic variables
(``work_pools/kinetic-gke.json``). :meth:`KineticGKEJobConfiguration.prepare_for_flow_run` then adds
what the accelerator catalog decides (node selector, tolerations, accelerator limits, /dev/shm) and
moves secret values (forwarded env, the Prefect API key) out of the manifest into a Secret owned by
the Job. Pending pods are diagnosed with prefect-kubernetes' diagnosis vocabulary. What
prefect-kubernetes lacks and this worker keeps: following a Job to its end from any worker
(reattach after a restart), the kinetic outcome record, and cancellation that deletes the Job.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from typing import Any, Callable

import anyio
import anyio.from_thread
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseWorker
from prefect_kubernetes.credentials import KubernetesClusterConfig
from prefect_kubernetes.diagnostics import diagnose_k8s_pod
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration
from pydantic import Field, PrivateAttr

from kinetic_prefect import accelerators
from kinetic_prefect.contract import JAX_COORDINATOR_PORT, RUNNER_ARGV, Env
from kinetic_prefect.workers.gke import capacity as gke_capacity
from kinetic_prefect.workers.base import KineticJobConfiguration, load_template
from kinetic_prefect.workers.gke.variables import CONTAINER, JOB_BACKOFF_LIMIT, KineticGKEVariables
from kinetic_prefect.workers.lifecycle import JobLauncher, JobStatus, KineticWorker

FLOW_RUN_LABEL = "prefect.io/flow-run-id"
POOL_LABEL = "kinetic.prefect.io/work-pool"
GROUP_STOP_SECONDS = 60.0  # how long the other hosts of a failed group get to stop (and save) before it is over
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on each pod
# Never written into a manifest (anyone who can read Jobs could read them): they go in the Job's Secret.
SECRET_ENV_NAMES = frozenset({"PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", Env.PREFECT_API_KEY})
IMAGE_PULL_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}


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


def _label_value(value: Any) -> str:
    """Kubernetes label values: at most 63 of [A-Za-z0-9-_.], starting and ending alphanumeric."""
    text = re.sub(r"[^A-Za-z0-9_.-]", "-", str(value))[:63]
    return text.strip("-_.") or "x"


def _prune(value: Any) -> Any:
    """Drop None/empty placeholders left by the template, so the manifest stays schema-valid."""
    if isinstance(value, dict):
        pruned = {k: _prune(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v is not None and v != {} and v != ""}
    if isinstance(value, list):
        return [_prune(v) for v in value if v is not None]
    return value


def _minimal_manifest() -> dict[str, Any]:
    """What prefect-kubernetes' validation accepts; the pool's template replaces it for real jobs."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"annotations": {}, "labels": {}},
        "spec": {
            "template": {
                "spec": {
                    "parallelism": 1,
                    "completions": 1,
                    "restartPolicy": "Never",
                    "containers": [{"name": CONTAINER}],
                }
            }
        },
    }


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


class KineticGKEJobConfiguration(KineticJobConfiguration, KubernetesWorkerJobConfiguration):
    job_manifest: dict[str, Any] = Field(default_factory=_minimal_manifest)
    image: str | None = Field(default=None)
    spot: bool = Field(default=False)
    service_account_name: str | None = Field(default=None)
    cpu_request: str | None = Field(default=None)
    memory_request: str | None = Field(default=None)
    ephemeral_storage_request: str | None = Field(default=None)
    shm_size: str | None = Field(default=None)
    hosts: int | None = Field(default=None)  # a group of N pods; a multi-host TPU slice sets its own count
    pod_watch_timeout_seconds: int = Field(default=600)
    poll_seconds: float = Field(default=2.0)
    kubeconfig_path: str | None = Field(default=None)
    kube_context: str | None = Field(default=None)
    image_builder: str = Field(default="none")
    image_repository: str | None = Field(default=None)
    gcp_project: str | None = Field(default=None)
    gcp_region: str | None = Field(default=None)
    build_staging_bucket: str | None = Field(default=None)
    reservation: str | None = Field(default=None)
    reservation_project: str | None = Field(default=None)
    flex_start: bool = Field(default=False)
    queued_provisioning: str | None = Field(default=None)  # a Kueue LocalQueue backed by queued provisioning
    _template_manifest: dict[str, Any] | None = PrivateAttr(default=None)  # before rendering: each attempt's base
    _image_given: bool | None = PrivateAttr(default=None)  # image= (kept for every attempt), not built per family

    @property
    def host_count(self) -> int:
        """Pods in the group: the slice's hosts for a multi-host TPU, else ``hosts`` (1 by default)."""
        return accelerators.host_count(self.accelerator_spec, self.hosts)

    @property
    def accelerator_spec(self) -> accelerators.AcceleratorSpec:
        spec = accelerators.resolve(self.accelerator)
        return spec.with_spot() if self.spot else spec

    def prepare_for_flow_run(
        self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None
    ):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        spec = self.accelerator_spec
        if work_pool is not None:
            self.labels[POOL_LABEL] = work_pool.name
        self.labels["kinetic.prefect.io/accelerator"] = spec.name
        self._template_manifest = copy.deepcopy(self.job_manifest)
        self.job_manifest = self.render_manifest(spec, flow_run)

    def render_manifest(
        self, spec: accelerators.AcceleratorSpec, flow_run: FlowRun, attempt: int = 1
    ) -> dict[str, Any]:
        from kinetic_prefect.workers.gke import capacity as gke_capacity

        manifest = copy.deepcopy(self._template_manifest if self._template_manifest is not None else self.job_manifest)
        labels = {k: _label_value(v) for k, v in self.labels.items()}
        metadata = manifest.setdefault("metadata", {})
        metadata["namespace"] = self.namespace
        # One name per flow run: a second create for the same run (a restarted worker) gets 409, never a duplicate.
        slug = re.sub(r"[^a-z0-9-]", "-", str(flow_run.name).lower())[:40].strip("-")
        metadata["name"] = f"kinetic-{slug}-{flow_run.id.hex[:8]}" + (f"-a{attempt}" if attempt > 1 else "")
        metadata.pop("generateName", None)
        metadata["labels"] = {**(metadata.get("labels") or {}), **labels}
        job_spec = manifest.setdefault("spec", {})
        job_spec["backoffLimit"] = JOB_BACKOFF_LIMIT  # retries belong to Prefect: one Job is one attempt
        template = job_spec.setdefault("template", {})
        template.setdefault("metadata", {})["labels"] = {**(template["metadata"].get("labels") or {}), **labels}
        pod = template.setdefault("spec", {})
        for key in ("parallelism", "completions"):  # only for prefect-kubernetes' validation: not PodSpec fields
            pod.pop(key, None)
        pod["restartPolicy"] = "Never"
        pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **spec.node_selector}
        tolerations = list(pod.get("tolerations") or [])
        if spec.resource_name:
            tolerations.append({"key": spec.resource_name, "operator": "Exists", "effect": "NoSchedule"})
        if spec.spot:
            tolerations.append(
                {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
            )
        pod["tolerations"] = tolerations or None
        containers = pod.setdefault("containers", [{}])
        container = containers[0]
        container.setdefault("name", CONTAINER)
        container["image"] = self.image or container.get("image")
        container["command"] = list(RUNNER_ARGV)
        container.pop("args", None)  # prefect-kubernetes puts the flow-run command there; the runner takes none
        existing_env = {e["name"]: e for e in container.get("env") or [] if isinstance(e, dict)}
        for key, value in self.env.items():
            if value is not None:
                existing_env[key] = {"name": key, "value": str(value)}
        secrets = {
            name: existing_env.pop(name)["value"]
            for name in list(existing_env)
            if name in SECRET_ENV_NAMES and "value" in existing_env[name]
        }
        if secrets:
            self.set_secret_env({**secrets, **self.secret_env})
        container["env"] = list(existing_env.values())
        requests = {
            k: v
            for k, v in {
                "cpu": self.cpu_request,
                "memory": self.memory_request,
                "ephemeral-storage": self.ephemeral_storage_request,
            }.items()
            if v
        }
        resources = container.setdefault("resources", {})
        resources["requests"] = {**(resources.get("requests") or {}), **requests}
        if spec.resource_name:
            resources["limits"] = {**(resources.get("limits") or {}), spec.resource_name: str(spec.resource_count)}
        if self.shm_size:  # PyTorch/Grain data loaders share batches through /dev/shm (64 MiB by default)
            pod["volumes"] = [
                *(pod.get("volumes") or []),
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}},
            ]
            container["volumeMounts"] = [
                *(container.get("volumeMounts") or []),
                {"name": "dshm", "mountPath": "/dev/shm"},
            ]
        if self.host_count > 1:
            self._render_group(manifest, spec)
        gke_capacity.render(manifest, self, spec, attempt)
        return _prune(manifest)

    def _render_group(self, manifest: dict[str, Any], spec: accelerators.AcceleratorSpec) -> None:
        """One Indexed Job for the group: pod i is host i, reachable as ``<job>-<i>.<job>`` through the headless
        Service of the Job's name; host 0 is the coordinator.  ``backoffLimit: 0`` makes it all or nothing: one
        failed pod fails the Job, the Job controller stops the others, and the task's retry starts a new group."""
        hosts, name = self.host_count, manifest["metadata"]["name"]
        job_spec = manifest["spec"]
        job_spec.update(completions=hosts, parallelism=hosts, completionMode="Indexed", backoffLimit=JOB_BACKOFF_LIMIT)
        pod = job_spec["template"]["spec"]
        pod["subdomain"] = name
        hostnames = [f"{name}-{i}.{name}" for i in range(hosts)]
        index = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
        env: list[dict[str, Any]] = [
            {"name": Env.NUM_HOSTS, "value": str(hosts)},
            {"name": Env.HOST_INDEX, **index},
            {"name": Env.COORDINATOR_ADDRESS, "value": f"{hostnames[0]}:{JAX_COORDINATOR_PORT}"},
        ]
        if spec.family == "tpu":  # what GKE's TPU webhook sets for a multi-host slice
            env += [{"name": "TPU_WORKER_ID", **index}, {"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(hostnames)}]
        container = pod["containers"][0]
        names = {str(e["name"]) for e in env}
        container["env"] = [e for e in container.get("env") or [] if e.get("name") not in names] + env
        container["ports"] = [{"name": "coordinator", "containerPort": JAX_COORDINATOR_PORT}]

    def service_manifest(self, owner_uid: str | None = None) -> dict[str, Any] | None:
        """The headless Service that names a group's pods (None for a single pod); owned by the Job."""
        if self.host_count <= 1:
            return None
        name = self.job_manifest["metadata"]["name"]
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": dict(self.job_manifest["metadata"].get("labels") or {}),
        }
        if owner_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": owner_uid, "blockOwnerDeletion": False}
            ]
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"job-name": name},
                "ports": [{"name": "coordinator", "port": JAX_COORDINATOR_PORT}],
            },
        }

    def kube_client(self):
        return kube_client(self.cluster_config, self.kubeconfig_path, self.kube_context)

    @property
    def cluster_key(self) -> str:
        if self.cluster_config is not None:
            return f"{self.cluster_config.context_name}:{hash(repr(sorted(self.cluster_config.config.items())))}"
        return f"{self.kubeconfig_path}:{self.kube_context}"


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

    def _job_pods(self) -> list[Any]:
        """The Job's pods, oldest first; JobGone when the Job itself was deleted."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.last_job = self.batch.read_namespaced_job(self.job_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                self.gone_at = self.gone_at or time.time()
                raise JobGone(self.job_name) from None
            raise
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={self.job_name}").items
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

    def event_reasons(self, name: str) -> list[str]:
        events = self.core.list_namespaced_event(self.namespace).items
        return [e.reason or "" for e in events if e.involved_object is not None and e.involved_object.name == name]

    def node_exists(self, name: str) -> bool | None:
        """None: not known (the worker's namespaced Role may not read nodes, which are cluster-wide)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.read_node(name)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status in (401, 403):
                return None
            raise

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
        events = self.core.list_namespaced_event(self.namespace).items
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

    def diagnose_pending(self, pod) -> str:
        reasons = []
        for condition in (pod.status.conditions or []) if pod and pod.status else []:
            if condition.status == "False" and condition.reason:
                reasons.append(f"{condition.reason}: {condition.message or ''}".strip())
        if pod is not None:
            reasons.extend(self.events_for(pod.metadata.name))
        text = "; ".join(dict.fromkeys(reasons)) or "no scheduling information from the cluster"
        hints = []
        if "node affinity/selector" in text or "didn't match" in text:
            hints.append("no node pool has this accelerator: create one, or enable node auto-provisioning")
        if "Insufficient nvidia.com/gpu" in text or "Insufficient google.com/tpu" in text:
            hints.append("the accelerator is exhausted in this zone/quota: try spot, another zone, or wait")
        return text + (f" ({'; '.join(hints)})" if hints else "")

    def delete(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            kube_retry(self.batch.delete_namespaced_job)(self.job_name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise


class GKEJobLauncher(JobLauncher):
    """A kinetic job as one Kubernetes Job (one pod, ``backoffLimit: 0``); identifiers are ``namespace:name``."""

    def __init__(self) -> None:
        self._followers: dict[str, JobFollower] = {}
        self._emitters: dict[str, Callable[[str], None]] = {}
        self._pending_since: dict[str, float] = {}
        self._group_failed_at: dict[str, float] = {}
        self._api: dict[str, Any] = {}

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
        if configuration._image_given is None:
            configuration._image_given = bool(configuration.image)
        image = await anyio.to_thread.run_sync(self.ensure_image, configuration, log)
        configuration.image = image
        configuration.job_manifest["spec"]["template"]["spec"]["containers"][0]["image"] = image
        api = await anyio.to_thread.run_sync(self.api, configuration)
        job_name = await anyio.to_thread.run_sync(self._create_job, api, configuration)
        log(f"Created Job {configuration.namespace}/{job_name} for accelerator {configuration.accelerator}")
        return f"{configuration.namespace}:{job_name}"

    async def find(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration) -> str | None:
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
            if failed:
                pod = pods[failed[0]]
                code, reason = self._exit(pod)
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
            code, reason = self._exit(pods[0])
            return JobStatus("exited", exit_code=code, detail=f"all {hosts} hosts finished (host 0: {reason})")
        waiting = [i for i in range(hosts) if phases.get(i) in (None, "Pending")]
        if waiting:
            pod = pods.get(waiting[0])
            diagnosis = self.diagnose(pod, configuration)
            since = self._pending_since.setdefault(identifier, time.monotonic())
            problem = JobFollower.pending_problem(pod) if pod is not None else None
            placing = await self._pending_capacity(self.follower(identifier, configuration), pod, configuration)
            if problem:
                return JobStatus("pending", detail=f"host {waiting[0]}: {problem}", fatal=True, diagnosis=diagnosis)
            waited = time.monotonic() - since
            if waited > configuration.pod_watch_timeout_seconds:
                text = await anyio.to_thread.run_sync(self.follower(identifier, configuration).diagnose_pending, pod)
                return JobStatus(
                    "pending",
                    fatal=True,
                    diagnosis=diagnosis,
                    capacity=placing,
                    detail=f"host {waiting[0]} of {hosts} still pending after {waited:.0f}s: {text}",
                )
            return JobStatus(
                "pending",
                diagnosis=diagnosis,
                capacity=placing,
                detail=f"{hosts - len(waiting)} of {hosts} hosts scheduled",
            )
        nodes = ", ".join(sorted({pod.spec.node_name or "?" for pod in pods.values()}))
        return JobStatus("running", detail=f"{hosts} hosts running on {nodes}")

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
            if waited > configuration.pod_watch_timeout_seconds:
                text = await anyio.to_thread.run_sync(follower.diagnose_pending, pod)
                return JobStatus(
                    "pending",
                    detail=f"still pending after {waited:.0f}s: {text}",
                    fatal=True,
                    diagnosis=diagnosis,
                    capacity=placing,
                )
            return JobStatus("pending", diagnosis=diagnosis, capacity=placing)
        if phase == "Running":
            follower.stream_logs(pod.metadata.name)
            return JobStatus("running", detail=f"Pod {pod.metadata.name} running on {pod.spec.node_name or '?'}")
        follower.stream_logs(pod.metadata.name)
        await anyio.to_thread.run_sync(follower.finish_logs)
        follower.stream_logs(pod.metadata.name, again=True)  # whatever a broken stream missed
        await anyio.to_thread.run_sync(follower.finish_logs)
        exit_code, reason = self._exit(pod)
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
        GC deletes the pods of a deleted node); None when the Job controller has simply not made the pod yet."""
        job = follower.last_job
        if job is None or job.spec is None:
            return None
        if job.spec.suspend:
            self._pending_since[identifier] = time.monotonic()  # waiting in a queue is not a stuck pod
            return JobStatus("pending", detail="queued: waiting for its capacity (Kueue / queued provisioning)")
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
        """capacity.NO_NODE_POOL / INSUFFICIENT_CAPACITY for a pod the scheduler cannot place; the events (the
        autoscaler's) are read only when a fallback list makes the difference."""
        if pod is None:
            return None
        from kubernetes.client import ApiClient

        from kinetic_prefect.workers.gke import capacity as gke_capacity

        reasons: list[str] = []
        if len(configuration._accelerator_choices) > 1:
            reasons = await anyio.to_thread.run_sync(follower.event_reasons, pod.metadata.name)
        return gke_capacity.pending_capacity(ApiClient().sanitize_for_serialization(pod), reasons)

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
        self._emitters[identifier] = emit
        if final:
            for key, follower in list(self._followers.items()):
                if key == identifier or key.startswith(f"{identifier}#"):
                    await anyio.to_thread.run_sync(follower.finish_logs)

    async def cancel(self, identifier: str, configuration: KineticGKEJobConfiguration, grace_seconds: float) -> None:
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
        from kinetic_prefect.shared import capacity

        await self.cancel(identifier, configuration, 0)
        await self.cleanup(identifier, configuration)
        configuration.accelerator, configuration.spot = capacity.label(spec.with_spot(False)), spec.spot
        if not configuration._image_given:
            configuration.image = None  # built (or found) again for this accelerator's family
        configuration.labels["kinetic.prefect.io/accelerator"] = configuration.labels["kinetic.accelerator"] = spec.name
        configuration.job_manifest = configuration.render_manifest(spec, flow_run, attempt)
        return await self.submit(flow_run, configuration, log)

    async def cleanup(self, identifier: str, configuration: KineticGKEJobConfiguration) -> None:
        for table in (self._followers, self._emitters, self._pending_since, self._group_failed_at):
            table.pop(identifier, None)
        for key in [k for k in self._followers if k.startswith(f"{identifier}#")]:
            self._followers.pop(key, None)

    async def host_spans(self, identifier: str, configuration: KineticGKEJobConfiguration) -> list[Any]:
        """Each host pod's start and end as the last status read saw them (metering; no extra API call)."""
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
        base = await KineticGKEJobConfiguration.from_template_and_values(work_pool.base_job_template, {})
        namespace = getattr(base, "namespace", None) or "default"
        api = await anyio.to_thread.run_sync(self.api, base)
        pool_label = _label_value(work_pool.name)
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
        return found

    # ------------------------------------------------------------------ images
    @staticmethod
    def ensure_image(configuration: KineticGKEJobConfiguration, log: Callable[[str], None]) -> str:
        if configuration.image:
            return configuration.image
        from kinetic_prefect.shared import builders

        spec = configuration.image_spec
        if configuration.image_builder == "docker" and configuration.image_repository:
            return builders.DockerBuilder(configuration.image_repository).ensure(spec, log)
        if configuration.image_builder == "cloud-build" and configuration.image_repository:
            from kinetic_prefect.shared import gcp

            credentials = None
            if configuration.gcp_credentials:  # ensure_image runs in a worker thread of the worker's event loop
                block = anyio.from_thread.run(gcp.credentials_block, "kinetic-gke", configuration.gcp_credentials)
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
        """Create the Job; secret values go in a Secret it references, owned by the Job (deleted with it),
        so they appear in no manifest and no Prefect record.  Every call is retried through transient errors,
        and each is idempotent: a retried create that finds what an earlier (lost) response made goes on."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        manifest = configuration.job_manifest
        job_name = manifest["metadata"]["name"]
        secret_name = f"{job_name}-env"[:253]
        core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
        namespace = configuration.namespace
        if configuration.secret_env:
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {
                    "name": secret_name,
                    "namespace": namespace,
                    "labels": {"app.kubernetes.io/managed-by": "kinetic-prefect"},
                },
                "stringData": configuration.secret_env,
            }
            try:
                kube_retry(core.create_namespaced_secret)(namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # the worker may write Secrets but never read them (its Role): overwrite what is there
                kube_retry(core.patch_namespaced_secret)(secret_name, namespace, {"stringData": body["stringData"]})
            container = manifest["spec"]["template"]["spec"]["containers"][0]
            container["envFrom"] = [*(container.get("envFrom") or []), {"secretRef": {"name": secret_name}}]
        try:
            created = kube_retry(batch.create_namespaced_job)(namespace, manifest)
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = kube_retry(batch.read_namespaced_job)(job_name, namespace)
            mine = (created.metadata.labels or {}).get(FLOW_RUN_LABEL) == manifest["metadata"]["labels"].get(
                FLOW_RUN_LABEL
            )
            if not mine:
                raise
        service = configuration.service_manifest(created.metadata.uid)
        if service is not None:
            try:
                kube_retry(core.create_namespaced_service)(namespace, service)
            except ApiException as exc:
                if exc.status != 409:  # 409: an earlier attempt made it
                    raise
        if configuration.secret_env:
            kube_retry(core.patch_namespaced_secret)(
                secret_name,
                namespace,
                {
                    "metadata": {
                        "ownerReferences": [
                            {
                                "apiVersion": "batch/v1",
                                "kind": "Job",
                                "name": created.metadata.name,
                                "uid": created.metadata.uid or "",
                                "blockOwnerDeletion": False,
                            }
                        ]
                    }
                },
            )
        return created.metadata.name

    @staticmethod
    def _exit(pod) -> tuple[int, str]:
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
    return HostSpan(status.start_time.timestamp(), end, spot)


class KineticGKEWorker(KineticWorker, BaseWorker):  # type: ignore[misc]  # run() returns a BaseWorkerResult subclass
    type = "kinetic-gke"
    job_configuration = KineticGKEJobConfiguration
    launcher: GKEJobLauncher
    job_configuration_variables = KineticGKEVariables
    _description = "Runs @kinetic_task jobs as Kubernetes Jobs on GKE GPU/TPU node pools."
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launcher = GKEJobLauncher()

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    @classmethod
    def check_pool_settings(cls, pool_name: str, defaults: dict[str, Any], job_variables: dict[str, Any]) -> None:
        """Image settings must be complete before a payload is uploaded: an unset project used to build
        ``projects/None/locations/None``, an unset bucket failed with an AttributeError mid-build."""
        settings = {**defaults, **{k: v for k, v in job_variables.items() if v is not None}}
        gke_capacity.check_settings(pool_name, settings)
        if settings.get("image"):
            return
        builder = settings.get("image_builder") or "none"
        needed = {
            "cloud-build": ("image_repository", "gcp_project", "gcp_region", "build_staging_bucket"),
            "docker": ("image_repository",),
        }.get(builder)
        if needed is None:
            raise ValueError(
                f"work pool {pool_name!r} (kinetic-gke) has no image and image_builder={builder!r}: pass image= to "
                f"@kinetic_task, or set the pool's builder, e.g. `kinetic-prefect pool-set {pool_name} "
                "image_builder=cloud-build image_repository=us-docker.pkg.dev/PROJECT/REPO gcp_project=PROJECT "
                "gcp_region=REGION build_staging_bucket=BUCKET`"
            )
        missing = [name for name in needed if not settings.get(name)]
        if missing:
            raise ValueError(
                f"work pool {pool_name!r} builds images with {builder} but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: `kinetic-prefect pool-set {pool_name} "
                + " ".join(f"{name}=..." for name in missing)
                + "` (or pass image= to @kinetic_task)"
            )

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: KineticGKEJobConfiguration, grace_seconds: int = 30
    ) -> None:
        namespace, _, job_name = infrastructure_pid.partition(":")
        if not job_name:
            raise InfrastructureNotFound(f"not a kinetic-gke job id: {infrastructure_pid!r}")
        await self.launcher.cancel(infrastructure_pid, configuration, grace_seconds)

    async def setup(self) -> None:
        await super().setup()
        if self._work_pool is not None:
            try:
                assert self._runs_task_group is not None  # set by BaseWorker.setup()
                count = await self.reattach(self._runs_task_group.start_soon)
                if count:
                    self._logger.info(f"Reattached to {count} running kinetic Job(s)")
            except Exception as exc:  # a cluster hiccup must not stop the worker from polling
                self._logger.warning(f"Could not look for running Jobs to reattach: {exc!r}")
