"""``kinetic-prefect cost``: what flow runs' kinetic calls cost, read from Prefect's own records only; and
``kinetic-prefect cost --estimate``: what a fallback list would cost, before anything runs.

A flow run's calls are its job runs (they hang under its tracking task runs); each job's cost is the table
artifact the worker left on it (``contract.JOB_COST_ARTIFACT_KEY``). No other database is kept. An estimate
reads the built-in price table only (``kinetic_prefect.shared.prices``), no server.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import typer
from rich.markup import escape
from rich.table import Table

from kinetic_prefect.cli.console import ClickException, make_console


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


# ----------------------------------------------------------------------------- --estimate

# MODULE:TASK, told apart from the catalog's own colon spellings (l4:spot, l4:2) by what follows the colon.
_TASK_REF = re.compile(r"(?P<module>[A-Za-z_][\w.]*):(?P<task>[A-Za-z_]\w*)")


@dataclass(frozen=True)
class EstimateRow:
    """One entry of a fallback list: its whole job's rates (every host) and what ``minutes`` on it would cost."""

    accelerator: str  # the catalog spelling, ":spot" kept
    spot: bool
    hosts: int
    chips: int  # GPUs or TPU chips of the whole job (every host); 0 on the CPU
    on_demand_usd_per_hour: float | None
    spot_usd_per_hour: float | None
    minutes: float
    note: str  # what the price is made of, or why there is none

    @property
    def usd(self) -> float | None:
        rate = self.spot_usd_per_hour if self.spot else self.on_demand_usd_per_hour
        return None if rate is None else rate * self.minutes / 60.0

    def as_dict(self) -> dict[str, Any]:
        usd = self.usd
        return {
            "accelerator": self.accelerator,
            "spot": self.spot,
            "hosts": self.hosts,
            "chips": self.chips,
            "on_demand_usd_per_hour": self.on_demand_usd_per_hour,
            "spot_usd_per_hour": self.spot_usd_per_hour,
            "minutes": self.minutes,
            "usd": None if usd is None else round(usd, 6),
            "note": self.note,
        }


def estimate(target: str, minutes: float, hosts: int | None = None) -> list[EstimateRow]:
    """The estimated cost of ``minutes`` on each entry of ``target``: accelerator names (one, or a fallback list
    joined by commas) or ``MODULE:TASK`` naming a ``@kinetic_task`` (its accelerator, fallbacks and hosts)."""
    from kinetic_prefect import accelerators

    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise ValueError(
            f"--minutes {minutes}: give how long the job would run, in minutes, more than 0 (--minutes 30)"
        )
    specs, hosts = _estimate_targets(target, hosts)
    return [_estimate_row(spec, accelerators.host_count(spec, hosts), float(minutes)) for spec in specs]


def _estimate_row(spec: Any, hosts: int, minutes: float) -> EstimateRow:
    from kinetic_prefect.shared import capacity, cost
    from kinetic_prefect.shared.prices import PRICES

    price = cost.price_for(spec)
    rates = [cost.host_rate(spec, price, spot) for spot in (False, True)]
    on_demand, spot = (None if rate is None else round(rate * hosts, 6) for rate in rates)
    return EstimateRow(
        capacity.label(spec),
        spec.spot,
        hosts,
        spec.chips_per_host * hosts if spec.chips else 0,
        on_demand,
        spot,
        minutes,
        PRICES[spec.name].note,
    )


def _estimate_targets(target: str, hosts: int | None) -> tuple[list[Any], int | None]:
    from kinetic_prefect import accelerators
    from kinetic_prefect.shared import capacity

    text = target.strip()
    try:
        return capacity.choices(text, hosts), hosts
    except accelerators.UnknownAcceleratorError as exc:
        ref = _TASK_REF.fullmatch(text)
        if ref is None or ref["task"] == "spot":
            raise
        not_an_accelerator = str(exc)
    task = _kinetic_task(ref["module"], ref["task"], not_an_accelerator)
    if hosts is not None:
        raise ValueError(
            f"--hosts {hosts} with {text!r}: a kinetic task brings its own hosts "
            f"({task.kinetic.hosts or 1}); drop --hosts, or give accelerator names instead of the task"
        )
    return list(task.kinetic.accelerator_choices), task.kinetic.hosts  # resolved once, when it was decorated


def _kinetic_task(module_name: str, attribute: str, not_an_accelerator: str) -> Any:
    """The ``@kinetic_task`` ``module_name:attribute``, imported as ``python -m`` would (the current folder first)."""
    from kinetic_prefect.caller.decorator import KineticTask

    ref = f"{module_name}:{attribute}"
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{ref!r} is neither an accelerator nor an importable MODULE:TASK. As an accelerator: "
            f"{not_an_accelerator} As a task: cannot import {module_name!r} ({exc}); run from the folder that "
            "holds the module, or give a module on sys.path"
        ) from None
    found = getattr(module, attribute, None)
    if isinstance(found, KineticTask):
        return found
    tasks = sorted(name for name, value in vars(module).items() if isinstance(value, KineticTask))
    offer = f"its kinetic tasks: {', '.join(f'{module_name}:{name}' for name in tasks)}" if tasks else "it has none"
    what = "no such name" if found is None else f"a {type(found).__name__}"
    raise ValueError(
        f"{ref!r} is not a @kinetic_task ({what} in module {module_name!r}; {offer}): name a function decorated "
        "with @kinetic_task(accelerator=...), or give accelerator names such as l4,a100x4"
    )


def estimate_table(rows: list[EstimateRow], minutes: float) -> Any:
    """The estimate as a rich table: one row per entry, in the order the worker tries them."""
    from rich.table import Table

    from kinetic_prefect.shared.prices import DEFAULT_REGION, NO_PUBLIC_PRICE, SOURCE_DATE

    table = Table(title=f"estimated cost of {minutes:g} min ({DEFAULT_REGION} list prices, read {SOURCE_DATE})")
    for column in ("accelerator", "hosts", "chips/GPUs", "on-demand $/h", "spot $/h", f"{minutes:g} min"):
        table.add_column(column, justify="left" if column == "accelerator" else "right")

    def money(value: float | None, digits: int) -> str:
        return NO_PUBLIC_PRICE if value is None else f"${value:.{digits}f}"

    for row in rows:
        usd = money(row.usd, 4) + (" (spot)" if row.spot and row.usd is not None else "")
        table.add_row(
            row.accelerator,
            str(row.hosts),
            str(row.chips),
            money(row.on_demand_usd_per_hour, 4),
            money(row.spot_usd_per_hour, 4),
            usd,
        )
    return table


__all__ = ["EstimateRow", "RunCost", "estimate", "estimate_table", "flow_run_costs"]


# --------------------------------------------------------------------------- the command


def _print_estimate(target: str | None, minutes: float | None, hosts: int | None, as_json: bool) -> None:
    if target is None or minutes is None:
        raise ClickException(
            "--estimate and --minutes go together: kinetic-prefect cost --estimate l4,a100x4 --minutes 30 "
            "(accelerator names, or MODULE:TASK of a @kinetic_task)"
        )
    try:
        rows = estimate(target, minutes, hosts)
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    if as_json:
        sys.stdout.write(json.dumps({"minutes": minutes, "rows": [r.as_dict() for r in rows]}, indent=2) + "\n")
        return
    console = make_console()
    console.width = max(console.width, 120)
    console.print(estimate_table(rows, minutes))
    console.print("The call runs on the first entry that has capacity; each row is what it would cost there.")
    for row in rows:
        if row.usd is None:  # say why, and where a figure can come from
            console.print(f"{row.accelerator}: {row.note} (a pool's own figure: pool-set POOL 'prices=...')")


def cost_command(
    flow_run: list[str] | None = typer.Option(None, "--flow-run", metavar="ID", help="a flow run (repeatable)"),
    deployment: str | None = typer.Option(None, "--deployment", metavar="FLOW/NAME", help="runs of a deployment"),
    flow_name: str | None = typer.Option(None, "--flow", metavar="NAME", help="runs of a flow"),
    since: datetime | None = typer.Option(None, "--since", metavar="DATE", help="runs started at or after DATE"),
    until: datetime | None = typer.Option(None, "--until", metavar="DATE", help="runs started before DATE"),
    last: int = typer.Option(10, "--last", metavar="N", help="the N most recent runs (0: all in the range)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    estimate_target: str | None = typer.Option(
        None, "--estimate", metavar="TASK_OR_ACCELERATORS", help="estimate, before running: l4,a100x4 or MODULE:TASK"
    ),
    minutes: float | None = typer.Option(None, "--minutes", metavar="N", help="with --estimate: minutes of run"),
    hosts: int | None = typer.Option(None, "--hosts", metavar="N", help="with --estimate: hosts of a group"),
) -> None:
    """What flow runs' kinetic calls cost, from Prefect's records (the cost artifacts the workers left); with
    --estimate, what a fallback list would cost for --minutes, from the built-in list prices."""
    if estimate_target is not None or minutes is not None or hosts is not None:
        return _print_estimate(estimate_target, minutes, hosts, as_json)
    from prefect.utilities.asyncutils import run_coro_as_sync

    def utc(moment: datetime | None) -> datetime | None:
        return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment

    try:
        runs: list[Any] = run_coro_as_sync(  # its return type is lost
            flow_run_costs(flow_run, deployment, flow_name, utc(since), utc(until), last)
        )
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    total = sum(r.total_usd for r in runs)
    if as_json:
        sys.stdout.write(
            json.dumps({"total_usd": round(total, 6), "runs": [r.as_dict() for r in runs]}, indent=2) + "\n"
        )
        return
    console = make_console()
    console.width = max(console.width, 120)
    for run in runs:
        table = Table(
            title=f"{run.name} ({run.flow_run_id}, {run.state or '?'}, started {run.start or '-'}): "
            f"${run.total_usd:.4f}" + (f", {run.unpriced_calls} unpriced" if run.unpriced_calls else "")
        )
        for column in ("call", "accelerator", "spot", "hosts", "minutes", "$"):
            table.add_column(column, justify="right" if column in ("hosts", "minutes", "$") else "left")
        for call in run.calls:
            usd = call.get("usd")
            table.add_row(
                escape(str(call.get("call"))),
                str(call.get("accelerator")),
                "yes" if call.get("spot") else "no",
                str(call.get("hosts")),
                f"{call.get('minutes') or 0:.2f}",
                "unpriced" if usd is None else f"${usd:.4f}",
            )
        console.print(table)
    console.print(f"{len(runs)} flow run(s), ${total:.4f} in all")


def register(app: typer.Typer) -> None:
    """Add ``cost`` to the ``kinetic-prefect`` app."""
    app.command("cost")(cost_command)
