"""The spine end to end: @kinetic_task → child flow run in a kinetic-local pool → job process → value.

Everything here talks to the real Prefect server started by conftest; jobs are real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from job_runs import calling_task_run
from prefect import flow, get_client
from prefect.cache_policies import INPUTS
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId

from kinetic_prefect import KineticTask, kinetic_task
from kinetic_prefect.errors import PayloadError
from kinetic_prefect.shared.image import RequirementsError


class ModelDiverged(ValueError):
    """A user-defined exception type that must come back as itself."""

    def __init__(self, step: int):
        super().__init__(f"loss became NaN at step {step}")
        self.step = step


def job_runs(flow_name: str):
    """Child flow runs (the jobs) of a kinetic task, oldest first."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
    return sorted(runs, key=lambda r: r.created)


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def test_value_comes_back_from_another_process_and_the_job_is_a_nested_run():
    name = unique("square")

    @kinetic_task(name=name, accelerator="cpu")
    def square(x: int) -> dict:
        print(f"squaring {x} in the job")
        return {"value": x * x, "pid": os.getpid()}

    @flow
    def pipeline():
        return square(7)

    result = pipeline()
    assert result["value"] == 49
    assert result["pid"] != os.getpid()

    [run] = job_runs(name)
    assert run.state.is_completed()
    assert run.work_pool_name == "kinetic-local"
    assert run.parent_task_run_id is not None, "the job must be nested under the caller's task run"
    task_run = calling_task_run(run)
    assert "accelerator:cpu" in task_run.tags and task_run.state.is_completed()
    assert run.job_variables["accelerator"] == "cpu"
    assert run.job_variables["image_tag"].startswith("py")
    with get_client(sync_client=True) as client:
        deadline = time.time() + 10
        while True:  # logs reach the API in batches
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            if any("squaring 7 in the job" in log.message and log.flow_run_id == run.id for log in logs):
                break
            assert time.time() < deadline, "the job's output never reached the flow run's logs"
            time.sleep(0.3)


def test_remote_exception_type_and_traceback_come_back():
    @kinetic_task(name=unique("diverge"))
    def diverge(step: int):
        raise ModelDiverged(step)

    @flow
    def pipeline():
        return diverge(12)

    with pytest.raises(ModelDiverged) as info:
        pipeline()
    assert info.value.step == 12
    assert "loss became NaN at step 12" in str(info.value)
    remote_tb = info.value.remote_traceback
    assert "in diverge" in remote_tb and "raise ModelDiverged(step)" in remote_tb


@pytest.mark.slow
def test_a_cache_hit_launches_no_job():
    name = unique("cached")

    @kinetic_task(name=name, cache_policy=INPUTS, persist_result=True)
    def slow_square(x: int) -> int:
        return x * x

    @flow
    def pipeline(x: int):
        return slow_square(x)

    assert pipeline(5) == 25
    assert pipeline(5) == 25
    assert len(job_runs(name)) == 1, "the second call must be served from Prefect's cache"
    assert pipeline(6) == 36
    assert len(job_runs(name)) == 2


def test_a_killed_job_is_retried_by_a_new_job(tmp_path):
    name = unique("flaky")
    marker = tmp_path / "first-attempt-happened"

    @kinetic_task(name=name, retries=1, retry_delay_seconds=0)
    def flaky(marker_path: str) -> int:
        import pathlib

        if not pathlib.Path(marker_path).exists():
            pathlib.Path(marker_path).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies mid-run
        return os.getpid()

    @flow
    def pipeline():
        return flaky(str(marker))

    second_pid = pipeline()
    first_pid = int(marker.read_text())
    assert second_pid != first_pid
    runs = job_runs(name)
    assert [r.state.type.value for r in runs] == ["CRASHED", "COMPLETED"]
    assert calling_task_run(runs[0]).id == calling_task_run(runs[1]).id  # two attempts of one task run


@pytest.mark.slow
def test_submit_map_and_with_options():
    name = unique("double")

    @kinetic_task(name=name, accelerator="l4")
    def double(x: int) -> int:
        return 2 * x

    assert isinstance(double, KineticTask)
    on_tpu = double.with_options(accelerator="tpu-v6e-8", retries=3)
    assert isinstance(on_tpu, KineticTask)
    assert on_tpu.kinetic.accelerator.name == "tpu-v6e-8" and on_tpu.retries == 3
    assert "accelerator:l4" in double.tags

    @flow
    def pipeline():
        future = double.submit(10)
        mapped = double.map([1, 2, 3])
        return future.result(), [f.result() for f in mapped], on_tpu(4)

    single, mapped, renamed = pipeline()
    assert (single, mapped, renamed) == (20, [2, 4, 6], 8)
    accelerators = sorted(r.job_variables["accelerator"] for r in job_runs(name))
    # the submit and the map overlap: they ride in slots (a job run each, at most one per input), the later call
    # with other options has a job run of its own
    assert 1 <= accelerators.count("l4") <= 4 and accelerators.count("tpu-v6e-8") == 1, accelerators


def test_module_level_imports_of_the_project_work_in_the_job():
    # helpers_for_jobs is a module of this project: it is pickled by value and shipped.
    import helpers_for_jobs

    @kinetic_task(name=unique("uses-helper"))
    def uses_helper(n: int) -> list:
        return helpers_for_jobs.triangle(n)

    @flow
    def pipeline():
        return uses_helper(4)

    assert pipeline() == [1, 3, 6, 10]


@pytest.mark.slow
def test_an_unpicklable_argument_fails_before_anything_is_stored(store_dir):
    name = unique("locked")

    @kinetic_task(name=name)
    def takes_lock(lock, n: int) -> int:
        return n

    @flow
    def pipeline():
        return takes_lock(threading.Lock(), 3)

    before = set(store_dir.rglob("payload.pkl")) if store_dir.exists() else set()
    with pytest.raises(PayloadError, match=r"argument 'lock' of takes_lock\(\) \(a lock\)"):
        pipeline()
    after = set(store_dir.rglob("payload.pkl")) if store_dir.exists() else set()
    assert after == before
    assert job_runs(name) == []


def test_bad_decorator_inputs_fail_at_decoration_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="Closest valid names: l4"):
        kinetic_task(accelerator="l7", name="noop")(lambda: None)
    with pytest.raises(RequirementsError, match="does not exist"):
        kinetic_task(requirements=str(tmp_path / "missing.txt"), name="noop")(lambda: None)
    bad = tmp_path / "requirements.txt"
    bad.write_text("numpy>=1\nthis is not a requirement!!\n")
    with pytest.raises(RequirementsError, match=r"requirements.txt:2"):
        kinetic_task(requirements=str(bad), name="noop")(lambda: None)
    with pytest.raises(ValueError, match="submission"):
        kinetic_task(submission="teleport", name="noop")(lambda: None)


@pytest.mark.slow
def test_missing_forwarded_env_var_and_unknown_pool_fail_before_launch(monkeypatch):
    monkeypatch.delenv("KINETIC_TEST_TOKEN", raising=False)

    @kinetic_task(name=unique("needs-env"), env=["KINETIC_TEST_TOKEN"])
    def needs_env() -> str:
        return os.environ["KINETIC_TEST_TOKEN"]

    @kinetic_task(name=unique("pool"), work_pool="no-such-pool")
    def elsewhere() -> int:
        return 1

    @flow
    def pipeline(fn):
        return fn()

    with pytest.raises(ValueError, match="KINETIC_TEST_TOKEN.*not set"):
        pipeline(needs_env)
    with pytest.raises(LookupError, match="prefect work-pool create no-such-pool"):
        pipeline(elsewhere)


def test_forwarded_env_reaches_the_job(monkeypatch):
    monkeypatch.setenv("KINETIC_TEST_TOKEN", "s3cret")
    monkeypatch.setenv("WANDB_PROJECT", "land-cover")

    @kinetic_task(name=unique("reads-env"), env=["KINETIC_TEST_TOKEN", "WANDB_*"])
    def reads_env() -> tuple:
        return os.environ.get("KINETIC_TEST_TOKEN"), os.environ.get("WANDB_PROJECT"), os.environ["KINETIC_ACCELERATOR"]

    @flow
    def pipeline():
        return reads_env()

    assert pipeline() == ("s3cret", "land-cover", "cpu")
    [run] = job_runs(reads_env.name)
    assert "s3cret" not in json.dumps(run.job_variables), "forwarded values are handed over in memory, not stored"


def test_without_the_project_shipped_a_project_import_fails_in_the_job():
    @kinetic_task(name=unique("unimportable"), ship_project=False)
    def needs_module() -> int:
        import helpers_for_jobs

        return helpers_for_jobs.triangle(1)[0]

    @flow
    def pipeline():
        return needs_module()

    with pytest.raises(ModuleNotFoundError, match="helpers_for_jobs") as info:
        pipeline()
    assert "requirements=" not in str(info.value), "a module of the project is shipped, not installed"


def test_a_module_the_jobs_environment_lacks_names_requirements():
    @kinetic_task(name=unique("no-such-module"))
    def needs_package() -> int:
        import kinetic_no_such_package_xyz  # noqa: F401

        return 1

    @flow
    def pipeline():
        return needs_package()

    with pytest.raises(ModuleNotFoundError) as info:
        pipeline()
    assert str(info.value).splitlines() == [
        "No module named 'kinetic_no_such_package_xyz'",
        "the job's environment has no module 'kinetic_no_such_package_xyz': add it to requirements= of @kinetic_task "
        "(or the pool's requirements)",
    ]
    assert info.value.name == "kinetic_no_such_package_xyz"


def test_runner_reports_payload_tampering(tmp_path):
    from kinetic_prefect.storage import open_store

    store = open_store(tmp_path / "store")
    store.put_bytes("runs/r1/payload.pkl", b"not what was hashed")
    env = {
        **os.environ,
        "KINETIC_STORE": str(tmp_path / "store"),
        "KINETIC_RUN_PREFIX": "runs/r1",
        "KINETIC_PAYLOAD_SHA256": "0" * 64,
    }
    proc = subprocess.run([sys.executable, "-m", "kinetic_prefect.pod.runner"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    import json

    outcome = json.loads(store.get_bytes("runs/r1/outcome.json"))
    assert outcome["status"] == "failed" and outcome["phase"] == "verifying the payload"
    assert "sha256 mismatch" in outcome["message"]


def test_the_job_runner_does_not_import_prefect():
    code = "import kinetic_prefect.pod.runner, sys; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "job_variables,culprit",
    [
        ({"keep_warm_secnds": 5}, r"no variable 'keep_warm_secnds'; did you mean 'keep_warm_seconds'\?"),
        ({"keep_warm_seconds": "abc"}, r"job_variables\['keep_warm_seconds'\]='abc': .*number"),
    ],
    ids=["typo", "wrong-type"],
)
def test_a_job_variable_the_pool_cannot_take_fails_before_anything_runs(job_variables, culprit):
    """A typo was ignored (the template has no such variable) and a value of the wrong type failed in the worker
    as a raw validation error, the run "Cancelled: the calling task stopped waiting". Both fail before upload."""
    name = f"bad-variable-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, job_variables=job_variables)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(ValueError, match=culprit):
        pipeline()
    assert job_runs(name) == []
