"""A cancelled job makes its call raise, on both submission paths, as a cancelled Prefect task's result does.

The job's run is cancelled from outside (the UI or ``prefect flow-run cancel`` do the same API call) while the
flow waits for it. The code after the call must not run, the flow must not end Completed unless it caught the
error, the task run ends Cancelled and ``retries=`` does not launch a second job.
"""

from __future__ import annotations

import uuid

import pytest
from prefect import flow, get_client
from prefect.states import Cancelling
from test_lifecycle import (  # noqa: F401 - route is a fixture
    STOP_WITHIN_SECONDS,
    final_job_run,
    in_thread,
    job_runs,
    read_pid,
    route,
    seconds_until_gone,
    sleeper,
    task_run_of,
)

from kinetic_prefect.errors import KineticJobCancelled

# The session server's start (minutes at a high load average) counts in the first test's time.
pytestmark = pytest.mark.timeout(900)


def _cancel_job_of(name: str, pid_file) -> int:
    pid = read_pid(pid_file)
    [run] = job_runs(name)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(message="stop it"), force=True)
    return pid


@pytest.mark.slow
def test_a_cancelled_call_raises_and_the_flow_does_not_complete(route, tmp_path):
    pool, submission = route
    name = f"cancel-raise-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, pool, submission, retries=2)
    went_on: list[object] = []

    @flow
    def pipeline():
        value = task(str(pid_file))
        went_on.append(value)  # must not run: the call raised
        return "finished"

    thread, box = in_thread(lambda: pipeline(return_state=True))
    pid = _cancel_job_of(name, pid_file)
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS
    thread.join(90)
    state = box["value"]
    assert not went_on, f"the call returned {went_on[0]!r} and the flow carried on"
    assert not state.is_completed(), state
    assert isinstance(state.result(raise_on_failure=False), KineticJobCancelled), state
    runs = final_job_run(name)
    assert len(runs) == 1, "a retry launched a new job after the cancel"
    assert runs[0].state.is_cancelled(), runs[0].state
    assert task_run_of(runs[0]).state.is_cancelled(), task_run_of(runs[0]).state


@pytest.mark.slow
def test_a_caught_cancel_lets_the_flow_complete(route, tmp_path):
    pool, submission = route
    name = f"cancel-caught-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, pool, submission)

    @flow
    def pipeline():
        try:
            task(str(pid_file))
        except KineticJobCancelled as exc:
            return f"caught: {exc}"
        return "not cancelled"

    thread, box = in_thread(lambda: pipeline(return_state=True))
    _cancel_job_of(name, pid_file)
    thread.join(90)
    state = box["value"]
    assert state.is_completed(), state
    assert state.result().startswith("caught: Job ") and "stop it" in state.result()


def test_a_cancelled_submitted_call_raises_from_its_future(tmp_path):
    name = f"cancel-future-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, "kinetic-local", "in-process", retries=1)

    @flow
    def pipeline():
        future = task.submit(str(pid_file))
        try:
            future.result()
        except KineticJobCancelled:
            return "raised"
        return "returned"

    thread, box = in_thread(pipeline)
    _cancel_job_of(name, pid_file)
    thread.join(90)
    assert box.get("value") == "raised", box
    assert len(final_job_run(name)) == 1
