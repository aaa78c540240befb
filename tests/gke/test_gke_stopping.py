"""kinetic-gke stops what nobody will collect: the pod of a Job whose in-process caller was killed stops by itself,
and ``kinetic-prefect jobs cancel`` deletes the Job before it says Cancelled. Against the real control plane of
tests/gke/test_gke_cluster.py (its docker kubelet runs the pods)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client as k8s
from prefect import get_client
from test_gke_cluster import _cluster_block, _job_for, _job_runs, _make_pool, _running_pod, _wait
from test_vertex_stopping import KILLED_CALLER_SCRIPT

from kinetic_prefect.cli import main as cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_image(local_registry, python_base_image):
    """The l4 call's image, built ahead with this machine's proxy CA (the worker finds it and builds nothing)."""
    from docker_fixture import proxy_files

    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    spec = ImageSpec.create(None, family="gpu", base_image=python_base_image)
    DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
        spec, log=lambda line: None
    )


@pytest.fixture
def gke_pool(kube, gcs_bucket, local_registry, job_image):
    return _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry)


def _start_and_kill_the_caller(kube, pool: str, base_image: str, tmp_path: Path, silence: float):
    """The script's call running in a pod, then the script killed with SIGKILL: (its job run, its pod)."""
    name = f"killed-gke-{uuid.uuid4().hex[:6]}"
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
        run = _wait(lambda: (_job_runs(name) or [None])[0], 120, "no job run")
        pod = _running_pod(kube, run.id)
        core = k8s.CoreV1Api(kube.api())
        _wait(
            lambda: "sleeping until the caller is killed" in core.read_namespaced_pod_log(pod.metadata.name, "default"),
            60,
            "the function never ran",
        )
    finally:
        proc.kill()
        proc.wait(30)
    [run] = _job_runs(name)
    assert not run.state.is_final(), run.state  # Pending or Running: the caller may be killed before it marks it
    return run, pod


def test_jobs_cancel_of_a_killed_callers_job_deletes_the_kubernetes_job_before_it_says_cancelled(
    kube, gke_pool, python_base_image, tmp_path, capsys
):
    """Slow: a fresh Python process imports Prefect and kinetic (about 5 s) and its pod must run before it is
    killed."""
    run, pod = _start_and_kill_the_caller(kube, gke_pool, python_base_image, tmp_path, silence=600)
    [job] = _job_for(kube, run.id)
    capsys.readouterr()
    assert cli(["jobs", "cancel", str(run.id)]) == 0
    said = capsys.readouterr().out
    # by the time it says Cancelled, the Job is deleted (its pod goes with it), and it says which
    gone = _job_for(kube, run.id)
    assert not gone or gone[0].metadata.deletion_timestamp is not None, said
    assert f"Cancelled: stopped Kubernetes Job default:{job.metadata.name}" in said, said
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert state.is_cancelled() and job.metadata.name in state.message, state


def test_a_killed_callers_pod_stops_by_itself(kube, gke_pool, python_base_image, tmp_path):
    """Slow: as above, then the job's runner waits out the caller's 5 s of silence before it stops."""
    run, pod = _start_and_kill_the_caller(kube, gke_pool, python_base_image, tmp_path, silence=5)
    killed = time.monotonic()
    core = k8s.CoreV1Api(kube.api())

    def ended() -> bool:
        return core.read_namespaced_pod(pod.metadata.name, "default").status.phase in ("Succeeded", "Failed")

    _wait(ended, 60, "the pod of a killed caller still runs a minute later")
    print(f"the orphaned pod ended {time.monotonic() - killed:.1f} s after its caller was killed")
    assert "has not renewed its heartbeat" in core.read_namespaced_pod_log(pod.metadata.name, "default")
