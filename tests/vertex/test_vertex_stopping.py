"""kinetic-vertex stops what nobody will collect: a custom job whose in-process caller was killed stops by itself,
``kinetic-prefect jobs cancel`` stops the custom job before it says Cancelled, and a cancel during the image build
(Ctrl-C, a task timeout) stops waiting at once and cancels the build.

The first two run against the Vertex stand-in (tests/support/vertex_stand_in.py, Docker); the build ones at the
builder's boundary, with a fake Cloud Build and a fake ``docker`` that take far longer than a user waits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
from google.cloud.aiplatform_v1 import types as vertex
from prefect import get_client
from prefect.client.schemas.objects import FlowRun
from test_vertex_stand_in import (  # noqa: F401 - fixtures
    _job_runs,
    _jobs_of,
    _wait_for_output,
    _wait_until_running,
    job_image,
    stand_in,
    vertex_pool,
)

from kinetic_prefect.cli import main as cli
from kinetic_prefect.contract import RunLayout
from kinetic_prefect.shared import builders
from kinetic_prefect.workers.vertex.configuration import KineticVertexJobConfiguration
from kinetic_prefect.workers.vertex.launcher import VertexJobLauncher
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

KILLED_CALLER_SCRIPT = """
import sys
from prefect import flow
from kinetic_prefect import kinetic_task
from kinetic_prefect.workers import owner_heartbeat

NAME, POOL, BASE_IMAGE, SILENCE = sys.argv[1:5]
owner_heartbeat.SILENCE_SECONDS = float(SILENCE)  # how long the job waits on a silent caller (90 s by default)

@kinetic_task(name=NAME, work_pool=POOL, base_image=BASE_IMAGE, accelerator="l4", env=["STORAGE_EMULATOR_HOST"])
def sleeper() -> None:
    import time
    print("sleeping until the caller is killed", flush=True)
    time.sleep(600)

@flow(name=NAME + "-flow")
def pipeline():
    return sleeper()

if __name__ == "__main__":
    pipeline()
"""


def _start_and_kill_the_caller(stand_in, pool: str, base_image: str, tmp_path: Path, silence: float):
    """The script's call running on the stand-in, then the script killed with SIGKILL: (its job run, its job)."""
    name = f"killed-vertex-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "caller.py"
    script.write_text(KILLED_CALLER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), name, pool, base_image, str(silence)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        job = _wait_until_running(stand_in, name)
        _wait_for_output(stand_in, job, "sleeping until the caller is killed")
    finally:
        proc.kill()
        proc.wait(30)
    [run] = _job_runs(name)
    assert run.state.is_running(), run.state
    return run, job


def test_jobs_cancel_of_a_killed_callers_job_cancels_the_custom_job_before_it_says_cancelled(
    stand_in, vertex_pool, python_base_image, tmp_path, capsys
):
    """Slow: a fresh Python process imports Prefect and kinetic (about 5 s) and its custom job must be running on
    the stand-in before it is killed; the cancel then waits for the job's container to stop."""
    run, job = _start_and_kill_the_caller(stand_in, vertex_pool, python_base_image, tmp_path, silence=600)
    capsys.readouterr()
    assert cli(["jobs", "cancel", str(run.id)]) == 0
    said = capsys.readouterr().out
    # by the time it says Cancelled, the machine is stopped, and it says which
    assert stand_in.jobs[job.name].job.state == vertex.JobState.JOB_STATE_CANCELLED, said
    assert stand_in.containers() == [], "the custom job's container was stopped"
    assert f"Cancelled: stopped Vertex AI custom job {job.name}" in said, said
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert state.is_cancelled() and job.name in state.message, state


def test_a_killed_callers_custom_job_stops_by_itself(
    stand_in, vertex_pool, python_base_image, tmp_path, capsys, gcs_bucket
):
    """Slow: as above, then the job's runner waits out the caller's 5 s of silence before it stops."""
    from kinetic_prefect.storage import open_store

    run, job = _start_and_kill_the_caller(stand_in, vertex_pool, python_base_image, tmp_path, silence=5)
    killed = time.monotonic()
    entry = stand_in.jobs[job.name]
    while entry.job.state == vertex.JobState.JOB_STATE_RUNNING:
        assert time.monotonic() - killed < 60, "the custom job of a killed caller still runs a minute later"
        time.sleep(0.5)
    print(f"the orphaned custom job ended {time.monotonic() - killed:.1f} s after its caller was killed")
    assert stand_in.containers() == [], "its container has stopped"
    _wait_for_output(stand_in, job, "has not renewed its heartbeat")
    store = open_store(f"{gcs_bucket}/vertex")
    assert not store.exists(RunLayout(str(run.id)).payload), "nobody will collect it: the run's objects are removed"
    # the run then ends Cancelled on request, saying the job had already stopped
    capsys.readouterr()
    assert cli(["jobs", "cancel", str(run.id)]) == 0
    said = capsys.readouterr().out
    assert f"Cancelled: its Vertex AI custom job {job.name} had already ended" in said, said


# ------------------------------------------------------------------------------------- a cancel during the build


class _SlowCloudBuild:
    """Cloud Build's clients as CloudBuildBuilder uses them: no tag in the registry, a build that runs for
    ``seconds`` (far longer than anyone waits for a Ctrl-C) unless cancelled."""

    def __init__(self, seconds: float = 30.0):
        self.seconds, self.cancelled, self.started = seconds, [], None

    # the registry: nothing there yet
    def get_tag(self, name):
        from google.api_core.exceptions import NotFound

        raise NotFound(name)

    # the staging bucket: the context uploaded, the log not written yet
    def bucket(self, name):
        def download_as_bytes(start=0):
            from google.api_core.exceptions import NotFound

            raise NotFound("log")

        return SimpleNamespace(
            blob=lambda path: SimpleNamespace(
                name=path, generation=1, upload_from_string=lambda *a, **k: None, download_as_bytes=download_as_bytes
            )
        )

    # Cloud Build
    def create_build(self, request):
        self.started = time.monotonic()
        return SimpleNamespace(metadata=SimpleNamespace(build=SimpleNamespace(id="b-1", log_url="")))

    def get_build(self, request):
        ended = self.cancelled or time.monotonic() - self.started > self.seconds
        status = "CANCELLED" if self.cancelled else "FAILURE" if ended else "WORKING"
        return SimpleNamespace(id="b-1", status=SimpleNamespace(name=status), status_detail="", log_url="")

    def cancel_build(self, request):
        self.cancelled.append(request.id)


def _building_configuration(**values) -> tuple[KineticVertexJobConfiguration, FlowRun]:
    template = KineticVertexWorker.get_default_base_job_template()
    base = {"gcp_project": "proj", "region": "us-central1", "image": None, "accelerator": "cpu"}
    configuration = asyncio.run(KineticVertexJobConfiguration.from_template_and_values(template, {**base, **values}))
    flow_run = FlowRun(flow_id=uuid.uuid4(), name="brave-otter")
    configuration.prepare_for_flow_run(flow_run)
    configuration.env["KINETIC_PAYLOAD_SHA256"] = "0" * 64
    return configuration, flow_run


def _submit_cancelled_after(configuration, flow_run, seconds: float) -> float:
    """``submit`` cancelled ``seconds`` in, as a Ctrl-C or a task timeout cancels it: how long it took to return."""

    async def main() -> float:
        started = time.monotonic()
        with anyio.move_on_after(seconds):
            await VertexJobLauncher().submit(flow_run, configuration, lambda line: None)
            pytest.fail("the build was expected to outlast the cancel")
        return time.monotonic() - started

    return anyio.run(main)


@pytest.mark.no_server
def test_a_cancel_during_a_cloud_build_returns_within_seconds_and_cancels_the_build(monkeypatch):
    """Slow: the build must be under way (1 s) before the cancel."""
    slow = _SlowCloudBuild(seconds=30)
    for client in ("build_client", "registry_client", "storage_client"):
        monkeypatch.setattr(builders.CloudBuildBuilder, client, property(lambda self: slow))
    configuration, flow_run = _building_configuration(
        image_builder="cloud-build", image_repository="us-docker.pkg.dev/proj/repo", build_staging_bucket="bucket"
    )
    took = _submit_cancelled_after(configuration, flow_run, 1.0)
    assert took < 10, f"a cancel during the image build took {took:.1f} s to return"
    deadline = time.monotonic() + 10
    while not slow.cancelled:  # the abandoned build thread sees the stop within one poll
        assert time.monotonic() < deadline, "the Cloud Build was left running"
        time.sleep(0.1)
    assert slow.cancelled == ["b-1"]


@pytest.mark.no_server
def test_a_cancel_during_a_docker_build_returns_within_seconds_and_ends_the_build(monkeypatch, tmp_path):
    """Slow: the build must be under way (1 s) before the cancel."""
    pid_file = tmp_path / "build.pid"
    docker = tmp_path / "docker"
    docker.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = manifest ]; then echo "manifest unknown" >&2; exit 1; fi\n'
        f'if [ "$1" = build ]; then echo $$ > {pid_file}; exec sleep 30; fi\n'
        "exit 0\n"
    )
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    configuration, flow_run = _building_configuration(
        image_builder="docker", image_repository="registry.example.com/proj/repo"
    )
    took = _submit_cancelled_after(configuration, flow_run, 1.0)
    assert took < 10, f"a cancel during the image build took {took:.1f} s to return"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
        assert time.monotonic() < deadline, "the docker build was left running"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"
