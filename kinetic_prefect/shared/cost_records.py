"""What a flow run's kinetic calls cost, read back from the cost artifacts the workers left on the job runs."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from kinetic_prefect.contract import JOB_COST_ARTIFACT_KEY
from kinetic_prefect.shared import cost

# What a cost table artifact shows in its ``usd`` cell for a job with no price (read back as no figure: None).
UNPRICED = "unpriced"


async def job_cost_rows(client: Any, job_run_ids: list[UUID]) -> list[dict[str, Any]]:
    """The cost rows the worker recorded for these job runs (one per job), from their artifacts."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    if not job_run_ids:
        return []
    artifacts = await client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[JOB_COST_ARTIFACT_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=job_run_ids)
        )
    )
    rows: dict[UUID, dict[str, Any]] = {}
    for artifact in sorted(artifacts, key=lambda a: a.created or 0):
        try:
            data = artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data or "[]")
        except (TypeError, ValueError):
            continue
        if data and isinstance(data[0], dict):
            row = {**data[0], "flow_run_id": str(artifact.flow_run_id)}
            if isinstance(row.get("usd"), bool) or not isinstance(row.get("usd"), int | float):
                row["usd"] = None  # "unpriced" (or an older artifact's blank): no figure, counted as unpriced
            rows[artifact.flow_run_id] = row
    return [rows[i] for i in job_run_ids if i in rows]


async def flow_cost(client: Any, parent_flow_run_id: UUID) -> cost.FlowCost:
    """Every kinetic call of a flow run (its job runs hang under its tracking task runs) with its cost."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    jobs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_flow_run_id])),
        sort=FlowRunSort.START_TIME_ASC,
        limit=200,
    )
    return cost.FlowCost(rows=await job_cost_rows(client, [job.id for job in jobs]))
