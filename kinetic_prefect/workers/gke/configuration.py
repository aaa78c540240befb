"""A kinetic-gke job's configuration: prefect-kubernetes' ``KubernetesWorkerJobConfiguration`` plus the kinetic
fields, and the Job manifest (and the Service of a multi-host group) rendered from it.

:meth:`KineticGKEJobConfiguration.prepare_for_flow_run` adds what the accelerator catalog decides (node selector,
tolerations, accelerator limits, /dev/shm), runs every pod under the Pod Security Standards' restricted profile
(a non-root user, no privilege escalation, no capabilities, RuntimeDefault seccomp, no service-account token), and
moves every environment value but the kinetic wire names out of the manifest into a Secret owned by the Job. The
worker's own Prefect settings (its API key, its server's database) never reach a pod.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration
from pydantic import Field, PrivateAttr

from kinetic_prefect import accelerators
from kinetic_prefect.contract import JAX_COORDINATOR_PORT, RUNNER_ARGV, Env
from kinetic_prefect.workers.base import KineticJobConfiguration
from kinetic_prefect.workers.gke import capacity as gke_capacity
from kinetic_prefect.workers.gke import debug as gke_debug
from kinetic_prefect.workers.gke import fuse as gke_fuse
from kinetic_prefect.workers.gke import prebuilt
from kinetic_prefect.workers.gke.kube import (
    CONTAINER_SECURITY_CONTEXT,
    INDEX_ANNOTATION,
    POD_SECURITY_CONTEXT,
    POOL_LABEL,
    is_plain_env,
    is_worker_only_env,
    kube_client,
    label_value,
    prune,
)
from kinetic_prefect.workers.gke.variables import CONTAINER, JOB_BACKOFF_LIMIT


def _render_pod_security(pod: dict[str, Any]) -> None:
    """The Pod Security Standards' restricted profile for the pod and each container (kube.POD_SECURITY_CONTEXT):
    what the pool's template sets is kept, what it leaves out is filled in (a pool made before these settings
    gets them too). No service-account token: the job never calls the Kubernetes API (Workload Identity reaches
    Google's APIs without one)."""
    pod["securityContext"] = {**POD_SECURITY_CONTEXT, **(pod.get("securityContext") or {})}
    pod.setdefault("automountServiceAccountToken", False)
    for container in [*(pod.get("initContainers") or []), *(pod.setdefault("containers", [{}]))]:
        container["securityContext"] = {**CONTAINER_SECURITY_CONTEXT, **(container.get("securityContext") or {})}


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


class KineticGKEJobConfiguration(KineticJobConfiguration, KubernetesWorkerJobConfiguration):
    job_manifest: dict[str, Any] = Field(default_factory=_minimal_manifest)
    image: str | None = Field(default=None)
    spot: bool = Field(default=False)
    service_account_name: str | None = Field(default=None)
    cpu_request: str | None = Field(default=None)
    memory_request: str | None = Field(default=None)
    ephemeral_storage_request: str | None = Field(default=None)
    shm_size: str | None = Field(default=None)
    gcs_fuse_mounts: dict[str, str] = Field(default_factory=dict)  # Data(..., fuse=True): workers/gke/fuse.py
    hosts: int | None = Field(default=None)  # a group of N pods; a multi-host TPU slice sets its own count
    keep_warm_seconds: float = Field(default=0)  # > 0: warm pods (workers/gke/warm.py)
    min_warm: int = Field(default=0)
    warm_floor_idle_seconds: float | None = Field(default=None)  # a min_warm pod's idle limit; None: none
    pod_watch_timeout_seconds: int = Field(default=600)
    provisioning_timeout_seconds: int | None = Field(default=None)  # None: by family (capacity.provisioning_timeout)
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
    install_requirements_at_start: bool = Field(default=False)  # prebuilt mode: pip in the pod, not in the image
    hold_node_during_build: bool = Field(default=True)  # a placeholder asks for the node while the image builds
    _template_manifest: dict[str, Any] | None = PrivateAttr(default=None)  # before rendering: each attempt's base
    _image_given: bool | None = PrivateAttr(default=None)  # image= (kept for every attempt), not built per family
    # The environment values moved out of the rendered manifest (the pool's and the call's env): the Job's Secret.
    _manifest_secret_env: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """None of the worker's own Prefect settings (prefect-kubernetes passes them all, for a flow run in the pod):
        a kinetic job runs no Prefect, and they hold the worker's API key and its server's database URL."""
        return {}

    @property
    def secret_env(self) -> dict[str, str]:
        """What the Job's Secret holds: the values moved out of the manifest, under the forwarded ones (env= of the
        call, read in memory or from its Secret block) and the job's signing keys."""
        return {**self._manifest_secret_env, **self._secret_env}

    def image_given(self) -> bool:
        """Whether ``image`` was given (kept for every attempt) rather than built per accelerator family: read
        at the first attempt, before the launcher sets ``image``, and the same answer at every later one."""
        if self._image_given is None:
            self._image_given = bool(self.image)
        return self._image_given

    @property
    def host_count(self) -> int:
        """Pods in the group: the slice's hosts for a multi-host TPU, else ``hosts`` (1 by default)."""
        return accelerators.host_count(self.accelerator_spec, self.hosts)

    @property
    def accelerator_spec(self) -> accelerators.AcceleratorSpec:
        spec = self.asked_spec
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

        manifest = copy.deepcopy(self._template_manifest if self._template_manifest is not None else self.job_manifest)
        labels = {k: label_value(v) for k, v in self.labels.items()}
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
        _render_pod_security(pod)
        self._render_container(pod, spec)
        gke_fuse.render(manifest, self.gcs_fuse_mounts)
        if self.host_count > 1:
            self._render_group(manifest, spec)
        gke_capacity.render(manifest, self, spec, attempt)
        gke_debug.render(manifest)  # a debug job: the debugpy port, and no deadline while it waits (gke/debug.py)
        return prune(manifest)

    def _render_container(self, pod: dict[str, Any], spec: accelerators.AcceleratorSpec) -> None:
        """The job's container in ``pod``: the image, the runner's command, the environment (secret values moved
        out of the manifest into the secret environment), the resources and a /dev/shm of ``shm_size``."""
        containers = pod.setdefault("containers", [{}])
        container = containers[0]
        container.setdefault("name", CONTAINER)
        container["image"] = self.image or container.get("image")
        container["command"] = list(RUNNER_ARGV)
        if self.install_requirements_at_start:  # prebuilt mode: the pod installs the requirements (gke/prebuilt.py)
            container["command"] = prebuilt.install_then_run()
        container.pop("args", None)  # prefect-kubernetes puts the flow-run command there; the runner takes none
        container["env"] = self._split_env(container.get("env") or [])
        if self.install_requirements_at_start:
            # the pod pip-installs these lines: held to what a caller can send even when no image is built here
            self.check_build_variables()
            container["env"].append(prebuilt.install_env(self.image_spec))
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

    def _split_env(self, template_env: list[Any]) -> list[dict[str, Any]]:
        """The container's ``env`` list: the kinetic wire names as plain values; every other value moved into the
        Job's Secret (``secret_env``); the worker's own Prefect settings dropped, from the job's ``env`` too."""
        entries = {e["name"]: e for e in template_env if isinstance(e, dict)}
        for key, value in list(self.env.items()):
            if is_worker_only_env(key):
                self.env.pop(key)
            elif value is not None:
                entries[key] = {"name": key, "value": str(value)}
        moved: dict[str, str] = {}
        for name, entry in list(entries.items()):
            if is_worker_only_env(name):
                entries.pop(name)
            elif "value" in entry and not is_plain_env(name):
                moved[name] = str(entries.pop(name)["value"])
        self._manifest_secret_env = moved
        return list(entries.values())

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
