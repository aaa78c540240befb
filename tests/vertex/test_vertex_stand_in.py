"""kinetic-vertex end to end against the Vertex stand-in (tests/support/vertex_stand_in.py): the worker (in-process
submission), the real google-cloud-aiplatform JobServiceClient over REST, the hash-tagged image DockerBuilder makes
and pushes to the local registry, the job runner in that image against fake-gcs-server, and Prefect's server.
Not Vertex: the stand-in runs each replica in Docker and serves its output as Cloud Logging entries."""

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
from google.cloud.aiplatform_v1 import types as vertex
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
from vertex_stand_in import VertexStandIn
from worker_fixture import stop_worker_process

from kinetic_prefect import kinetic_task
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_image(local_registry, python_base_image):
    """The images the worker looks for, built ahead with this machine's proxy CA (the worker finds the tag in the
    registry and skips its own build, which is what a warm repository looks like)."""
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    for family in ("gpu",):
        spec = ImageSpec.create(None, family=family, base_image=python_base_image)
        DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
            spec, log=lambda line: None
        )


@pytest.fixture(scope="module")
def stand_in(docker_engine):
    service = VertexStandIn(docker_engine.cli)
    yield service
    service.stop()


def _make_pool(stand_in: VertexStandIn, store: str, registry: str, **more) -> str:
    template = KineticVertexWorker.get_default_base_job_template()
    defaults = {
        "api_endpoint": stand_in.endpoint,
        "logging_endpoint": stand_in.endpoint,
        "gcp_project": stand_in.project,
        "image_builder": "docker",
        "image_repository": f"{registry}/kinetic-tests",
        "store": store,
        "poll_seconds": 0.3,
        **more,
    }
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    name = f"vertex-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-vertex", base_job_template=template))
    return name


@pytest.fixture
def vertex_pool(stand_in, gcs_bucket, local_registry, job_image):
    return _make_pool(stand_in, f"{gcs_bucket}/vertex", local_registry)


def _task(name, pool, base_image, **options):
    return kinetic_task(name=name, work_pool=pool, base_image=base_image, env=["STORAGE_EMULATOR_HOST"], **options)


def _job_runs(name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def _run_logs(run_id, wanted: str, timeout: float = 20) -> str:
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


def _jobs_of(stand_in: VertexStandIn, run_id) -> list[vertex.CustomJob]:
    return [e.job for e in stand_in.jobs.values() if e.job.labels.get("kinetic-flow-run") == str(run_id)]


def test_an_l4_call_runs_as_a_custom_job_on_a_g2_with_an_l4_and_returns(stand_in, vertex_pool, python_base_image):
    name = f"hello-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4")
    def double(x: int) -> dict:
        print(f"hello from the custom job, doubling {x}")
        return {"value": 2 * x, "accelerator": os.environ["KINETIC_ACCELERATOR"], "jax": os.environ["JAX_PLATFORMS"]}

    @flow
    def pipeline():
        return double(21)

    started = time.perf_counter()
    result = pipeline()
    print(f"kinetic-vertex call on the stand-in: {time.perf_counter() - started:.2f} s")
    assert result == {"value": 42, "accelerator": "l4", "jax": "cuda"}
    [run] = _job_runs(name)
    assert run.state.is_completed()
    [job] = _jobs_of(stand_in, run.id)
    assert job.state == vertex.JobState.JOB_STATE_SUCCEEDED
    machine = job.job_spec.worker_pool_specs[0].machine_spec
    assert (machine.machine_type, machine.accelerator_type, machine.accelerator_count) == (
        "g2-standard-8",
        vertex.AcceleratorType.NVIDIA_L4,
        1,
    )
    env = {e.name for e in job.job_spec.worker_pool_specs[0].container_spec.env}
    assert not {"PREFECT_API_KEY", "PREFECT_API_URL"} & env
    # the job's output came from the (stand-in's) Cloud Logging into the job run's logs
    assert "hello from the custom job, doubling 21" in _run_logs(run.id, "hello from the custom job")
    assert stand_in.containers() == [], "the job's container has ended"


def test_cancelling_the_run_cancels_the_custom_job(stand_in, vertex_pool, python_base_image):
    from prefect.states import Cancelling

    name = f"cancel-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4")
    def sleeper() -> None:
        print("sleeping", flush=True)
        time.sleep(600)

    @flow
    def pipeline():
        return sleeper()

    import threading

    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("error", _call(pipeline)), daemon=True)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = _job_runs(name)
        jobs = _jobs_of(stand_in, runs[0].id) if runs else []
        if jobs and jobs[0].state == vertex.JobState.JOB_STATE_RUNNING:
            break
        time.sleep(0.3)
    else:
        pytest.fail("the custom job never ran")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(runs[0].id, Cancelling(), force=True)
    thread.join(120)
    [job] = _jobs_of(stand_in, runs[0].id)
    assert job.state == vertex.JobState.JOB_STATE_CANCELLED
    assert stand_in.containers() == []
    [run] = _job_runs(name)
    assert run.state.is_cancelled(), run.state
    assert outcome["error"] is not None, "the call raised"


def test_a_preempted_spot_job_is_retried_and_the_call_returns(stand_in, vertex_pool, python_base_image):
    name = f"spot-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4:spot")
    def patient() -> str:
        if os.environ.get("KINETIC_PREEMPTIONS", "0") == "0":
            print("first attempt: waiting to be preempted", flush=True)
            time.sleep(600)
        return f"done after {os.environ['KINETIC_PREEMPTIONS']} preemption(s)"

    @flow
    def pipeline():
        return patient(return_state=True)

    import threading

    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("state", _call(pipeline)), daemon=True)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = _job_runs(name)
        jobs = _jobs_of(stand_in, runs[0].id) if runs else []
        if jobs and jobs[0].state == vertex.JobState.JOB_STATE_RUNNING:
            break
        time.sleep(0.3)
    else:
        pytest.fail("the spot job never ran")
    assert jobs[0].job_spec.scheduling.strategy == vertex.Scheduling.Strategy.SPOT
    stand_in.preempt(jobs[0].name)
    thread.join(180)
    assert outcome["state"].result() == "done after 1 preemption(s)"
    assert "preempted 1×" in outcome["state"].message, "counted as a preemption, and the task's retries not spent"
    first, second = sorted(_jobs_of(stand_in, runs[0].id), key=lambda j: j.create_time)
    assert first.state == vertex.JobState.JOB_STATE_FAILED and "preempted" in first.error.message
    assert second.state == vertex.JobState.JOB_STATE_SUCCEEDED
    [run] = _job_runs(name)
    assert run.state.is_completed()


def _call(pipeline):
    try:
        return pipeline()
    except BaseException as exc:  # the cancelled call raises; the test reads what it raised
        return exc


def test_a_stocked_out_accelerator_falls_back_to_the_next_entry_of_the_list(stand_in, vertex_pool, python_base_image):
    name = f"fallback-vertex-{uuid.uuid4().hex[:6]}"
    stand_in.stock_out.add("NVIDIA_L4")
    try:

        @_task(name, vertex_pool, python_base_image, accelerator=["l4", "t4"])
        def where() -> str:
            return os.environ["KINETIC_ACCELERATOR"]

        @flow
        def pipeline():
            return where(return_state=True)

        state = pipeline()
        assert state.result() == "t4"
        assert state.message.startswith("ran on t4; after l4"), state.message
    finally:
        stand_in.stock_out.discard("NVIDIA_L4")
    [run] = _job_runs(name)
    first, second = sorted(_jobs_of(stand_in, run.id), key=lambda j: j.create_time)
    assert first.job_spec.worker_pool_specs[0].machine_spec.accelerator_type == vertex.AcceleratorType.NVIDIA_L4
    assert "does not have enough resources" in first.error.message and not first.start_time
    assert second.job_spec.worker_pool_specs[0].machine_spec.accelerator_type == vertex.AcceleratorType.NVIDIA_TESLA_T4
    assert second.state == vertex.JobState.JOB_STATE_SUCCEEDED


def test_two_hosts_are_two_replica_pools_forming_one_group(stand_in, vertex_pool, python_base_image):
    name = f"group-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4", hosts=2)
    def member() -> dict:
        print(f"host {os.environ['KINETIC_HOST_INDEX']} of {os.environ['KINETIC_NUM_HOSTS']}", flush=True)
        return {k: os.environ[k] for k in ("KINETIC_HOST_INDEX", "KINETIC_NUM_HOSTS", "KINETIC_COORDINATOR_ADDRESS")}

    @flow
    def pipeline():
        return member()

    value = pipeline()
    assert value == {
        "KINETIC_HOST_INDEX": "0",
        "KINETIC_NUM_HOSTS": "2",
        "KINETIC_COORDINATOR_ADDRESS": "127.0.0.1:8476",
    }
    [run] = _job_runs(name)
    [job] = _jobs_of(stand_in, run.id)
    assert [p.replica_count for p in job.job_spec.worker_pool_specs] == [1, 1]
    assert job.state == vertex.JobState.JOB_STATE_SUCCEEDED
    assert "[host 1] host 1 of 2" in _run_logs(run.id, "[host 1] host 1 of 2"), "host 1 ran, and its lines are tagged"


@pytest.fixture
def vertex_worker(vertex_pool, tmp_path):
    """``prefect worker start --type kinetic-vertex`` processes for the pool; their output in one log."""
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_CANCELLATION_POLL_SECONDS": "1"}
    procs: list[subprocess.Popen] = []

    def start(name: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "prefect", "worker", "start", "--type", "kinetic-vertex", "--pool", vertex_pool]
        with open(log_path, "a") as log:
            proc = subprocess.Popen([*argv, "--name", name], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        with get_client(sync_client=True) as client:
            while not any(
                w.name == name and w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(vertex_pool)
            ):
                assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
        procs.append(proc)
        return proc

    yield start, log_path
    for proc in procs:
        stop_worker_process(proc)


def test_a_restarted_worker_reattaches_to_its_custom_job_without_a_duplicate(
    stand_in, vertex_pool, vertex_worker, python_base_image
):
    start_worker, worker_log = vertex_worker
    first = start_worker("vertex-worker-a")
    name = f"survives-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4")
    def slow_square(x: int) -> int:
        time.sleep(8)
        print("finished after the worker came back", flush=True)
        return x * x

    thread, box = call_in_background(slow_square, 9)
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = _job_runs(name)
        jobs = _jobs_of(stand_in, runs[0].id) if runs else []
        if jobs and jobs[0].state == vertex.JobState.JOB_STATE_RUNNING:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"the custom job never ran: {worker_log.read_text()[-3000:]}")
    first.send_signal(signal.SIGKILL)  # the worker dies mid-job; the custom job keeps running
    first.wait(10)
    start_worker("vertex-worker-b")
    thread.join(120)
    assert box.get("value") == 81, (box, worker_log.read_text()[-3000:])
    assert len(_jobs_of(stand_in, runs[0].id)) == 1, "no duplicate custom job"
    assert "Reattached to 1 Vertex AI custom job(s)" in worker_log.read_text()
