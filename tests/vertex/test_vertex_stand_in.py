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


def _wait_until_running(stand_in: VertexStandIn, name: str, timeout: float = 120) -> vertex.CustomJob:
    """The call's custom job, once the stand-in runs its container."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = _job_runs(name)
        jobs = _jobs_of(stand_in, runs[0].id) if runs else []
        if jobs and jobs[0].state == vertex.JobState.JOB_STATE_RUNNING:
            return jobs[0]
        time.sleep(0.3)
    pytest.fail(f"the custom job of {name} never ran")


def _wait_for_output(stand_in: VertexStandIn, job: vertex.CustomJob, text: str, timeout: float = 60) -> None:
    """Until the job's container has printed ``text`` (read as the stand-in's Cloud Logging serves it)."""
    job_id = job.name.rsplit("/", 1)[-1]
    deadline = time.time() + timeout
    query = {"filter": f'resource.labels.job_id="{job_id}"'}
    while not any(text in e["textPayload"] for e in stand_in.entries(query)["entries"]):
        assert time.time() < deadline, f"the job never printed {text!r}"
        time.sleep(0.3)


def _final_job_run(name: str, timeout: float = 30):
    deadline = time.time() + timeout
    while True:
        runs = _job_runs(name)
        if runs and all(r.state is not None and r.state.is_final() for r in runs):
            return runs
        assert time.time() < deadline, [(r.name, r.state) for r in runs]
        time.sleep(0.3)


def test_a_task_timeout_cancels_the_custom_job_and_the_task_run_ends_timed_out(
    stand_in, vertex_pool, python_base_image
):
    """Slow: the job must be running when the task's 8 s timeout fires (image found in the registry, about 3 s
    to a running container on the stand-in), then the cancel waits for the container to stop."""
    from job_runs import calling_task_run

    name = f"timeout-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4", timeout_seconds=8)
    def sleeper() -> None:
        print("sleeping past the task's timeout", flush=True)
        time.sleep(600)

    @flow
    def pipeline():
        return sleeper()

    import threading

    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("error", _call(pipeline)), daemon=True)
    thread.start()
    job = _wait_until_running(stand_in, name)
    thread.join(120)
    assert isinstance(outcome.get("error"), TimeoutError), outcome
    [job] = _jobs_of(stand_in, _job_runs(name)[0].id)
    assert job.state == vertex.JobState.JOB_STATE_CANCELLED, job.state
    assert stand_in.containers() == [], "the job's container was stopped"
    [run] = _final_job_run(name)
    assert run.state.is_cancelled(), run.state
    assert calling_task_run(run).state.name == "TimedOut"


CALLER_SCRIPT = """
import sys
from prefect import flow
from kinetic_prefect import kinetic_task

NAME, POOL, BASE_IMAGE = sys.argv[1:4]

@kinetic_task(name=NAME, work_pool=POOL, base_image=BASE_IMAGE, accelerator="l4", env=["STORAGE_EMULATOR_HOST"])
def sleeper() -> None:
    import time
    print("sleeping until interrupted", flush=True)
    time.sleep(600)

@flow(name=NAME + "-flow")
def pipeline():
    return sleeper()

if __name__ == "__main__":
    pipeline()
"""


def test_ctrl_c_of_the_calling_script_cancels_the_custom_job(stand_in, vertex_pool, python_base_image, tmp_path):
    """Slow: a fresh Python process imports Prefect and kinetic (about 5 s), its job's function must be running
    before the SIGINT, and the script exits only after the cancelled job's container has stopped."""
    from job_runs import calling_task_run
    from test_lifecycle import _as_from_a_terminal

    name = f"interrupt-vertex-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "caller.py"
    script.write_text(CALLER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), name, vertex_pool, python_base_image],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        # Ctrl-C once the function runs, as a user who saw its output would (a runner still starting has no SIGTERM
        # handler yet and, as the container's PID 1, would sit out docker stop's 10 s grace)
        _wait_for_output(stand_in, _wait_until_running(stand_in, name), "sleeping until interrupted")
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode != 0, output[-3000:]
    [job] = _jobs_of(stand_in, _job_runs(name)[0].id)
    assert job.state == vertex.JobState.JOB_STATE_CANCELLED, (job.state, output[-3000:])
    assert stand_in.containers() == [], "the job's container was stopped"
    [run] = _final_job_run(name)
    assert run.state.is_cancelled(), run.state
    assert not calling_task_run(run).state.is_completed()


def test_a_retry_resumes_from_the_checkpoint_the_failed_attempt_saved(stand_in, vertex_pool, python_base_image):
    """Slow: two custom jobs, one per attempt (each its own container, so the second finds the checkpoint only
    in the store), about 3 s each on the stand-in."""
    from job_runs import calling_task_run

    name = f"resume-vertex-{uuid.uuid4().hex[:6]}"

    @_task(name, vertex_pool, python_base_image, accelerator="l4", retries=1)
    def fragile() -> str:
        from pathlib import Path

        checkpoint = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "progress.txt"
        if checkpoint.exists():
            return f"resumed from {checkpoint.read_text()}"
        checkpoint.write_text("epoch 1")  # saved to the store as the failed attempt ends
        raise RuntimeError("the first attempt fails after its checkpoint")

    @flow
    def pipeline():
        return fragile()

    assert pipeline() == "resumed from epoch 1"
    first, second = sorted(_job_runs(name), key=lambda r: r.created)
    assert first.state.is_failed() and second.state.is_completed(), [
        (r.state.name, r.state.message) for r in (first, second)
    ]
    [first_job] = _jobs_of(stand_in, first.id)
    [second_job] = _jobs_of(stand_in, second.id)
    # The runner recorded the function's error as the first attempt's outcome and exited 0 (EXIT_OUTCOME_RECORDED),
    # so its custom job succeeded as a GKE Job completes; the failure is the run's, which Prefect shows.
    assert first_job.state == vertex.JobState.JOB_STATE_SUCCEEDED
    assert "the first attempt fails after its checkpoint" in first.state.message, first.state.message
    assert second_job.state == vertex.JobState.JOB_STATE_SUCCEEDED
    task_run = calling_task_run(second)
    assert task_run.state.is_completed() and task_run.run_count == 2, (task_run.state, task_run.run_count)
