"""Worker side, ``kinetic-gke``: the job is a Kubernetes Job on a GKE node with the named accelerator.

Same shape as prefect-kubernetes: the pool's base job template (``work_pools/kinetic-gke.json``)
holds a Job manifest with ``{{ placeholders }}``; Prefect fills them from job variables; then
:meth:`KineticGKEJobConfiguration.prepare_for_flow_run` adds what the accelerator catalog decides
(node selector, tolerations, accelerator limits, /dev/shm) and leaves the rendered manifest in
``job_manifest``. Fields users add to the template in the UI are kept.
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time
from typing import Any, Callable

import anyio
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import Abort, InfrastructureNotFound
from prefect.states import Crashed
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseWorker
from pydantic import Field

from kinetic_prefect import accelerators
from kinetic_prefect.workers.base import KineticJobConfiguration, KineticWorkerMixin, KineticWorkerResult, load_template

FLOW_RUN_LABEL = "prefect.io/flow-run-id"
POOL_LABEL = "kinetic.prefect.io/work-pool"
CONTAINER = "kinetic-job"
IMAGE_PULL_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_ERRORS = {"CreateContainerConfigError", "CreateContainerError"}


class UnsupportedAcceleratorError(ValueError):
    pass


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


def check_accelerator(spec: accelerators.AcceleratorSpec) -> None:
    if spec.multi_host:
        raise UnsupportedAcceleratorError(
            f"accelerator {spec.name!r} is a multi-host TPU slice ({spec.hosts} hosts x {spec.chips_per_host} chips); "
            "kinetic-gke runs single-pod Jobs and does not support multi-host slices yet. Use a single-host shape "
            f"such as {', '.join(n for n in accelerators.names() if n.startswith(spec.name.rsplit('-', 1)[0]))[:80]}..."
        )


class KineticGKEJobConfiguration(KineticJobConfiguration):
    job_manifest: dict[str, Any] = Field(default_factory=dict)
    namespace: str = Field(default="default")
    image: str | None = Field(default=None)
    spot: bool = Field(default=False)
    service_account_name: str | None = Field(default=None)
    cpu_request: str | None = Field(default=None)
    memory_request: str | None = Field(default=None)
    ephemeral_storage_request: str | None = Field(default=None)
    shm_size: str | None = Field(default=None)
    pending_timeout_seconds: float = Field(default=600)
    poll_seconds: float = Field(default=2.0)
    kubeconfig_path: str | None = Field(default=None)
    kube_context: str | None = Field(default=None)
    image_builder: str = Field(default="none")
    image_repository: str | None = Field(default=None)
    gcp_project: str | None = Field(default=None)
    gcp_region: str | None = Field(default=None)
    build_staging_bucket: str | None = Field(default=None)
    stream_output: bool = Field(default=True)

    @property
    def accelerator_spec(self) -> accelerators.AcceleratorSpec:
        spec = accelerators.resolve(self.accelerator)
        return spec.with_spot() if self.spot else spec

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        spec = self.accelerator_spec
        check_accelerator(spec)
        if work_pool is not None:
            self.labels[POOL_LABEL] = work_pool.name
        self.labels["kinetic.prefect.io/accelerator"] = spec.name
        self.job_manifest = self.render_manifest(spec, flow_run)

    def render_manifest(self, spec: accelerators.AcceleratorSpec, flow_run: FlowRun) -> dict[str, Any]:
        manifest = copy.deepcopy(self.job_manifest)
        labels = {k: _label_value(v) for k, v in self.labels.items()}
        metadata = manifest.setdefault("metadata", {})
        metadata["namespace"] = self.namespace
        # One name per flow run: a second create for the same run (a restarted worker) gets 409, never a duplicate.
        slug = re.sub(r"[^a-z0-9-]", "-", str(flow_run.name).lower())[:40].strip("-")
        metadata["name"] = f"kinetic-{slug}-{flow_run.id.hex[:8]}"
        metadata["labels"] = {**(metadata.get("labels") or {}), **labels}
        job_spec = manifest.setdefault("spec", {})
        job_spec["backoffLimit"] = 0  # retries belong to Prefect: one Job is one attempt
        template = job_spec.setdefault("template", {})
        template.setdefault("metadata", {})["labels"] = {**(template["metadata"].get("labels") or {}), **labels}
        pod = template.setdefault("spec", {})
        pod["restartPolicy"] = "Never"
        pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **spec.node_selector}
        tolerations = list(pod.get("tolerations") or [])
        if spec.resource_name:
            tolerations.append({"key": spec.resource_name, "operator": "Exists", "effect": "NoSchedule"})
        if spec.spot:
            tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                                "effect": "NoSchedule"})
        pod["tolerations"] = tolerations or None
        containers = pod.setdefault("containers", [{}])
        container = containers[0]
        container.setdefault("name", CONTAINER)
        container["image"] = self.image or container.get("image")
        container["command"] = ["python", "-u", "-m", "kinetic_prefect.runner"]
        existing_env = {e["name"]: e for e in container.get("env") or [] if isinstance(e, dict)}
        for key, value in self.env.items():
            existing_env[key] = {"name": key, "value": str(value)}
        container["env"] = list(existing_env.values())
        requests = {k: v for k, v in {"cpu": self.cpu_request, "memory": self.memory_request,
                                      "ephemeral-storage": self.ephemeral_storage_request}.items() if v}
        resources = container.setdefault("resources", {})
        resources["requests"] = {**(resources.get("requests") or {}), **requests}
        if spec.resource_name:
            resources["limits"] = {**(resources.get("limits") or {}), spec.resource_name: str(spec.resource_count)}
        if self.shm_size:  # PyTorch/Grain data loaders share batches through /dev/shm (64 MiB by default)
            pod["volumes"] = [*(pod.get("volumes") or []),
                              {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}}]
            container["volumeMounts"] = [*(container.get("volumeMounts") or []), {"name": "dshm", "mountPath": "/dev/shm"}]
        return _prune(manifest)

    def kube_client(self):
        from kubernetes import client, config

        if self.kubeconfig_path:
            return config.new_client_from_config(config_file=self.kubeconfig_path, context=self.kube_context)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(context=self.kube_context)
        return client.ApiClient()


class JobFollower:
    """Follows one Job to its end through the Kubernetes API (blocking calls, run in a thread)."""

    def __init__(self, api_client, namespace: str, job_name: str, on_line: Callable[[str], None]):
        from kubernetes import client

        self.batch, self.core = client.BatchV1Api(api_client), client.CoreV1Api(api_client)
        self.namespace, self.job_name, self.on_line = namespace, job_name, on_line
        self._log_thread: threading.Thread | None = None
        self._log_failed = False
        self._lines_forwarded = 0

    def pod(self):
        from kubernetes.client.exceptions import ApiException

        try:
            self.batch.read_namespaced_job(self.job_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise JobGone(self.job_name) from None
            raise
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={self.job_name}").items
        # Filter here too: some API servers (and emulators) ignore label selectors.
        mine = [p for p in pods if (p.metadata.labels or {}).get("job-name") == self.job_name]
        return max(mine, key=lambda p: p.metadata.creation_timestamp or 0, default=None) if mine else None

    def events_for(self, name: str) -> list[str]:
        events = self.core.list_namespaced_event(self.namespace).items
        return [f"{e.reason}: {e.message}" for e in events
                if e.involved_object is not None and e.involved_object.name == name and e.type != "Normal"]

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
                response = self.core.read_namespaced_pod_log(pod_name, self.namespace, container=CONTAINER,
                                                             follow=True, _preload_content=False)
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
            self.batch.delete_namespaced_job(self.job_name, self.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise


class KineticGKEWorker(KineticWorkerMixin, BaseWorker):
    type = "kinetic-gke"
    job_configuration = KineticGKEJobConfiguration
    _description = "Runs @kinetic_task jobs as Kubernetes Jobs on GKE GPU/TPU node pools."
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    @classmethod
    def check_accelerator(cls, spec: accelerators.AcceleratorSpec) -> None:
        check_accelerator(spec)

    # ------------------------------------------------------------------ images
    @staticmethod
    def ensure_image(configuration: KineticGKEJobConfiguration, log: Callable[[str], None]) -> str:
        if configuration.image:
            return configuration.image
        from kinetic_prefect import builders

        spec = configuration.image_spec
        if configuration.image_builder == "docker" and configuration.image_repository:
            return builders.DockerBuilder(configuration.image_repository).ensure(spec, log)
        if configuration.image_builder == "cloud-build" and configuration.image_repository:
            return builders.CloudBuildBuilder(
                project=configuration.gcp_project, region=configuration.gcp_region,
                repository=configuration.image_repository, staging_bucket=configuration.build_staging_bucket,
            ).ensure(spec, log)
        raise ValueError(
            "kinetic-gke needs an image: pass image= to @kinetic_task, or set the pool's image_builder "
            "('cloud-build' or 'docker') and image_repository (e.g. us-docker.pkg.dev/PROJECT/REPO)."
        )

    # ------------------------------------------------------------------ running
    async def run(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration,
                  task_status: anyio.abc.TaskStatus[str] | None = None) -> KineticWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        await configuration.load_secret_env()
        api = await anyio.to_thread.run_sync(configuration.kube_client)
        job_name = await anyio.to_thread.run_sync(self._existing_job, api, configuration.namespace, flow_run)
        if job_name:
            logger.info(f"Reattaching to existing Job {job_name} (no duplicate is launched)")
        else:
            image = await anyio.to_thread.run_sync(self.ensure_image, configuration, logger.info)
            configuration.image = image
            configuration.job_manifest["spec"]["template"]["spec"]["containers"][0]["image"] = image
            job_name = await anyio.to_thread.run_sync(self._create_job, api, configuration)
            logger.info(f"Created Job {configuration.namespace}/{job_name} for accelerator {configuration.accelerator}")
        identifier = f"{configuration.namespace}:{job_name}"
        if task_status is not None:
            task_status.started(identifier)
        return await self.follow(flow_run, configuration, api, job_name)

    @staticmethod
    def _existing_job(api, namespace: str, flow_run: FlowRun) -> str | None:
        from kubernetes import client

        jobs = client.BatchV1Api(api).list_namespaced_job(namespace, label_selector=f"{FLOW_RUN_LABEL}={flow_run.id}").items
        mine = [j for j in jobs if (j.metadata.labels or {}).get(FLOW_RUN_LABEL) == str(flow_run.id)]
        return mine[0].metadata.name if mine else None

    @staticmethod
    def _create_job(api, configuration: KineticGKEJobConfiguration) -> str:
        """Create the Job; forwarded env values go in a Secret it references, owned by the Job
        (deleted with it), so they appear in no manifest and no Prefect record."""
        from kubernetes import client

        manifest = configuration.job_manifest
        job_name = manifest["metadata"]["name"]
        secret_name = f"{job_name}-env"[:253]
        core = client.CoreV1Api(api)
        if configuration.secret_env:
            core.create_namespaced_secret(configuration.namespace, {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": secret_name, "namespace": configuration.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "kinetic-prefect"}},
                "stringData": configuration.secret_env,
            })
            container = manifest["spec"]["template"]["spec"]["containers"][0]
            container["envFrom"] = [*(container.get("envFrom") or []), {"secretRef": {"name": secret_name}}]
        created = client.BatchV1Api(api).create_namespaced_job(configuration.namespace, manifest)
        if configuration.secret_env:
            core.patch_namespaced_secret(secret_name, configuration.namespace, {"metadata": {"ownerReferences": [{
                "apiVersion": "batch/v1", "kind": "Job", "name": created.metadata.name,
                "uid": created.metadata.uid or "", "blockOwnerDeletion": False}]}})
        return created.metadata.name

    async def follow(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration, api,
                     job_name: str) -> KineticWorkerResult:
        """Wait for the Job's pod to end; fail fast on problems that will not fix themselves."""
        logger = self.get_flow_run_logger(flow_run)
        follower = JobFollower(api, configuration.namespace, job_name,
                               logger.info if configuration.stream_output else (lambda line: None))
        identifier = f"{configuration.namespace}:{job_name}"
        pending_since = time.monotonic()
        marked_running = False
        finished = False
        try:
            while True:
                if await self.cancellation_requested(flow_run):
                    await anyio.to_thread.run_sync(follower.delete)
                    finished = True
                    await self.mark_cancelled(flow_run, f"Job {job_name} deleted on request")
                    logger.info(f"Cancelled: deleted Job {job_name} and its pods")
                    return KineticWorkerResult(identifier=identifier, status_code=0)
                try:
                    pod = await anyio.to_thread.run_sync(follower.pod)
                except JobGone:
                    finished = True
                    logger.warning(f"Job {job_name} was deleted before it finished (cancelled?)")
                    await self._crash(flow_run, f"Job {job_name} was deleted before it finished")  # no-op if Cancelled
                    return KineticWorkerResult(identifier=identifier, status_code=0)
                phase = pod.status.phase if pod is not None and pod.status else None
                if phase in (None, "Pending"):
                    problem = follower.pending_problem(pod) if pod is not None else None
                    if problem is None and time.monotonic() - pending_since > configuration.pending_timeout_seconds:
                        problem = (f"still pending after {configuration.pending_timeout_seconds:.0f}s: "
                                   + await anyio.to_thread.run_sync(follower.diagnose_pending, pod))
                    if problem:
                        finished = True  # _give_up deletes the Job itself
                        return await self._give_up(flow_run, follower, identifier, f"Job {job_name} cannot start: {problem}")
                elif phase == "Running":
                    if not marked_running:
                        marked_running = True
                        await self.mark_running(flow_run, f"Pod {pod.metadata.name} running on {pod.spec.node_name or '?'}")
                        follower.stream_logs(pod.metadata.name)
                elif phase in ("Succeeded", "Failed"):
                    follower.stream_logs(pod.metadata.name)
                    await anyio.to_thread.run_sync(follower.finish_logs)
                    follower.stream_logs(pod.metadata.name, again=True)
                    await anyio.to_thread.run_sync(follower.finish_logs)
                    finished = True
                    exit_code, reason = self._exit(pod)
                    if exit_code != 0:
                        logger.error(f"Pod {pod.metadata.name} ended {phase} with exit code {exit_code} ({reason})")
                        await self._crash(flow_run, f"Job {job_name} exited with code {exit_code} ({reason}); "
                                                    "no outcome was recorded")
                    return await self.finish_from_outcome(flow_run, configuration, exit_code, identifier)
                await asyncio.sleep(configuration.poll_seconds)
        finally:
            if not finished:  # cancelled or crashed while following: the Job must not outlive us
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(follower.delete)

    @staticmethod
    def _exit(pod) -> tuple[int, str]:
        for status in pod.status.container_statuses or []:
            terminated = status.state.terminated if status.state else None
            if terminated is not None:
                return int(terminated.exit_code), terminated.reason or "terminated"
        return (0, "Succeeded") if pod.status.phase == "Succeeded" else (1, pod.status.reason or "Failed")

    async def _crash(self, flow_run: FlowRun, message: str) -> None:
        try:
            await propose_state(self.client, Crashed(message=message), flow_run_id=flow_run.id)
        except Abort:
            pass

    async def _give_up(self, flow_run, follower: JobFollower, identifier: str, message: str) -> KineticWorkerResult:
        self.get_flow_run_logger(flow_run).error(message)
        await anyio.to_thread.run_sync(follower.delete)
        await self._crash(flow_run, message)
        return KineticWorkerResult(identifier=identifier, status_code=1)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: KineticGKEJobConfiguration,
                                  grace_seconds: int = 30) -> None:
        namespace, _, job_name = infrastructure_pid.partition(":")
        if not job_name:
            raise InfrastructureNotFound(f"not a kinetic-gke job id: {infrastructure_pid!r}")
        api = await anyio.to_thread.run_sync(configuration.kube_client)
        await anyio.to_thread.run_sync(JobFollower(api, namespace, job_name, print).delete)

    # ------------------------------------------------------------------ restarts
    async def reattach_running_jobs(self) -> int:
        """After a restart: follow the Jobs this pool launched whose runs are not final yet."""
        from kubernetes import client

        template_defaults = {k: v.get("default") for k, v in
                             self.work_pool.base_job_template["variables"]["properties"].items()}
        namespace = template_defaults.get("namespace") or "default"
        base = KineticGKEJobConfiguration(**{k: v for k, v in template_defaults.items()
                                             if k in ("kubeconfig_path", "kube_context") and v})
        api = await anyio.to_thread.run_sync(base.kube_client)
        jobs = await anyio.to_thread.run_sync(
            lambda: client.BatchV1Api(api).list_namespaced_job(namespace, label_selector=f"{POOL_LABEL}={self.work_pool.name}").items)
        count = 0
        for job in jobs:
            labels = job.metadata.labels or {}
            if labels.get(POOL_LABEL) != _label_value(self.work_pool.name) or not labels.get(FLOW_RUN_LABEL):
                continue
            flow_run = await self.client.read_flow_run(labels[FLOW_RUN_LABEL])
            if flow_run.state is None or flow_run.state.is_final():
                continue
            configuration = await self.job_configuration.resolve_for_flow_run(
                flow_run, client=self.client, work_pool=self.work_pool, worker_name=self.name)
            self._runs_task_group.start_soon(self.follow, flow_run, configuration, api, job.metadata.name)
            count += 1
        return count

    async def setup(self) -> None:
        await super().setup()
        if self._work_pool is not None:
            try:
                count = await self.reattach_running_jobs()
                if count:
                    self._logger.info(f"Reattached to {count} running kinetic Job(s)")
            except Exception as exc:  # a cluster hiccup must not stop the worker from polling
                self._logger.warning(f"Could not look for running Jobs to reattach: {exc!r}")
