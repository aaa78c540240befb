"""kinetic-gke against a Kubernetes API emulator (kmock) whose pods run in the local Docker engine.

What is real: the official Kubernetes client speaking HTTP, the rendered Job, the image built by
DockerBuilder from the ImageSpec and pushed to a local registry, the container running the job
runner against fake-gcs-server, Prefect's server and (for cancellation/restart) a real
`prefect worker start --type kinetic-gke` process. What is not GKE: scheduling and the kubelet
(tests/k8s_emulator.py stands in for them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from background import call_in_background
from docker_fixture import proxy_files
from k8s_emulator import DockerPodController, KubeEmulator
from kubernetes import client as k8s
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
from prefect.states import Cancelling

from kinetic_prefect import kinetic_task
from kinetic_prefect.errors import KineticJobCrashed
from kinetic_prefect.workers.gke import KineticGKEWorker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, docker_engine):
    emulator = KubeEmulator(tmp_path_factory.mktemp("kube"))
    controller = DockerPodController(emulator, docker=docker_engine.cli)
    yield emulator, controller
    controller.stop()
    emulator.stop()


@pytest.fixture(scope="module")
def job_image(local_registry, python_base_image):
    """The image the worker will look for, built ahead with this machine's proxy CA (the worker then
    finds the tag in the registry and skips its own build, which is what a warm repository looks like)."""
    from kinetic_prefect.builders import DockerBuilder
    from kinetic_prefect.image import ImageSpec

    spec = ImageSpec.create(None, family="gpu", base_image=python_base_image)
    builder = DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files())
    return builder.ensure(spec, log=lambda line: None)


@pytest.fixture
def gke_pool(cluster, gcs_bucket, local_registry, job_image):
    emulator, _ = cluster
    template = KineticGKEWorker.get_default_base_job_template()
    defaults = {"kubeconfig_path": str(emulator.kubeconfig_path), "image_builder": "docker",
                "image_repository": f"{local_registry}/kinetic-tests", "store": f"{gcs_bucket}/gke",
                "poll_seconds": 0.3, "pending_timeout_seconds": 4}
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    name = f"gke-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-gke", base_job_template=template))
    return name


def _jobs(emulator: KubeEmulator):
    return k8s.BatchV1Api(emulator.api()).list_namespaced_job("default").items


def _job_runs(name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def _gke_task(name, pool, base_image, **options):
    return kinetic_task(name=name, work_pool=pool, base_image=base_image, env=["STORAGE_EMULATOR_HOST"], **options)


def test_an_l4_call_runs_as_a_job_in_the_cluster_and_returns(cluster, gke_pool, python_base_image):
    emulator, controller = cluster
    name = f"on-l4-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="l4")
    def double(x: int) -> dict:
        import socket

        print(f"hello from the pod, doubling {x}")
        return {"value": 2 * x, "accelerator": os.environ["KINETIC_ACCELERATOR"],
                "jax": os.environ["JAX_PLATFORMS"], "host": socket.gethostname()}

    @flow
    def pipeline():
        return double(21)

    result = pipeline()
    assert result["value"] == 42 and result["accelerator"] == "l4" and result["jax"] == "cuda"
    [job] = [j for j in _jobs(emulator) if j.metadata.labels.get("prefect.io/flow-run-name", "").startswith(name)]
    pod_spec = job.spec.template.spec
    assert not any(e.name == "STORAGE_EMULATOR_HOST" for e in pod_spec.containers[0].env), \
        "forwarded env values are not written into the manifest"
    [secret_ref] = pod_spec.containers[0].env_from
    secret = k8s.CoreV1Api(emulator.api()).read_namespaced_secret(secret_ref.secret_ref.name, "default")
    assert secret.metadata.owner_references[0].name == job.metadata.name, "the Secret goes with its Job"
    assert pod_spec.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert pod_spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}
    assert "/kinetic-tests/kinetic:py311-gpu-" in pod_spec.containers[0].image
    [run] = _job_runs(name)
    assert run.state.is_completed()
    with get_client(sync_client=True) as client:
        deadline = time.time() + 10
        while not any("hello from the pod, doubling 21" in log.message
                      for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))):
            assert time.time() < deadline, "the pod's log never reached the flow run's logs"
            time.sleep(0.3)


def test_a_pod_that_cannot_be_scheduled_fails_with_the_reason(cluster, gke_pool, python_base_image):
    emulator, controller = cluster
    controller.unschedulable.add("nvidia-h100-80gb")

    @_gke_task(f"no-h100-{uuid.uuid4().hex[:6]}", gke_pool, python_base_image, accelerator="h100x8")
    def big() -> int:
        return 1

    @flow
    def pipeline():
        return big()

    started = time.time()
    with pytest.raises(KineticJobCrashed, match="didn't match Pod's node affinity/selector.*no node pool has this accelerator"):
        pipeline()
    assert time.time() - started < 60, "bounded by pending_timeout_seconds, not forever"
    assert not [j for j in _jobs(emulator) if "h100" in j.metadata.labels.get("kinetic.prefect.io/accelerator", "")], \
        "the stuck Job is deleted"


def test_an_image_that_cannot_be_pulled_fails_fast(cluster, gke_pool, local_registry):
    @kinetic_task(name=f"bad-image-{uuid.uuid4().hex[:6]}", work_pool=gke_pool, accelerator="t4",
                  image=f"{local_registry}/kinetic-tests/missing:nope", env=["STORAGE_EMULATOR_HOST"])
    def never() -> int:
        return 1

    @flow
    def pipeline():
        return never()

    with pytest.raises(KineticJobCrashed, match="ErrImagePull"):
        pipeline()


@pytest.fixture
def gke_worker(gke_pool, tmp_path):
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "1"}

    def start(name: str) -> subprocess.Popen:
        log = open(log_path, "a")
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--type", "kinetic-gke",
                                 "--pool", gke_pool, "--name", name], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        with get_client(sync_client=True) as client:
            while not any(w.name == name and w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(gke_pool)):
                assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
        return proc

    procs: list[subprocess.Popen] = []
    yield lambda name: procs.append(start(name)) or procs[-1], log_path
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def _wait_for_running_container(controller, timeout=120):
    deadline = time.time() + timeout
    while not controller.running_containers():
        assert time.time() < deadline, "the job's container never started"
        time.sleep(0.3)
    return controller.running_containers()[0]


def test_cancelling_the_run_in_prefect_deletes_the_job(cluster, gke_pool, gke_worker, python_base_image):
    emulator, controller = cluster
    start_worker, worker_log = gke_worker
    start_worker("gke-worker-cancel")
    name = f"cancel-me-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, gke_pool, python_base_image, accelerator="l4")
    def sleepy() -> int:
        import time as t

        t.sleep(120)
        return 1

    thread, box = call_in_background(sleepy)
    container = _wait_for_running_container(controller)
    [run] = _job_runs(name)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    thread.join(90)
    assert not thread.is_alive(), worker_log.read_text()[-4000:]
    assert isinstance(box.get("error"), KineticJobCrashed)
    assert container not in controller.running_containers()
    assert not [j for j in _jobs(emulator) if j.metadata.labels.get("prefect.io/flow-run-id") == str(run.id)]


def test_a_restarted_worker_reattaches_without_a_duplicate_job(cluster, gke_pool, gke_worker, python_base_image):
    emulator, controller = cluster
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
    _wait_for_running_container(controller)
    first.send_signal(signal.SIGKILL)  # the worker dies mid-job; the Job keeps running in the cluster
    first.wait(10)
    start_worker("gke-worker-b")
    thread.join(120)
    assert box.get("value") == 81, box
    [run] = _job_runs(name)
    jobs = [j for j in _jobs(emulator) if j.metadata.labels.get("prefect.io/flow-run-id") == str(run.id)]
    assert len(jobs) == 1, "no duplicate Job"
    assert "Reattached to 1 running kinetic Job" in worker_log.read_text()
