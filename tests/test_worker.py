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


@pytest.fixture
def polling_worker(tmp_path):
    pool = f"polling-{uuid.uuid4().hex[:6]}"
    _cli("work-pool", "create", pool, "--type", "kinetic-local")
    log = open(tmp_path / "worker.log", "w")
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    proc = subprocess.Popen([*PREFECT, "worker", "start", "--type", "kinetic-local", "--pool", pool,
                             "--name", f"{pool}-worker"], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 60
    with get_client(sync_client=True) as client:
        while not any(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.time() < deadline, "worker never came online"
            time.sleep(0.5)
    yield pool, tmp_path / "worker.log"
    proc.terminate()
    proc.wait(30)
    log.close()


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
        assert not [b for b in client.read_block_documents() if b.name.startswith("kinetic-env-")], \
            "the worker deletes the Secret block once read"
    assert run.infrastructure_pid, "the polling worker records the job's pid"
    with get_client(sync_client=True) as client:
        worker_pids = {w.name for w in client.read_workers_for_work_pool(pool)}
    assert f"{pool}-worker" in worker_pids
    deadline = time.time() + 10
    while "hello from the job for polling" not in worker_log.read_text():
        assert time.time() < deadline, worker_log.read_text()[-2000:]
        time.sleep(0.2)


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


def test_cancelling_a_running_local_job_stops_its_process(polling_worker, tmp_path):
    from background import call_in_background
    from prefect.states import Cancelling

    from kinetic_prefect.errors import KineticJobCrashed

    pool, _ = polling_worker
    name = f"cancel-local-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "job.pid"

    @kinetic_task(name=name, work_pool=pool)
    def sleepy(pid_path: str) -> int:
        import pathlib
        import time as t

        pathlib.Path(pid_path).write_text(str(os.getpid()))
        t.sleep(300)
        return 1

    thread, box = call_in_background(sleepy, str(pid_file))
    deadline = time.time() + 60
    while not pid_file.exists():
        assert time.time() < deadline, "the job never started"
        time.sleep(0.2)
    job_pid = int(pid_file.read_text())
    [run] = _runs(name)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    thread.join(60)
    assert isinstance(box.get("error"), KineticJobCrashed) and "Cancelled" in str(box["error"])
    with pytest.raises(ProcessLookupError):
        os.kill(job_pid, 0)
    [run] = _runs(name)
    assert run.state.is_cancelled()
