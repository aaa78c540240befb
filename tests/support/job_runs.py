"""Finding a kinetic call's job runs through the API, as a user would from a task run or a job run.

A job's flow run hangs under a tracking task run (named like the job) whose ``__parents__`` is the
calling task run: Prefect's own shape for a subflow called inside a task."""

from __future__ import annotations

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentTaskRunId

from kinetic_prefect.contract import TRACKING_TASK_KEY_PREFIX


def calling_task_run(job):
    """The task run that launched ``job`` (a job's flow run)."""
    with get_client(sync_client=True) as client:
        tracker = client.read_task_run(job.parent_task_run_id)
        [parent] = tracker.task_inputs["__parents__"]
        return client.read_task_run(parent.id)


def jobs_of(task_run_id) -> list:
    """The job flow runs a task run launched (one per attempt), oldest first."""
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(task_run_id)
        siblings = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[task_run.flow_run_id])))
        trackers = [t.id for t in siblings if any(p.id == task_run.id for p in t.task_inputs.get("__parents__", []))]
        if not trackers:
            return []
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(any_=trackers))
        )
    return sorted(runs, key=lambda r: r.created)


def is_job_tracker(task_run) -> bool:
    return task_run.task_key.startswith(TRACKING_TASK_KEY_PREFIX)


def task_runs_of(flow_run_id) -> list:
    """A flow run's own task runs (the jobs' tracking task runs left out)."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [r for r in runs if not is_job_tracker(r)]
