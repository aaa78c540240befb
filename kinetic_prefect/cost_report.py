"""``kinetic-prefect cost``: what flow runs' kinetic calls cost, read from Prefect's own records only.

A flow run's calls are its job runs (they hang under its tracking task runs); each job's cost is the table
artifact the worker left on it (``contract.JOB_COST_ARTIFACT_KEY``). No other database is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass
class RunCost:
    flow_run_id: str
    name: str
    start: str | None
    state: str | None
    total_usd: float
    unpriced_calls: int
    calls: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "flow_run_id": self.flow_run_id,
            "name": self.name,
            "start": self.start,
            "state": self.state,
            "total_usd": round(self.total_usd, 6),
            "unpriced_calls": self.unpriced_calls,
            "calls": self.calls,
        }


async def _select_runs(
    client: Any,
    flow_run_ids: list[str],
    deployment: str | None,
    flow_name: str | None,
    since: datetime | None,
    until: datetime | None,
    last: int,
) -> list[Any]:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    if flow_run_ids:
        try:
            ids = [UUID(i) for i in flow_run_ids]
        except ValueError:
            raise ValueError(
                f"--flow-run {flow_run_ids!r}: give flow run ids (UUIDs, as `prefect flow-run ls` shows them)"
            ) from None
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
        missing = sorted({str(i) for i in ids} - {str(r.id) for r in runs})
        if missing:
            raise ValueError(
                f"--flow-run {', '.join(missing)}: no such flow run on {client.api_url} "
                "(`prefect flow-run ls` lists them; `kinetic-prefect jobs list` lists job runs)"
            )
        return sorted(runs, key=lambda r: ids.index(r.id))
    deployment_filter = None
    if deployment:
        from prefect.exceptions import ObjectNotFound

        if "/" not in deployment:
            raise ValueError(f"--deployment {deployment!r}: name it FLOW/DEPLOYMENT, e.g. eurosat-vit/weekly-retrain")
        try:
            found = await client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise ValueError(
                f"--deployment {deployment!r}: no such deployment on {client.api_url} (`prefect deployment ls` "
                "lists them as FLOW/DEPLOYMENT)"
            ) from None
        deployment_filter = DeploymentFilter(id=DeploymentFilterId(any_=[found.id]))
    start = FlowRunFilterStartTime(after_=since, before_=until) if since or until else None  # type: ignore[arg-type]
    runs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(start_time=start) if start else None,
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])) if flow_name else None,
        deployment_filter=deployment_filter,
        sort=FlowRunSort.START_TIME_DESC,
        limit=max(1, last) * 4 + 50,
    )
    callers = [r for r in runs if "kinetic" not in (r.tags or [])]  # job runs carry the "kinetic" tag
    return callers[:last] if last else callers


async def flow_run_costs(
    flow_run_ids: list[str] | None = None,
    deployment: str | None = None,
    flow_name: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    last: int = 10,
) -> list[RunCost]:
    from prefect import get_client

    from kinetic_prefect.shared import cost
    from kinetic_prefect.shared.cost_records import flow_cost, job_cost_rows

    if last < 0:
        raise ValueError(f"--last {last}: give how many recent runs to show (0: all in the range)")
    async with get_client() as client:
        runs = await _select_runs(client, list(flow_run_ids or []), deployment, flow_name, since, until, last)
        found = []
        for run in runs:
            if "kinetic" in (run.tags or []):  # a job run (the id `jobs list` shows): that job's own cost
                total = cost.FlowCost(rows=await job_cost_rows(client, [run.id]))
            else:
                total = await flow_cost(client, run.id)
            found.append(
                RunCost(
                    str(run.id),
                    run.name,
                    run.start_time.isoformat() if run.start_time else None,
                    run.state.name if run.state else None,
                    total.total_usd,
                    total.unpriced,
                    total.rows,
                )
            )
    return found


__all__ = ["RunCost", "flow_run_costs"]
