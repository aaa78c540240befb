"""Finding detached jobs: ``attach`` (a handle from a job's id) and ``list_jobs`` (the kinetic job runs of the
Prefect API, read in pages).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from kinetic_prefect.contract import (
    Env,
)
from kinetic_prefect.kinetic.jobs import JobHandle, run_sync

PAGE = 200


def attach(job_id: str | UUID) -> JobHandle:
    """The handle of a job from its id (its run's id), from any process that reaches the same Prefect API.

    Also takes the job run of a ``@kinetic_task`` call (``kinetic_prefect.attach(flow_run_id)``): a caller that
    was killed left its result in the store, and this collects it.
    """
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = UUID(str(job_id))
    except ValueError:
        raise ValueError(
            f"job id {job_id!r} is not a job's run id (a UUID such as the one `kinetic-prefect jobs list` prints)"
        ) from None

    async def read() -> JobHandle:
        async with get_client() as client:
            try:
                flow_run = await client.read_flow_run(run_id)
            except ObjectNotFound:
                raise LookupError(
                    f"no job {job_id} on {client.api_url}: is PREFECT_API_URL the server it was "
                    "submitted to? (`kinetic-prefect jobs list` lists the jobs there)"
                ) from None
            return await JobHandle.from_flow_run(client, flow_run)

    return run_sync(read())


def list_jobs(include_finished: bool = False, limit: int = 200, work_pool: str | None = None) -> list[JobHandle]:
    """Kinetic jobs whose runs are not final (``include_finished``: the latest ``limit`` of every state)."""
    return run_sync(find_jobs(include_finished, limit, work_pool))


async def find_jobs(
    include_finished: bool, limit: int, work_pool: str | None, extra_tags: tuple[str, ...] = ()
) -> list[JobHandle]:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    flow_filter = FlowRunFilter(tags=FlowRunFilterTags(all_=["kinetic", *extra_tags]))
    if not include_finished:
        live = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]
        flow_filter.state = FlowRunFilterState(type=FlowRunFilterStateType(any_=live))
    pool_filter = WorkPoolFilter(name=WorkPoolFilterName(any_=[work_pool])) if work_pool else None
    async with get_client() as client:
        runs: list[Any] = []
        while len(runs) < limit:  # in pages: the server caps one read at PREFECT_API_DEFAULT_LIMIT (200)
            page = await client.read_flow_runs(
                flow_run_filter=flow_filter,
                work_pool_filter=pool_filter,
                limit=min(PAGE, limit - len(runs)),
                offset=len(runs),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            )
            runs.extend(page)
            if len(page) < PAGE:
                break
        handles = []
        for flow_run in runs:
            if (flow_run.job_variables or {}).get("env", {}).get(Env.RUN_ID):
                handles.append(await JobHandle.from_flow_run(client, flow_run))
        return handles


__all__ = ["attach", "list_jobs"]
