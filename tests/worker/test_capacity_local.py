"""Capacity on kinetic-local, end to end (a real Prefect server, real job processes): a SIGTERM from outside the
worker is a preemption (retried under the same run from ``preemption_retries``, resuming from the checkpoint, the
task's ``retries`` untouched); a body that raises is not; a fallback list runs the first accelerator the machine
has."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from job_runs import jobs_of
from prefect import flow, get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

from kinetic_prefect import kinetic_task
from kinetic_prefect.errors import KineticJobCrashed

STEPS = 12


def train(pid_file: str) -> dict:
    """Counts steps, saving the step reached in its checkpoint dir each time (what a training loop does)."""
    import json
    import os
    import time
    from pathlib import Path

    checkpoint = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "step.txt"
    start = int(checkpoint.read_text()) if checkpoint.exists() else 0
    Path(pid_file).write_text(f"{os.getpid()} {start}")
    for step in range(start, STEPS):
        time.sleep(0.25)
        checkpoint.write_text(str(step + 1))
        print("[kinetic:progress] " + json.dumps({"done": step + 1, "total": STEPS}), flush=True)
    return {
        "start": start,
        "accelerator": os.environ["KINETIC_ACCELERATOR"],
        "chips": os.environ["KINETIC_ACCELERATOR_CHIPS"],
        "preemptions": os.environ["KINETIC_PREEMPTIONS"],
    }


def _preempt_when_running(pid_file: Path, min_step_seconds: float = 1.5) -> None:
    """SIGTERM the first attempt's process from outside the worker, as a shutting-down machine would."""
    deadline = time.time() + 120
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.time() < deadline, "the job never started"
        time.sleep(0.1)
    time.sleep(min_step_seconds)  # a few steps in (and checkpointed)
    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)


def _task_artifacts(task_run_id):
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id]))
        )


@pytest.mark.slow
def test_sigterm_from_outside_is_a_preemption_retried_without_spending_retries(tmp_path):
    import threading

    from test_cost import JOB_COST_ARTIFACT_KEY, priced_pool, table
    from test_cost import artifacts as run_artifacts

    pid_file = tmp_path / "pid"
    body = kinetic_task(
        train, name=f"preempt-{tmp_path.name[-6:]}", retries=0, ship_project=False, work_pool=priced_pool()
    )

    @flow
    def pipeline():
        return body(str(pid_file), return_state=True)

    killer = threading.Thread(target=_preempt_when_running, args=(pid_file,), daemon=True)
    killer.start()
    state = pipeline()
    value = state.result()
    assert value["start"] > 0, value  # resumed from its checkpoint, not from step 0
    assert value["preemptions"] == "1" and value["accelerator"] == "cpu" and value["chips"] == "0"
    assert state.is_completed() and "preempted 1×, resumed from step" in (state.message or ""), state.message
    task_run_id = state.state_details.task_run_id
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(task_run_id)
    assert task_run.run_count == 1  # retries=0 and it still finished: the preemption did not spend it
    [job] = jobs_of(task_run_id)  # one job run: the attempt was repeated under it
    assert job.state.is_completed() and "preempted 1×" in job.state.message, job.state.message
    artifacts = [a for a in _task_artifacts(task_run_id) if a.type == "table" and "Capacity" in (a.description or "")]
    assert artifacts and "preempted" in artifacts[0].data
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    with get_client(sync_client=True) as client:
        events = client.read_events(
            EventFilter(
                event=EventNameFilter(name=["kinetic.job.preempted"]),
                resource=EventResourceFilter(id=[f"prefect.flow-run.{job.id}"]),
            ),
            limit=50,
        ).events
    [event] = events
    assert event.payload["preemptions"] == 1 and event.payload["resumed_from"].startswith("step ")
    # the preempted attempt was paid for: the run's cost lists both attempts and is their sum
    total, *tried = table(run_artifacts(job.id, JOB_COST_ARTIFACT_KEY)[-1])
    assert total["attempts"] == 2 and [a["ended"].split(":")[0] for a in tried] == ["preempted", ""], tried
    assert all(a["minutes"] > 0 and a["usd"] > 0 for a in tried), tried
    assert total["usd"] == pytest.approx(sum(a["usd"] for a in tried), abs=1e-5)
    assert total["minutes"] == pytest.approx(sum(a["minutes"] for a in tried), abs=1e-3)


@pytest.mark.slow
def test_a_preempted_warm_call_is_relaunched_once_and_not_run_twice(tmp_path):
    """On a pool that keeps runners warm (keep_warm_seconds=60, min_warm=1), a SIGTERM of the body's process from
    outside: the relaunched attempt read the earlier attempt's exit status and counted as finished, so the run was
    marked Crashed while the relaunched process went on, and `retries=1` then started a second copy beside it. One
    relaunch under the same run, resumed from the checkpoint, `retries` untouched, one job run, Completed. ≈ 16 s:
    the body's 12 steps of 0.25 s, run a second time in part after the preemption."""
    import threading

    from worker_fixture import new_pool

    pid_file = tmp_path / "pid"
    body = kinetic_task(
        train,
        name=f"warm-preempt-{tmp_path.name[-6:]}",
        work_pool=new_pool("warm"),
        retries=1,
        ship_project=False,
        job_variables={"keep_warm_seconds": 60, "min_warm": 1},
    )

    @flow
    def pipeline():
        return body(str(pid_file), return_state=True)

    killer = threading.Thread(target=_preempt_when_running, args=(pid_file,), daemon=True)
    killer.start()
    state = pipeline()
    value = state.result()
    assert value["start"] > 0 and value["preemptions"] == "1", value
    assert state.is_completed() and "preempted 1×" in (state.message or ""), state.message
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(state.state_details.task_run_id)
    assert task_run.run_count == 1, "the preemption spent a retry"
    [job] = jobs_of(task_run.id)
    assert job.state.is_completed(), job.state


def test_a_spent_preemption_budget_crashes_the_run_naming_it(tmp_path):
    import threading

    pid_file = tmp_path / "pid"
    name = f"spent-{tmp_path.name[-6:]}"
    body = kinetic_task(train, name=name, preemption_retries=0, ship_project=False)

    @flow
    def pipeline():
        return body(str(pid_file))

    threading.Thread(target=_preempt_when_running, args=(pid_file, 0.5), daemon=True).start()
    with pytest.raises(KineticJobCrashed, match=r"preempted 1× \(preemption_retries=0 spent\)"):
        pipeline()
    [job] = _job_runs(name)
    assert job.state.is_crashed()


def raises(pid_file: str) -> None:
    raise ValueError("the body's own bug")


def _job_runs(name: str):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def test_a_body_that_raises_is_not_a_preemption(tmp_path):
    name = f"raises-{tmp_path.name[-6:]}"
    body = kinetic_task(raises, name=name, ship_project=False)

    @flow
    def pipeline():
        return body(str(tmp_path / "pid"))

    with pytest.raises(ValueError, match="the body's own bug"):
        pipeline()
    [job] = _job_runs(name)  # one job, not retried
    assert job.state.is_failed() and "preempted" not in (job.state.message or "")


def where(_: int) -> dict:
    import os

    return {k: os.environ[k] for k in ("KINETIC_ACCELERATOR", "KINETIC_ACCELERATOR_CHIPS", "JAX_PLATFORMS")}


def test_a_fallback_list_runs_the_first_accelerator_this_machine_has(monkeypatch):
    monkeypatch.setenv("KINETIC_LOCAL_DEVICES", "")  # this machine: a CPU only, whatever it really has
    on_cpu = kinetic_task(where, accelerator=["l4x4", "cpu"], ship_project=False)
    absent = kinetic_task(where, accelerator=["a100x4", "l4x4"], ship_project=False)

    @flow
    def pipeline():
        return on_cpu(1), absent(2)

    chosen, fallback = pipeline()
    assert chosen == {"KINETIC_ACCELERATOR": "cpu", "KINETIC_ACCELERATOR_CHIPS": "0", "JAX_PLATFORMS": "cpu"}
    # none is here: the first, on the CPU (with the existing warning), named as asked
    assert fallback == {"KINETIC_ACCELERATOR": "a100x4", "KINETIC_ACCELERATOR_CHIPS": "4", "JAX_PLATFORMS": "cpu"}


def preempted_once() -> int:
    """Its first attempt is preempted (the process gets SIGTERM, as a shutting-down machine sends); the second
    returns."""
    import os
    import signal
    import time

    if os.environ["KINETIC_PREEMPTIONS"] == "0":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    return 7


def test_a_plain_call_returns_its_value_after_a_preemption(tmp_path):
    """A call that took two attempts still returns its value to the flow, not the Completed state that carries the
    run's summary to the UI (a flow got a ``State`` where it expected 7); the task run keeps the summary."""
    body = kinetic_task(preempted_once, name=f"preempted-once-{tmp_path.name[-6:]}", ship_project=False)

    @flow
    def pipeline():
        return body()

    assert pipeline() == 7

    @flow
    def with_state():
        return body(return_state=True)

    state = with_state()
    assert state.is_completed() and "preempted 1×" in (state.message or ""), state.message
    assert state.result() == 7
