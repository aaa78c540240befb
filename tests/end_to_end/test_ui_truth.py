"""What the Prefect UI shows of a call adds up, read through the Prefect API (what the UI itself reads): every
artifact a call leaves has a title (the UI's artifact card shows an artifact's key as its title, nothing without
one), an unpriced call's cost says "unpriced" and how to price it instead of an empty cell beside a total of 0, and
a timed-out call's job run names the timeout and says it counted the upload and start-up too.

Real jobs on kinetic-local against the session's Prefect server (each test takes a few seconds for its job).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from test_spine import job_runs

from kinetic_prefect import kinetic_task
from kinetic_prefect.contract import FLOW_COST_ARTIFACT_KEY, JOB_COST_ARTIFACT_KEY, Env

pytestmark = pytest.mark.slow


def artifacts_of(*flow_run_ids) -> list:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=list(flow_run_ids)))
        )
    return sorted(found, key=lambda a: a.created)


def rows_of(artifact) -> list[dict]:
    return artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data)


def test_every_artifact_of_a_call_has_a_title_and_says_which_job_it_belongs_to():
    """A job that reports progress, writes an output and runs long enough for usage samples (about 3 s)."""
    name = f"titled-{uuid.uuid4().hex[:6]}"
    output_dir = Env.OUTPUT_DIR

    @kinetic_task(name=name, accelerator="cpu")
    def train() -> int:
        import os
        import pathlib
        import time as _time

        from kinetic_prefect.pod import progress

        for step in range(1, 4):
            progress.report(step, 3, f"step {step}/3")
            _time.sleep(1.0)
        (pathlib.Path(os.environ[output_dir]) / "model.txt").write_text("weights")
        return 3

    @flow
    def pipeline():
        return train()

    state = pipeline(return_state=True)
    assert state.result() == 3
    [job] = job_runs(name)
    found = artifacts_of(state.state_details.flow_run_id, job.id)
    kinds = {a.type for a in found}
    assert {"progress", "table", "markdown"} <= kinds, [(a.type, a.key, a.description) for a in found]
    untitled = [(a.type, a.description) for a in found if not a.key]
    assert not untitled, f"artifacts the UI shows without a title: {untitled}"
    on_the_call = [a for a in found if a.key != FLOW_COST_ARTIFACT_KEY]  # the flow run's total names every call
    unnamed = [(a.key, a.description) for a in on_the_call if job.name not in (a.description or "")]
    assert not unnamed, f"artifacts whose description does not name the job {job.name}: {unnamed}"
    [progress] = [a for a in found if a.type == "progress"]
    assert progress.description.startswith(f"Progress of kinetic job {job.name}"), progress.description


def test_an_unpriced_call_says_unpriced_and_how_to_price_it_never_an_empty_cell_beside_a_total_of_0():
    """kinetic-local's default pool has no price for ``cpu``."""
    name = f"unpriced-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator="cpu")
    def nap() -> int:
        import time as _time

        _time.sleep(0.5)
        return 1

    @flow
    def pipeline():
        return nap()

    state = pipeline(return_state=True)
    assert state.result() == 1
    [job] = job_runs(name)
    [job_cost] = [a for a in artifacts_of(job.id) if a.key == JOB_COST_ARTIFACT_KEY]
    [row] = rows_of(job_cost)
    assert row["usd"] == "unpriced", row
    assert "pool-set" in row["price"] and "prices=" in row["price"], row
    flow_costs = [a for a in artifacts_of(state.state_details.flow_run_id) if a.key == FLOW_COST_ARTIFACT_KEY]
    assert flow_costs, "no cost total on the flow run"
    *calls, total = rows_of(flow_costs[-1])
    assert [c["usd"] for c in calls] == ["unpriced"], calls
    assert total["usd"] == "unpriced", total
    assert "pool-set" in calls[0]["price"], calls
    assert "unpriced" in flow_costs[-1].description and "$0.0000" not in flow_costs[-1].description

    from prefect.utilities.asyncutils import run_coro_as_sync

    from kinetic_prefect.cli.cost import flow_run_costs

    [report] = run_coro_as_sync(flow_run_costs([str(state.state_details.flow_run_id)]))
    assert report.unpriced_calls == 1 and report.total_usd == 0, report  # `kinetic-prefect cost` reads it back


def test_a_timed_out_call_names_its_timeout_and_says_it_covered_upload_and_start_up():
    name = f"timed-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator="cpu", timeout_seconds=4)
    def too_slow() -> int:
        import time as _time

        _time.sleep(60)
        return 1

    @flow
    def pipeline():
        return too_slow()

    state = pipeline(return_state=True)
    assert state.is_failed()
    [job] = job_runs(name)
    deadline = time.time() + 20
    with get_client(sync_client=True) as client:
        while not (job := client.read_flow_run(job.id)).state.is_final() and time.time() < deadline:
            time.sleep(0.5)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    message = job.state.message or ""
    assert "timeout_seconds=4" in message, message
    assert "upload" in message and "start-up" in message, message
    said = [log for log in logs if "timeout_seconds=4" in log.message and "upload" in log.message]
    assert said and all(log.level >= 40 for log in said), [(log.level, log.message) for log in logs]


def test_a_failed_jobs_one_line_reason_is_logged_as_an_error_not_info():
    name = f"failing-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator="cpu")
    def diverge() -> int:
        raise ValueError("the loss diverged at step 7")

    @flow
    def pipeline():
        return diverge()

    state = pipeline(return_state=True)
    assert state.is_failed()
    [job] = job_runs(name)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id, job.id]))
        )
    reasons = [log for log in logs if "the loss diverged at step 7" in log.message and "\n" not in log.message.strip()]
    assert reasons, [(log.level, log.message) for log in logs]
    assert all(log.level >= 30 for log in reasons), [(log.level, log.message) for log in logs]


def test_a_flow_total_of_priced_and_unpriced_calls_counts_the_priced_ones_and_says_how_many_it_left_out():
    from kinetic_prefect.shared import cost
    from kinetic_prefect.workers import metering

    total = cost.FlowCost(
        rows=[
            {"call": "fit-job1", "accelerator": "l4", "hosts": 1, "minutes": 2.0, "usd": 0.5, "price": "sheet"},
            {"call": "fit-job2", "accelerator": "cpu", "hosts": 1, "minutes": 1.0, "usd": None, "price": "unpriced: …"},
        ]
    )
    rows, description = metering.flow_total_table(total)
    assert [r["usd"] for r in rows[:2]] == [0.5, "unpriced"]
    assert rows[-1]["usd"] == 0.5 and "1 unpriced, not counted" in rows[-1]["call"], rows[-1]
    assert "$0.5000 for 1 priced, 1 unpriced" in description, description
