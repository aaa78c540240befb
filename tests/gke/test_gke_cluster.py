"""kinetic-gke against a real Kubernetes control plane (tests/support/kube_cluster.py) with fake GKE accelerator nodes.

Real here: kube-apiserver (validation, admission, RBAC, service-account tokens), kube-scheduler (it alone decides
where a pod goes and why it cannot), kube-controller-manager (Job status, TTL after finished, garbage collection of
the Secret a Job owns), the official Kubernetes client, the image DockerBuilder builds and pushes to a local
registry, the job runner in that image against fake-gcs-server, Prefect's server, and `prefect worker start` for
cancellation and restart.  Not GKE: nodes have no kubelet; tests/support/docker_kubelet.py runs bound pods in Docker and
serves their logs through the API server's pods/log proxy.  The pool is configured with a saved prefect-kubernetes
``KubernetesClusterConfig`` block, as a Prefect user would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from background import call_in_background
from docker_fixture import proxy_files
from fault_proxy import FaultProxy
from kubernetes import client as k8s
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTaskRunId,
)
from prefect.states import Cancelling
from prefect_kubernetes.credentials import KubernetesClusterConfig
from worker_fixture import stop_worker_process

from kinetic_prefect import kinetic_task
from kinetic_prefect.errors import KineticJobCrashed
from kinetic_prefect.workers.gke.deploy import worker_manifests
from kinetic_prefect.workers.gke.worker import KineticGKEWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_image(local_registry, python_base_image):
    """The image the worker will look for, built ahead with this machine's proxy CA (the worker then finds the
    tag in the registry and skips its own build, which is what a warm repository looks like)."""
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    for family in ("gpu", "tpu", "cpu"):
        spec = ImageSpec.create(None, family=family, base_image=python_base_image)
        DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
            spec, log=lambda line: None
        )


def _cluster_block(kube, token: str | None = None, server: str | None = None) -> str:
    """A saved KubernetesClusterConfig block; returns its document id for a pool's default."""
    name = f"kube-{uuid.uuid4().hex[:8]}"
    block = KubernetesClusterConfig(config=kube.plane.kubeconfig_dict(token, server), context_name="kinetic-test")
    return str(block.save(name))


def _make_pool(cluster_block_id: str, store: str, local_registry: str, namespace: str = "default", **more) -> str:
    template = KineticGKEWorker.get_default_base_job_template()
    defaults = {
        "cluster_config": {"$ref": {"block_document_id": cluster_block_id}},
        "image_builder": "docker",
        "image_repository": f"{local_registry}/kinetic-tests",
        "store": store,
        "poll_seconds": 0.3,
        "pod_watch_timeout_seconds": 6,
        "namespace": namespace,
        **more,
    }
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    name = f"gke-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-gke", base_job_template=template))
    return name


@pytest.fixture
def gke_pool(kube, gcs_bucket, local_registry, job_image):
    return _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry)


def _jobs(kube, namespace="default"):
    return k8s.BatchV1Api(kube.api()).list_namespaced_job(namespace).items


def _job_for(kube, run_id, namespace="default"):
    return [j for j in _jobs(kube, namespace) if j.metadata.labels.get("prefect.io/flow-run-id") == str(run_id)]


def _job_runs(name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def _gke_task(name, pool, base_image, **options):
    return kinetic_task(name=name, work_pool=pool, base_image=base_image, env=["STORAGE_EMULATOR_HOST"], **options)


def _run_logs(run_id, wanted: str, timeout: float = 15) -> str:
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            text = "\n".join(
                log.message
                for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            )
            if wanted in text or time.time() > deadline:
                return text
            time.sleep(0.3)


def _wait(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while not (value := predicate()):
        assert time.time() < deadline, what
        time.sleep(0.3)
    return value


def _events(name: str, since: float, until=bool, timeout: float = 20.0):
    """Events named ``name`` since ``since``; the server stores events asynchronously, so poll until
    ``until(found)`` holds (or the timeout passes, returning what there is)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.time() + timeout
    while True:
        with get_client(sync_client=True) as client:
            found = [
                e
                for e in client.read_events(
                    EventFilter(
                        event=EventNameFilter(name=[name]),
                        occurred=EventOccurredFilter(since=datetime.fromtimestamp(since - 5, tz=UTC)),
                    ),
                    limit=50,  # the most the events API returns in one page; newest first
                ).events
            ]
        if until(found) or time.time() > deadline:
            return found
        time.sleep(0.5)


def test_an_l4_call_is_scheduled_on_the_l4_pool_and_returns(kube, gke_pool, python_base_image):
    name = f"on-l4-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="l4")
    def double(x: int) -> dict:
        print(f"hello from the pod, doubling {x}")
        return {"value": 2 * x, "accelerator": os.environ["KINETIC_ACCELERATOR"], "jax": os.environ["JAX_PLATFORMS"]}

    @flow
    def pipeline():
        return double(21)

    result = pipeline()
    assert result == {"value": 42, "accelerator": "l4", "jax": "cuda"}
    [run] = _job_runs(name)
    assert run.state.is_completed()
    job = _wait(
        lambda: next((j for j in _job_for(kube, run.id) if (j.status.succeeded or 0) == 1), None),
        30,
        "the Job controller never counted the pod as succeeded",
    )
    [pod] = (
        k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items
    )
    assert pod.spec.node_name == "gke-l4-pool-1", "the real scheduler placed it on the L4 node pool"
    container = job.spec.template.spec.containers[0]
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    names = {e.name for e in container.env or []}
    assert not names & {"STORAGE_EMULATOR_HOST", "PREFECT_API_KEY", "KINETIC_PREFECT_API_KEY"}, (
        "secret and forwarded values are not written into the manifest"
    )
    [secret_ref] = container.env_from
    secret = k8s.CoreV1Api(kube.api()).read_namespaced_secret(secret_ref.secret_ref.name, "default")
    assert secret.metadata.owner_references[0].uid == job.metadata.uid, "the Secret belongs to its Job"
    # the pod's log came through the API server's pods/log proxy into the job run's logs
    assert "hello from the pod, doubling 21" in _run_logs(run.id, "hello from the pod")

    # Deleting the Job (as TTL or a person would) takes its Secret with it: the garbage collector, not the worker.
    k8s.BatchV1Api(kube.api()).delete_namespaced_job(job.metadata.name, "default", propagation_policy="Background")
    core = k8s.CoreV1Api(kube.api())
    _wait(
        lambda: (
            not [s for s in core.list_namespaced_secret("default").items if s.metadata.name == secret.metadata.name]
        ),
        60,
        "the Job's Secret was not garbage-collected",
    )


def test_a_tpu_call_lands_on_the_tpu_slice(kube, gke_pool, python_base_image):
    name = f"on-tpu-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="tpu-v5litepod-1")
    def where() -> dict:
        return {"accelerator": os.environ["KINETIC_ACCELERATOR"], "jax": os.environ["JAX_PLATFORMS"]}

    @flow
    def pipeline():
        return where()

    assert pipeline() == {"accelerator": "tpu-v5litepod-1", "jax": "tpu"}
    [run] = _job_runs(name)
    [job] = _job_for(kube, run.id)
    [pod] = (
        k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items
    )
    assert pod.spec.node_name == "gke-tpu-v5e-pool-1"
    assert pod.spec.node_selector == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "1x1",
    }
    assert pod.spec.containers[0].resources.limits == {"google.com/tpu": "1"}


def test_no_node_pool_for_the_accelerator_fails_with_the_schedulers_reason(kube, gke_pool, python_base_image):
    started = time.time()

    @_gke_task(f"no-h100-{uuid.uuid4().hex[:6]}", gke_pool, python_base_image, accelerator="h100x8")
    def big() -> int:
        return 1

    @flow
    def pipeline():
        return big()

    # the real scheduler's words, then our hint
    with pytest.raises(
        KineticJobCrashed, match=r"0/\d+ nodes are available.*didn't match Pod's node affinity/selector"
    ):
        pipeline()
    assert time.time() - started < 90, "bounded by pod_watch_timeout_seconds, not forever"
    assert not [j for j in _jobs(kube) if j.metadata.labels.get("kinetic.prefect.io/accelerator") == "h100x8"], (
        "the stuck Job is deleted"
    )
    # An automation can page on it: prefect-kubernetes' diagnosis category is an event label.  The scheduler's
    # message names the tainted GPU/TPU nodes first ("1 node(s) had untolerated taint(s), 2 node(s) didn't
    # match Pod's node affinity/selector"), which prefect-kubernetes files under Unschedulable.Taint.
    events = _wait(
        lambda: [
            e
            for e in _events("kinetic.job.diagnosis", started)
            if e.resource.get("kubernetes.diagnosis") in ("Unschedulable.Taint", "Unschedulable.NodeAffinity")
        ],
        30,
        "no kinetic.job.diagnosis event with an Unschedulable category",
    )
    assert "no node pool has accelerator h100x8" in events[0].payload["resolution"]
    assert _wait(lambda: _events("kinetic.job.unschedulable", started), 30, "no kinetic.job.unschedulable event")


def test_an_image_that_cannot_be_pulled_fails_fast(kube, gke_pool, local_registry):
    @kinetic_task(
        name=f"bad-image-{uuid.uuid4().hex[:6]}",
        work_pool=gke_pool,
        accelerator="l4",
        image=f"{local_registry}/kinetic-tests/missing:nope",
        env=["STORAGE_EMULATOR_HOST"],
    )
    def never() -> int:
        return 1

    @flow
    def pipeline():
        return never()

    started = time.time()
    with pytest.raises(KineticJobCrashed, match="ErrImagePull"):
        pipeline()
    assert time.time() - started < 60


def test_a_finished_job_and_its_secret_expire_after_the_ttl(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry, finished_job_ttl=2)
    name = f"ttl-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="l4")
    def quick() -> int:
        return 7

    @flow
    def pipeline():
        return quick()

    assert pipeline() == 7
    [run] = _job_runs(name)
    core = k8s.CoreV1Api(kube.api())
    secret_name = f"kinetic-{run.name}-{run.id.hex[:8]}-env"  # the Job's name (flow run name + id) + "-env"
    _wait(lambda: not _job_for(kube, run.id), 60, "the TTL controller did not delete the finished Job")
    _wait(
        lambda: secret_name not in {s.metadata.name for s in core.list_namespaced_secret("default").items},
        60,
        f"the expired Job's Secret {secret_name} was not garbage-collected",
    )


def test_the_in_cluster_workers_role_is_enough_and_no_more(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """The worker runs with exactly the Role `kinetic-prefect gke-worker-manifests` grants, enforced by RBAC."""
    namespace = f"ml-{uuid.uuid4().hex[:5]}"
    admin = kube.api()
    k8s.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
    _wait(
        lambda: any(
            sa.metadata.name == "default"
            for sa in k8s.CoreV1Api(admin).list_namespaced_service_account(namespace).items
        ),
        30,
        "no default SA",
    )
    for manifest in worker_manifests("any-pool", namespace=namespace, image="unused"):
        kind = manifest["kind"]
        if kind == "ServiceAccount":
            k8s.CoreV1Api(admin).create_namespaced_service_account(namespace, manifest)
        elif kind == "Role":
            k8s.RbacAuthorizationV1Api(admin).create_namespaced_role(namespace, manifest)
        elif kind == "RoleBinding":
            k8s.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(namespace, manifest)
    token = kube.plane.service_account_token(namespace, "kinetic-gke-worker")
    pool = _make_pool(_cluster_block(kube, token=token), f"{gcs_bucket}/gke-rbac", local_registry, namespace=namespace)
    name = f"least-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="l4")
    def hello() -> str:
        print("running under the worker's Role")
        return "ok"

    @flow
    def pipeline():
        return hello()

    assert pipeline() == "ok"
    [run] = _job_runs(name)
    assert "running under the worker's Role" in _run_logs(run.id, "running under the worker's Role")

    worker = kube.api(token=token)
    refused = {
        "read a Secret": lambda: k8s.CoreV1Api(worker).list_namespaced_secret(namespace),
        "create Jobs in another namespace": lambda: k8s.BatchV1Api(worker).create_namespaced_job(
            "default",
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "x"},
                "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}},
            },
        ),
        "delete a pod": lambda: k8s.CoreV1Api(worker).delete_collection_namespaced_pod(namespace),
        "list nodes": lambda: k8s.CoreV1Api(worker).list_node(),
    }
    for what, call in refused.items():
        with pytest.raises(k8s.exceptions.ApiException) as caught:
            call()
        assert caught.value.status == 403, what


def _namespace(kube, *, restricted: bool, quota: dict[str, str] | None = None) -> str:
    """A namespace of the test's own with the job pods' ServiceAccount ``kinetic-job``, as `kinetic-prefect up` makes
    it: with ``restricted``, PodSecurity admission enforces the restricted profile there; ``quota``: a
    ResourceQuota's hard limits."""
    admin = k8s.CoreV1Api(kube.api())
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    labels = {"pod-security.kubernetes.io/enforce": "restricted"} if restricted else {}
    admin.create_namespace({"metadata": {"name": namespace, "labels": labels}})
    admin.create_namespaced_service_account(
        namespace, {"metadata": {"name": "kinetic-job"}, "automountServiceAccountToken": False}
    )
    if quota:
        admin.create_namespaced_resource_quota(namespace, {"metadata": {"name": "quota"}, "spec": {"hard": quota}})
    return namespace


def test_a_job_runs_in_a_namespace_that_enforces_the_restricted_profile(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """Issue 45 findings 6, 8 and 3 on the real API server: a kinetic job runs where PodSecurity admission enforces
    the restricted profile (a root pod is refused there), as user 10001 with no capability and no privilege
    escalation, writing its HOME; the pool's HF_TOKEN reaches it through the Job's Secret alone, and the worker's
    own Prefect API key and database URL reach it not at all, nor the Job's manifest."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_KEY, temporary_settings

    namespace = _namespace(kube, restricted=True)
    root_pod = {"metadata": {"name": "root"}, "spec": {"containers": [{"name": "c", "image": python_base_image}]}}
    with pytest.raises(k8s.exceptions.ApiException) as refused:
        k8s.CoreV1Api(kube.api()).create_namespaced_pod(namespace, root_pod)
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted' in message, "admission enforces the profile here"
    pool_env = {"HF_TOKEN": "hf_pool_token_0123456789", "WANDB_API_KEY": "wandb-pool-key-0123456789"}
    pool = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke-psa", local_registry, namespace=namespace,
        service_account_name="kinetic-job", env=pool_env,
    )  # fmt: skip
    worker_secrets = {
        PREFECT_API_KEY: "pnu_worker_api_key_0123456789",
        PREFECT_API_DATABASE_CONNECTION_URL: "postgresql+asyncpg://prefect:db-password-0123@db:5432/prefect",
    }
    name = f"restricted-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="cpu")
    def inside() -> dict:
        from pathlib import Path

        status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines())
        (Path.home() / ".cache" / "probe").parent.mkdir(parents=True, exist_ok=True)
        (Path.home() / ".cache" / "probe").write_text("written")
        names = ("HF_TOKEN", "WANDB_API_KEY", "PREFECT_API_KEY", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
        return {
            "ids": (os.getuid(), os.getgid()),
            "home": str(Path.home()),
            "capabilities": status["CapEff"].strip(),
            "no_new_privs": status["NoNewPrivs"].strip(),
            "env": {k: os.environ.get(k) for k in names},
        }

    @flow
    def pipeline():
        return inside()

    with temporary_settings(updates=worker_secrets):  # the worker (in-process here) holds them
        result = pipeline()
    assert result["ids"] == (10001, 10001) and result["home"] == "/home/kinetic"
    assert result["capabilities"] == "0000000000000000" and result["no_new_privs"] == "1"
    assert result["env"] == {**pool_env, "PREFECT_API_KEY": None, "PREFECT_SERVER_DATABASE_CONNECTION_URL": None}
    [run] = _job_runs(name)
    [job] = _job_for(kube, run.id, namespace)
    text = json.dumps(k8s.ApiClient().sanitize_for_serialization(job))
    for value in [*pool_env.values(), *worker_secrets.values(), "db-password-0123"]:
        assert value not in text, f"{value} is written into the Job"
    [pod] = (
        k8s.CoreV1Api(kube.api()).list_namespaced_pod(namespace, label_selector=f"job-name={job.metadata.name}").items
    )
    assert pod.spec.security_context.run_as_non_root and pod.spec.automount_service_account_token is False
    assert pod.spec.service_account_name == "kinetic-job"


def test_a_job_that_cannot_be_created_leaves_no_secret_behind(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """Issue 45 finding 9: the API server refuses the Job (a ResourceQuota of no Jobs); the call crashes saying so,
    and no Secret of its environment values is left in the namespace (it was made before the Job, and orphaned)."""
    namespace = _namespace(kube, restricted=True, quota={"count/jobs.batch": "0"})
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke-quota", local_registry, namespace=namespace)

    @_gke_task(f"no-room-{uuid.uuid4().hex[:6]}", pool, python_base_image, accelerator="cpu")
    def never() -> int:
        return 1

    @flow
    def pipeline():
        return never()

    with pytest.raises(KineticJobCrashed, match="(?s)could not be started.*exceeded quota"):
        pipeline()
    assert k8s.CoreV1Api(kube.api()).list_namespaced_secret(namespace).items == [], "an orphaned Secret"


CRAFTED_BUILDS = [
    ("requirements", ["--index-url http://127.0.0.1:9/simple"]),
    ("requirements", ["numpy\n--extra-index-url http://127.0.0.1:9/simple"]),
    ("requirements", ["-e git+http://127.0.0.1:9/pkg#egg=pkg"]),
    ("requirements", ["http://127.0.0.1:9/pkg-1.0-py3-none-any.whl"]),
    ("requirements", ["numpy; $(touch /tmp/pwned)"]),
    ("base_image", "127.0.0.1:9/not-the-pools:1"),
]


def test_a_flow_run_with_crafted_build_variables_is_refused_and_nothing_is_built(
    kube, gcs_bucket, local_registry, python_base_image, monkeypatch
):
    """Issue 45 finding 9: a user of the pool creates a flow run over the API (no caller checks it; its job variables
    signed with the key they hold) with requirements that are pip options, a URL line or shell text, or a base image
    the pool does not allow. The worker refuses each before anything is built or a Job made; the run crashes naming
    the variable. (Without the key such a run is refused before: its variables carry no signature.)"""
    from kinetic_prefect.caller.in_process import run_in_process
    from kinetic_prefect.shared import builders

    built: list = []
    monkeypatch.setattr(builders.DockerBuilder, "ensure", lambda self, spec, log=print: built.append(spec) or "x:1")
    namespace = _namespace(kube, restricted=True)
    pool_name = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke-crafted", local_registry, namespace=namespace,
        base_image=python_base_image,
    )  # fmt: skip

    @flow(name=f"crafted-{uuid.uuid4().hex[:6]}")
    def target():
        pass

    async def attack(variable: str, value) -> Any:
        from kinetic_prefect import signing
        from kinetic_prefect.shared import key_blocks

        async with get_client() as client:
            pool = await client.read_work_pool(pool_name)
            env = {"KINETIC_RUN_ID": uuid.uuid4().hex, "KINETIC_PAYLOAD_SHA256": "0" * 64}
            job_variables = {"env": env, variable: value}
            # a user of the pool who holds the key (its job variables signed, as a caller signs them) and skips the
            # caller's checks: the signature alone does not make them buildable
            signing.sign_job_variables(await key_blocks.signing_key(), job_variables)
            flow_run = await client.create_flow_run(target, work_pool_name=pool_name, job_variables=job_variables)
            await run_in_process(client, pool, flow_run)
            return await client.read_flow_run(flow_run.id)

    for variable, value in CRAFTED_BUILDS:
        run = asyncio.run(attack(variable, value))
        assert run.state.is_crashed(), (variable, value, run.state)
        assert f"job variable {variable}" in run.state.message and "refusing to build" in run.state.message
    assert built == [], "the worker built nothing"
    assert _jobs(kube, namespace) == [] and not Path("/tmp/pwned").exists()


def test_api_server_errors_and_dropped_connections_do_not_end_a_run(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """Every 4th API request answered 503, every 7th connection dropped, from Job creation to the last log line."""
    proxy = FaultProxy(kube.plane.port, kube.plane.workdir / "pki")
    try:
        pool = _make_pool(_cluster_block(kube, server=proxy.server), f"{gcs_bucket}/gke-faults", local_registry)
        name = f"flaky-api-{uuid.uuid4().hex[:6]}"

        @_gke_task(name, pool, python_base_image, accelerator="l4")
        def steady(x: int) -> int:
            import time as t

            for step in range(3):
                print(f"step {step}")
                t.sleep(1)
            return x + 1

        @flow
        def pipeline():
            return steady(41)

        assert pipeline() == 42
        assert proxy.failed >= 3 and proxy.dropped >= 2, (proxy.requests, proxy.failed, proxy.dropped)
        [run] = _job_runs(name)
        assert run.state.is_completed()
        assert len(_job_for(kube, run.id)) == 1, "a retried create made no second Job"
    finally:
        proxy.stop()


@pytest.fixture
def gke_worker(gke_pool, tmp_path):
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "1"}

    def start(name: str, pool: str = gke_pool) -> subprocess.Popen:
        with open(log_path, "a") as log:  # the child writes through its own copy of the descriptor
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefect",
                    "worker",
                    "start",
                    "--type",
                    "kinetic-gke",
                    "--pool",
                    pool,
                    "--name",
                    name,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.time() + 60
        with get_client(sync_client=True) as client:
            while not any(
                w.name == name and w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool)
            ):
                assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
        return proc

    procs: list[subprocess.Popen] = []
    yield lambda name, pool=gke_pool: procs.append(start(name, pool)) or procs[-1], log_path
    for proc in procs:
        stop_worker_process(proc)


def _running_pod(kube, run_id, timeout=120):
    core = k8s.CoreV1Api(kube.api())

    def running():
        for job in _job_for(kube, run_id):
            for pod in core.list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items:
                if pod.status.phase == "Running":
                    return pod
        return None

    return _wait(running, timeout, "the job's pod never ran")


def test_cancelling_the_run_in_prefect_stops_the_pod_and_deletes_the_job(kube, gke_pool, gke_worker, python_base_image):
    start_worker, worker_log = gke_worker
    start_worker("gke-worker-cancel")
    name = f"cancel-me-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="l4")
    def sleepy() -> int:
        import time as t

        t.sleep(120)
        return 1

    thread, box = call_in_background(sleepy)
    run = _wait(lambda: (_job_runs(name) or [None])[0], 60, "no job run")
    _running_pod(kube, run.id)
    containers = kube.kubelet.running_containers()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    thread.join(90)
    assert not thread.is_alive(), worker_log.read_text()[-4000:]
    from kinetic_prefect.errors import KineticJobCancelled

    # the call raises (as a cancelled Prefect task does); the task run ends Cancelled: no retry undoes it
    assert isinstance(box.get("error"), KineticJobCancelled), box
    [run] = _job_runs(name)
    assert run.state.is_cancelled()
    _wait(lambda: not _job_for(kube, run.id), 30, "the Job was not deleted")
    _wait(lambda: not set(containers) & set(kube.kubelet.running_containers()), 60, "the pod's container still runs")


def test_a_restarted_worker_reattaches_without_a_duplicate_job(kube, gke_pool, gke_worker, python_base_image):
    start_worker, worker_log = gke_worker
    first = start_worker("gke-worker-a")
    name = f"survives-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="l4")
    def slow_square(x: int) -> int:
        import time as t

        t.sleep(8)
        print("finished after the worker came back")
        return x * x

    thread, box = call_in_background(slow_square, 9)
    run = _wait(lambda: (_job_runs(name) or [None])[0], 60, "no job run")
    _running_pod(kube, run.id)
    first.send_signal(signal.SIGKILL)  # the worker dies mid-job; the Job keeps running in the cluster
    first.wait(10)
    start_worker("gke-worker-b")
    thread.join(120)
    assert box.get("value") == 81, (box, worker_log.read_text()[-3000:])
    assert len(_job_for(kube, run.id)) == 1, "no duplicate Job"
    assert "Reattached to 1 running kinetic Job" in worker_log.read_text()


# ---------------------------------------------------------------------------------------------- multi-host groups


def _group_pods(kube, run_id):
    [job] = _job_for(kube, run_id)
    pods = (
        k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items
    )
    return job, sorted(pods, key=lambda p: int(p.metadata.annotations["batch.kubernetes.io/job-completion-index"]))


def test_a_multi_host_tpu_slice_runs_one_pod_per_host_and_returns_the_coordinators_value(
    kube, gke_pool, gcs_bucket, python_base_image
):
    name = f"slice-{uuid.uuid4().hex[:6]}"
    token = uuid.uuid4().hex[:8]

    @_gke_task(name, gke_pool, python_base_image, accelerator="tpu-v5p-16")
    def each_host(token: str) -> dict:
        index = os.environ["KINETIC_HOST_INDEX"]
        print(f"host {index} of {os.environ['KINETIC_NUM_HOSTS']} reporting")
        (Path(os.environ["KINETIC_OUTPUT_DIR"]) / f"{token}.txt").write_text(index)
        return {
            k: os.environ.get(k)
            for k in (
                "KINETIC_HOST_INDEX",
                "KINETIC_NUM_HOSTS",
                "TPU_WORKER_ID",
                "TPU_WORKER_HOSTNAMES",
                "KINETIC_COORDINATOR_ADDRESS",
            )
        }

    @flow
    def pipeline():
        return each_host(token)

    result = pipeline()
    [run] = _job_runs(name)
    job, pods = _group_pods(kube, run.id)
    assert result["KINETIC_HOST_INDEX"] == "0" and result["TPU_WORKER_ID"] == "0", "the coordinator's value"
    assert result["KINETIC_NUM_HOSTS"] == "2"
    assert (
        result["TPU_WORKER_HOSTNAMES"]
        == f"{job.metadata.name}-0.{job.metadata.name},{job.metadata.name}-1.{job.metadata.name}"
    )
    assert job.spec.completion_mode == "Indexed"
    _wait(lambda: (_job_for(kube, run.id)[0].status.succeeded or 0) == 2, 30, "the Job controller counts 2 hosts done")
    assert sorted(p.spec.node_name for p in pods) == ["gke-tpu-v5p-16-0", "gke-tpu-v5p-16-1"], (
        "the scheduler put one host on each node of the slice"
    )
    service = k8s.CoreV1Api(kube.api()).read_namespaced_service(job.metadata.name, "default")
    assert service.spec.cluster_ip == "None" and service.metadata.owner_references[0].uid == job.metadata.uid
    logs = _run_logs(run.id, "[host 1] host 1 of 2 reporting")
    assert "[host 1] host 1 of 2 reporting" in logs and "host 0 of 2 reporting" in logs, "every host's log, tagged"
    from kinetic_prefect.storage import open_store

    keys = open_store(f"{gcs_bucket}/gke").list("outputs/")
    assert any(k.endswith(f"/hosts/1/{token}.txt") for k in keys), "host 1's outputs are kept per host"
    assert any(k.endswith(f"/{token}.txt") and "/hosts/" not in k for k in keys), "the coordinator's outputs"


@pytest.fixture(scope="module")
def jax_image(local_registry, python_base_image):
    """A job image with JAX (CPU), for a group that forms one jax.distributed group across pods."""
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    spec = ImageSpec.create(["jax"], family="cpu", base_image=python_base_image)
    DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
        spec, log=lambda line: None
    )


def test_a_group_of_pods_forms_one_jax_group(kube, gke_pool, python_base_image, jax_image):
    name = f"jax-group-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="cpu", requirements=["jax"], job_variables={"hosts": 2})
    def together() -> dict:
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1]))
        return {
            "count": jax.process_count(),
            "index": jax.process_index(),
            "gathered": gathered.ravel().tolist(),
            "devices": len(jax.devices()),
        }

    @flow
    def pipeline():
        return together()

    result = pipeline()
    assert result == {"count": 2, "index": 0, "gathered": [1, 2], "devices": 2}, result


def test_one_host_dying_fails_the_group_and_the_retry_resumes_from_the_checkpoint(kube, gke_pool, python_base_image):
    name = f"group-retry-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="cpu", retries=1, job_variables={"hosts": 2})
    def fragile() -> str:
        import time as t

        checkpoint = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "progress.txt"
        host = int(os.environ["KINETIC_HOST_INDEX"])
        if checkpoint.exists():
            return f"resumed from {checkpoint.read_text()}"
        if host == 0:
            checkpoint.write_text("epoch 1")  # uploaded when the group is stopped (the coordinator's SIGTERM)
            t.sleep(300)
        t.sleep(3)
        # Host 1 dies abruptly (os._exit: in a container the runner is PID 1, which ignores its own SIGKILL).
        # The whole group must fail, not hang.
        os._exit(137)

    @flow
    def pipeline():
        return fragile()

    started = time.time()
    assert pipeline() == "resumed from epoch 1"
    assert time.time() - started < 240
    runs = sorted(_job_runs(name), key=lambda r: r.created)
    assert len(runs) == 2 and runs[0].state.is_crashed() and runs[1].state.is_completed(), [
        (r.name, r.state.name, r.state.message) for r in runs
    ]
    assert "host 1 of 2" in runs[0].state.message and "the group fails with it" in runs[0].state.message


def _warm_jobs(kube, pool: str):
    return [
        j
        for j in _jobs(kube)
        if (j.metadata.labels or {}).get("kinetic.prefect.io/warm-key")
        and (j.metadata.labels or {}).get("kinetic.prefect.io/work-pool") == pool
    ]


SLOT_TAG = "kinetic-slot"


def _slot_pool(kube, store: str, registry: str, slots: int) -> str:
    """A kinetic-gke pool with warm pods whose concurrency limit is ``slots``: a sweep's slot count on kinetic-gke
    when KINETIC_SWEEP_SLOTS is not set."""
    from prefect.client.schemas.actions import WorkPoolUpdate

    pool = _make_pool(_cluster_block(kube), store, registry, keep_warm_seconds=15)
    with get_client(sync_client=True) as client:
        client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=slots))
    return pool


def _slot_task(name, pool, base_image, **options):
    """A task whose calls slots can carry: the emulator's address as a plain job variable (a forwarded ``env=``
    value is a secret, which keeps a call out of slots)."""
    env = {"env": {"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}}
    return kinetic_task(name=name, work_pool=pool, base_image=base_image, job_variables=env, **options)


def _slot_jobs(kube, pool: str) -> list:
    return [j for j in _jobs(kube) if (j.metadata.labels or {}).get("kinetic.prefect.io/work-pool") == pool]


def _map_flow(task, n: int, **kwargs):
    @flow
    def sweep():
        futures = task.map(range(n), **kwargs)
        futures.wait()
        return [(f.task_run_id, f.state.name, f.result(raise_on_failure=False)) for f in futures]

    return sweep


def test_a_map_on_warm_pods_rides_in_slot_pods_a_job_run_per_slot_not_per_input(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """16 inputs on a pool with warm pods and a concurrency limit of 4 (the slot count): 4 slot Jobs, 4 pods and 4
    job runs (tagged kinetic-slot; a Job and a pod per job run), none per input; every value right, each input's
    line in its own task run; the idle slot pods end after keep_warm_seconds and the sweep leaves nothing in the
    store."""
    store_url = f"{gcs_bucket}/gke-slots"
    pool = _slot_pool(kube, store_url, local_registry, slots=4)
    name = f"slots-{uuid.uuid4().hex[:6]}"

    @_slot_task(name, pool, python_base_image, accelerator="cpu")
    def square(x: int) -> dict:
        print(f"squaring {x}", flush=True)
        return {"value": x * x, "slot": os.environ.get("KINETIC_FLOW_RUN_ID", "")}

    started = time.time()
    results = _map_flow(square, 16)()
    print(f"a map of 16 on 4 slot pods: {time.time() - started:.1f} s")
    assert [value["value"] for _, _, value in results] == [x * x for x in range(16)], results
    runs = _wait(lambda: (rs := _job_runs(name)) and all(r.state.is_final() for r in rs) and rs, 60, "final runs")
    # 4 slots (the pool's limit); fewer when a slot's run could not be created under load (the sweep goes on with
    # the others): never a job run per input
    assert 1 <= len(runs) <= 4 and all(SLOT_TAG in (r.tags or []) for r in runs), [(r.name, r.tags) for r in runs]
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state.name) for r in runs]
    assert {value["slot"] for _, _, value in results} <= {str(r.id) for r in runs}
    jobs = _slot_jobs(kube, pool)
    pods = [p for j in jobs for p in _pods_of(kube, j.metadata.name)]
    assert len(jobs) == len(pods) == len(runs), ([j.metadata.name for j in jobs], [p.metadata.name for p in pods])
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[t for t, _, _ in results])))
    lines = {(str(log.task_run_id), log.message) for log in logs if log.message.startswith("squaring ")}
    assert lines == {(str(t), f"squaring {i}") for i, (t, _, _) in enumerate(results)}, sorted(lines)
    _wait(
        lambda: all((j.status.succeeded or 0) == 1 for j in _slot_jobs(kube, pool)),
        90,
        "the idle slot pods did not end after their keep-warm time",
    )
    from kinetic_prefect.storage import open_store

    # the caller removes them once it reads every slot's run final, which trails the pods' end by the worker's report
    _wait(lambda: open_store(store_url).list("sweeps/") == [], 60, "the sweep's records are removed once it is over")


def test_a_map_through_a_polling_gke_worker_rides_in_slot_pods(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_worker
):
    """The same sweep submitted to a kinetic-gke worker process (submission="worker"): the worker launches the slot
    Jobs from the scheduled slot runs, at most the pool's 2, and every value comes back through the store."""
    start_worker, worker_log = gke_worker
    pool = _slot_pool(kube, f"{gcs_bucket}/gke-slots-polling", local_registry, slots=2)
    start_worker("gke-slot-worker", pool)
    name = f"slots-polled-{uuid.uuid4().hex[:6]}"

    @_slot_task(name, pool, python_base_image, accelerator="cpu", submission="worker")
    def cube(x: int) -> int:
        return x**3

    results = _map_flow(cube, 8)()
    assert [value for _, _, value in results] == [x**3 for x in range(8)], (results, worker_log.read_text()[-3000:])
    runs = _wait(lambda: (rs := _job_runs(name)) and all(r.state.is_final() for r in rs) and rs, 60, "final runs")
    assert 1 <= len(runs) <= 2 and all(SLOT_TAG in (r.tags or []) for r in runs), [(r.name, r.tags) for r in runs]
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state.name) for r in runs]
    assert len(_slot_jobs(kube, pool)) == len(runs), [j.metadata.name for j in _slot_jobs(kube, pool)]


def _pods_of(kube, job_name: str) -> list:
    return k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job_name}").items


def _stoppable_sweep(kube, gcs_bucket, local_registry, python_base_image, prefix: str, n: int):
    """A sweep of ``n`` inputs on 2 slot pods, retries=1, run in a thread: the first input a slot runs sleeps 60 s,
    the others return at once. Every body run is marked in the store; returns once the sleeper runs, with the
    sleeper's input and slot job run."""
    store_url = f"{gcs_bucket}/{prefix}-{uuid.uuid4().hex[:6]}"
    marks = "test-marks"
    pool = _slot_pool(kube, store_url, local_registry, slots=2)
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"

    @_slot_task(name, pool, python_base_image, accelerator="cpu", retries=1)
    def probe(i: int) -> int:
        import json as _json
        import os as _os
        import time as _time

        from kinetic_prefect.storage import open_store as _open

        store, slot = _open(_os.environ["KINETIC_STORE"]), _os.environ["KINETIC_FLOW_RUN_ID"]
        store.put_bytes(f"{marks}/ran-{i}-{_time.time_ns()}", slot.encode())
        if store.put_bytes(f"{marks}/first", _json.dumps([i, slot]).encode(), if_absent=True):
            _time.sleep(60)
        return i

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=_map_flow(probe, n)()), daemon=True)
    thread.start()
    from kinetic_prefect.storage import open_store

    store = open_store(store_url)
    first = _wait(lambda: store.exists(f"{marks}/first") and store.get_bytes(f"{marks}/first"), 180, "no sleeper")
    sleeper, slot_run = json.loads(first)

    def ran() -> dict[int, int]:
        counts: dict[int, int] = {}
        for key in store.list(f"{marks}/"):
            if key.rsplit("/", 1)[1].startswith("ran-"):
                i = int(key.rsplit("/", 1)[1].split("-")[1])
                counts[i] = counts.get(i, 0) + 1
        return counts

    [job] = _job_for(kube, slot_run)
    return SimpleNamespace(name=name, thread=thread, box=box, sleeper=sleeper, slot_run=slot_run, job=job, ran=ran)


def test_cancelling_a_slot_pods_run_deletes_its_job_and_ends_its_input_cancelled_the_rest_run_elsewhere(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    sweep = _stoppable_sweep(kube, gcs_bucket, local_registry, python_base_image, "slot-cancel", 4)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(sweep.slot_run), Cancelling(message="cancel this slot"), force=True)
    sweep.thread.join(120)
    assert not sweep.thread.is_alive(), "the sweep did not end after its slot was cancelled"
    states = {i: state for i, (_, state, _) in enumerate(sweep.box["value"])}
    assert states[sweep.sleeper] == "Cancelled", states  # not retried, whatever retries= says
    assert all(state == "Completed" for i, state in states.items() if i != sweep.sleeper), states
    assert sweep.ran() == dict.fromkeys(range(4), 1)  # the queued inputs ran once each, on the other slots
    _wait(lambda: not _job_for(kube, sweep.slot_run), 30, "the cancelled slot's Job was not deleted")
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(uuid.UUID(sweep.slot_run)).state.is_cancelled()


def test_a_slot_pod_deleted_ends_its_input_crashed_and_retried_and_no_other_input_is_lost_or_run_twice(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """A slot pod deleted mid-input (a node lost, a preemption), as the warm pod test deletes one: its input's
    call raises KineticJobCrashed and its retry completes; every other input ran exactly once. ≈ 24 s: a pod
    force-deleted mid-run is read as gone 15 s past its grace period (DELETED_POD_MARGIN_SECONDS)."""
    sweep = _stoppable_sweep(kube, gcs_bucket, local_registry, python_base_image, "slot-death", 6)
    [pod] = _pods_of(kube, sweep.job.metadata.name)
    k8s.CoreV1Api(kube.api()).delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
    sweep.thread.join(180)
    assert not sweep.thread.is_alive(), "the sweep did not end after its slot pod was deleted"
    results = sweep.box["value"]
    assert [(state, value) for _, state, value in results] == [("Completed", i) for i in range(6)], results
    assert sweep.ran() == {i: 2 if i == sweep.sleeper else 1 for i in range(6)}  # only the lost input ran again
    with get_client(sync_client=True) as client:
        dead = client.read_flow_run(uuid.UUID(sweep.slot_run))
    assert dead.state.is_crashed() or dead.state.is_failed(), dead.state


def _one_warm_call(pool: str, base_image: str) -> int:
    @_gke_task(f"floor-{uuid.uuid4().hex[:6]}", pool, base_image, accelerator="cpu")
    def square(x: int) -> int:
        return x * x

    @flow
    def one():
        return square(3)

    return one()


def test_floor_pods_leave_after_their_idle_limit_and_warm_down_ends_them_billing_the_pool(
    kube, gcs_bucket, local_registry, job_image, python_base_image, capsys
):
    """min_warm pods ended only by a kubectl delete, and their idle time was billed to no one. A pool's
    warm_floor_idle_seconds ends its floor pod by itself (its Job completes); `warm list --pool` shows another
    pool's floor pod (namespace/Job, floor, idle cost at the pool's price), read through the pool's cluster, and
    `warm down --pool` ends it (its Job deleted, its hand-over objects gone) and publishes its idle time as the
    pool's cost. The floor pod that left by its idle limit has its idle time published too (it was billed to no
    one). Two pod starts, ≈ 30-60 s."""
    from test_cost import events

    from kinetic_prefect.cli import main
    from kinetic_prefect.storage import open_store

    warm = {"keep_warm_seconds": 30, "min_warm": 1, "pod_watch_timeout_seconds": 60}
    limited = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke-floor-limited", local_registry, warm_floor_idle_seconds=2, **warm
    )
    prices = {"cpu": {"on_demand": 3.6, "spot": 1.2, "source": "test price sheet"}}
    kept = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke-floor", local_registry, prices=prices, **warm)

    assert _one_warm_call(limited, python_base_image) == 9
    [floor_job] = _warm_jobs(kube, limited)
    assert floor_job.metadata.labels["kinetic.prefect.io/warm-floor"] == "true"
    _wait(
        lambda: all((j.status.succeeded or 0) == 1 for j in _warm_jobs(kube, limited)),
        60,
        "the floor pod with an idle limit did not leave by itself",
    )

    assert _one_warm_call(kept, python_base_image) == 9
    [job] = _warm_jobs(kube, kept)
    time.sleep(1.5)  # idle time to bill
    capsys.readouterr()
    assert main(["warm", "list", "--pool", kept]) in (0, None)
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith(kept)]
    assert f"default/{job.metadata.name}" in row and " yes " in row and "$0.00" in row, out
    assert main(["warm", "down", "--pool", kept, "--yes"]) in (0, None)
    out = capsys.readouterr().out
    assert f"ended runner default/{job.metadata.name}" in out and "min_warm=0" in out, out
    _wait(
        lambda: job.metadata.name not in [j.metadata.name for j in _warm_jobs(kube, kept)],
        30,
        "warm down did not delete the floor pod's Job",
    )
    store = open_store(f"{gcs_bucket}/gke-floor")
    assert [k for k in store.list("warm/") if not k.startswith("warm/runs/")] == []
    with get_client(sync_client=True) as client:
        pool_id = client.read_work_pool(kept).id
    [event] = events("kinetic.work-pool.warm-idle", f"prefect.work-pool.{pool_id}", until=bool)
    payload = event["payload"]
    assert payload["accelerator"] == "cpu" and payload["usd_per_hour"] == 3.6, payload
    assert payload["minutes"] > 0.02 and payload["usd"] > 0 and payload["runner"] == f"default/{job.metadata.name}"
    assert main(["warm", "list", "--pool", limited]) in (0, None)
    assert "No warm runners." in capsys.readouterr().out
    # The floor pod that left by its idle limit bills its idle time too: it left a record in the store, and the
    # first to look with Prefect at hand (here `warm list`; a worker handing the pool a call) published it.
    with get_client(sync_client=True) as client:
        limited_id = client.read_work_pool(limited).id
    [left] = events("kinetic.work-pool.warm-idle", f"prefect.work-pool.{limited_id}", until=bool)
    payload = left["payload"]
    assert payload["floor"] is True and payload["runner"] == f"default/{floor_job.metadata.name}", payload
    assert payload["calls"] == 1 and payload["accelerator"] == "cpu" and 1.9 <= payload["minutes"] * 60 < 15, payload
    limited_store = open_store(f"{gcs_bucket}/gke-floor-limited")
    assert [k for k in limited_store.list("warm/") if not k.startswith("warm/runs/")] == []


def _a_second_call_running_on_a_warm_pod(kube, store, registry, base_image, prefix, seconds, retries=0):
    """A pool with warm pods, one call done and a second call of ``seconds`` running on the same pod (in a thread).
    The task returns its pod's warm control prefix, which names the pod's Job."""
    pool = _make_pool(_cluster_block(kube), store, registry, keep_warm_seconds=60)
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, base_image, accelerator="cpu", retries=retries)
    def step(seconds: float) -> str:
        import time as t

        print(f"step of {seconds} s", flush=True)
        t.sleep(seconds)
        return os.environ.get("KINETIC_WARM_CONTROL", "")

    @flow
    def one(seconds: float) -> str:
        return step(seconds)

    first_pod = one(0)
    [job] = _warm_jobs(kube, pool)
    thread, box = call_in_background(step, seconds)
    run = _wait(lambda: next((r for r in _job_runs(name) if not r.state.is_final()), None), 60, "no second job run")
    assert f"step of {seconds}" in _run_logs(run.id, f"step of {seconds}", timeout=60), "the second call runs"
    assert [j.metadata.name for j in _warm_jobs(kube, pool)] == [job.metadata.name], "on the same warm pod"
    return SimpleNamespace(pool=pool, name=name, first_pod=first_pod, job=job, run=run, thread=thread, box=box, one=one)


def test_cancelling_a_call_on_a_warm_pod_stops_that_pod_and_the_next_call_gets_a_new_one(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    from kinetic_prefect.errors import KineticJobCancelled

    warm = _a_second_call_running_on_a_warm_pod(
        kube, f"{gcs_bucket}/gke-warm-cancel", local_registry, python_base_image, "warm-cancel", seconds=120
    )
    pool, first_pod, job, run, thread, box, one = (
        warm.pool,
        warm.first_pod,
        warm.job,
        warm.run,
        warm.thread,
        warm.box,
        warm.one,
    )
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    thread.join(90)
    assert isinstance(box.get("error"), KineticJobCancelled), box
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run.id).state.is_cancelled()
    _wait(
        lambda: job.metadata.name not in [j.metadata.name for j in _warm_jobs(kube, pool)],
        30,
        "the stopped call's pod was not deleted",
    )
    third_pod = one(0)
    assert third_pod and third_pod != first_pod, "the next call starts a fresh pod"
    assert len(_warm_jobs(kube, pool)) == 1


@pytest.mark.timeout(600)  # run alone, it pays for the cluster and the image (minutes at a high load average)
def test_a_warm_pod_that_dies_during_a_call_fails_that_call_and_its_retry_runs_on_a_new_pod(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    """A warm pod deleted during a call (a spot node reclaimed, an eviction): that call's job run ends Failed,
    the task's retry gets a pod of its own and returns; the warm pool is not left waiting on the
    dead pod."""
    warm = _a_second_call_running_on_a_warm_pod(
        kube, f"{gcs_bucket}/gke-warm-death", local_registry, python_base_image, "warm-death", seconds=25, retries=1
    )
    name, first_pod, job, run, thread, box = warm.name, warm.first_pod, warm.job, warm.run, warm.thread, warm.box
    core = k8s.CoreV1Api(kube.api())
    [pod] = core.list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items
    core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
    thread.join(240)
    assert not thread.is_alive(), "the call did not end after its pod died"
    assert "error" not in box, box.get("error")
    assert box["value"] and box["value"] != first_pod, "the retry ran on a pod of its own"
    with get_client(sync_client=True) as client:
        dead = client.read_flow_run(run.id)
    assert dead.state.is_crashed() or dead.state.is_failed(), dead.state
    runs = sorted(_job_runs(name), key=lambda r: r.created)
    assert len(runs) == 3 and runs[-1].state.is_completed(), [(r.name, r.state.name) for r in runs]
    from kinetic_prefect.storage import open_store

    store = open_store(f"{gcs_bucket}/gke-warm-death")
    assert store.list("warm/runs/") == [], "no warm call record is left once the runs are final"
    print(f"the dead pod's call: {dead.state.name}: {dead.state.message}")
