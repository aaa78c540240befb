"""The kinetic-local worker as Prefect sees it: entry-point registration, the CLI, a polling worker
process, and hash-keyed environments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task
from kinetic_prefect.config import work_pools_dir

PREFECT = [sys.executable, "-m", "prefect"]


def _cli(*args: str) -> str:
    proc = subprocess.run([*PREFECT, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _runs(flow_name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))


def test_worker_type_is_registered_through_the_entry_point():
    # A fresh interpreter: only the prefect.collections entry point can make the type known.
    template = json.loads(_cli("work-pool", "get-default-base-job-template", "--type", "kinetic-local"))
    assert template == json.loads((work_pools_dir() / "kinetic-local.json").read_text())
    assert {"accelerator", "requirements", "store", "env"} <= set(template["variables"]["properties"])


@pytest.mark.slow
def test_a_polling_worker_process_runs_the_job(polling_worker):
    pool, worker_log = polling_worker
    name = f"via-worker-{uuid.uuid4().hex[:6]}"

    os.environ["KINETIC_TEST_SECRET"] = "hunter2"

    @kinetic_task(name=name, work_pool=pool, env=["KINETIC_TEST_SECRET"])  # auto: a worker is online, so it is used
    def where_am_i(tag: str) -> dict:
        print(f"hello from the job for {tag}")
        return {"tag": tag, "pid": os.getpid(), "secret": os.environ.get("KINETIC_TEST_SECRET")}

    @flow
    def pipeline():
        return where_am_i("polling")

    result = pipeline()
    del os.environ["KINETIC_TEST_SECRET"]
    assert result["tag"] == "polling" and result["pid"] != os.getpid()
    assert result["secret"] == "hunter2", "forwarded through a Secret block to the polling worker"
    [run] = _runs(name)
    assert run.state.is_completed()
    assert "hunter2" not in json.dumps(run.job_variables)
    with get_client(sync_client=True) as client:
        assert not [b for b in client.read_block_documents() if b.name.startswith("kinetic-env-")], (
            "the worker deletes the Secret block once read"
        )
    assert run.infrastructure_pid, "the polling worker records the job's pid"
    with get_client(sync_client=True) as client:
        worker_pids = {w.name for w in client.read_workers_for_work_pool(pool)}
    assert f"{pool}-worker" in worker_pids
    deadline = time.time() + 10
    while "hello from the job for polling" not in worker_log.read_text():
        assert time.time() < deadline, worker_log.read_text()[-2000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_requirements_build_a_hash_keyed_environment_once(tmp_path, capsys):
    name = f"with-reqs-{uuid.uuid4().hex[:6]}"
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# the job's own packages\nsix==1.16.0\n")

    @kinetic_task(name=name, requirements=str(reqs))
    def uses_six() -> tuple:
        import six

        return six.__version__, sys.executable

    @flow
    def pipeline():
        return uses_six(), uses_six()

    (version, python), (version2, python2) = pipeline()
    assert version == version2 == "1.16.0"
    assert python == python2 and python != sys.executable
    assert uses_six.kinetic.image_spec.tag in python, "the environment is keyed by the ImageSpec tag"
    env_dir = Path(python).parent.parent
    built_at = (env_dir / ".kinetic-complete").stat().st_mtime_ns

    @flow
    def again():
        return uses_six()

    assert again()[0] == "1.16.0"
    assert (env_dir / ".kinetic-complete").stat().st_mtime_ns == built_at, "nothing changed: no rebuild"
    out = capsys.readouterr()
    assert (out.out + out.err).count("Building job environment") <= 1
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        builds = [
            a
            for run in _runs(name)
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
            )
            if a.type == "progress"
        ]
    assert len(builds) == 1 and builds[0].data == 100.0 and "ready" in builds[0].description, builds


def test_a_gpu_task_on_the_local_pool_runs_on_the_cpu_with_one_warning(caplog):
    """`accelerator="l4"` on kinetic-local (e.g. the shipped weekly schedule) must not crash JAX."""
    name = f"l4-local-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator="l4")
    def which_device() -> str:
        import jax

        return jax.devices()[0].platform

    @flow
    def pipeline():
        return which_device()

    with caplog.at_level("INFO"):
        assert pipeline() == "cpu"
    warnings = [r.getMessage() for r in caplog.records if "accelerator 'l4' is not on this machine" in r.getMessage()]
    assert len(warnings) == 1, warnings


@pytest.mark.slow
def test_a_kinetic_pool_refuses_a_flow_run_that_is_not_a_job(polling_worker):
    """A deployment's flow run sent to a kinetic pool fails at once, saying which pool type runs flows."""
    from types import SimpleNamespace

    from prefect.states import Scheduled

    pool, _ = polling_worker
    flow_record = SimpleNamespace(name=f"a-flow-{uuid.uuid4().hex[:6]}", version=None, retries=0, retry_delay_seconds=0)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(flow_record, state=Scheduled(), work_pool_name=pool)
        deadline = time.time() + 60
        while not (state := client.read_flow_run(run.id).state).is_final():
            assert time.time() < deadline, "the kinetic worker never answered"
            time.sleep(0.5)
    assert state.is_failed() and "not flows" in state.message and "--type process" in state.message, state
