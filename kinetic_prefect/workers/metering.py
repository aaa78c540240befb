"""Worker side: meter a job while the lifecycle follows it; publish its cost; stop it at its budget.

``JobMeter`` reads the job's hosts' start and end times from the launcher (``JobLauncher.host_spans``) on
each poll. One meter follows a run across its attempts (a fallback to the next accelerator, a relaunch after a
preemption): each attempt's spans are kept, summed into the run's cost and its budget, and listed. When the
job's run is final it publishes, in Prefect only (``kinetic-prefect cost`` reads these back):

* a cost table artifact on the job's run (key ``contract.JOB_COST_ARTIFACT_KEY``, one version per job: the
  run's total, then one row per attempt when there were several) and a ``kinetic.job.cost`` event;
* the running total of the calling flow run's kinetic calls: one table artifact on that flow run (key
  ``contract.FLOW_COST_ARTIFACT_KEY``: call, accelerator, spot, minutes, $), recomputed from the job
  artifacts and updated in place as jobs end, and a ``kinetic.flow-run.cost`` event with the total.

A job with ``max_cost_usd`` is stopped as soon as its metered cost, every attempt together, reaches it: SIGTERM
(the runner unwinds, so checkpoints and outputs are saved), then its run ends Failed, "budget of $X reached after
N min", and its outcome record says so (``contract.BUDGET_ERROR_TYPE``): the caller raises ``BudgetExceeded``,
not retried.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

import anyio
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators
from kinetic_prefect.contract import (
    BUDGET_ERROR_TYPE,
    EVENT_COST,
    FAILED,
    FLOW_COST_ARTIFACT_KEY,
    FLOW_COST_EVENT,
    JOB_COST_ARTIFACT_KEY,
    PHASE_FUNCTION,
    Env,
    Outcome,
    RunLayout,
)
from kinetic_prefect.contract.launchers import PriceSource
from kinetic_prefect.shared import cost, key_blocks, prefect_runs
from kinetic_prefect.shared.cost_records import UNPRICED, flow_cost, job_cost_rows


def job_spec(configuration: Any) -> accelerators.AcceleratorSpec:
    spec = getattr(configuration, "accelerator_spec", None)  # kinetic-gke folds its `spot` variable in
    return spec if isinstance(spec, accelerators.AcceleratorSpec) else accelerators.resolve(configuration.accelerator)


@dataclass
class MeteredAttempt:
    """One attempt of a job's run (the first, a fallback to the next accelerator, a relaunch after a preemption):
    its accelerator, price and hosts' spans, and why the next attempt was made (empty for the current one)."""

    identifier: str
    spec: accelerators.AcceleratorSpec
    price: Any
    spans: list[cost.HostSpan] = field(default_factory=list)
    ended: str = ""

    def cost(self, now: float) -> cost.JobCost:
        return cost.job_cost(self.spec, self.spans, self.price, now)

    def row(self, number: int, now: float) -> dict[str, Any]:
        """Its line in the job's cost table: hosts, minutes billed, of which pending (image pull) where known."""
        billed = self.cost(now)
        pending = [span.pending_seconds(now) for span in self.spans]
        known = [seconds for seconds in pending if seconds is not None]
        pending_minutes = max(known) / 60.0 if known and len(known) == len(pending) else None
        return {
            "attempt": number,
            "accelerator": self.spec.name,
            "spot": billed.spot,
            "hosts": billed.hosts,
            "minutes": round(billed.minutes, 4),
            "pending_minutes": None if pending_minutes is None else round(pending_minutes, 4),
            "run_minutes": None if pending_minutes is None else round(max(0.0, billed.minutes - pending_minutes), 4),
            # an attempt that never started (not placed: a fallback) cost nothing, priced or not
            "usd": 0.0 if not self.spans else (None if billed.usd is None else round(billed.usd, 6)),
            "ended": self.ended,
        }


class JobMeter:
    """The cost of one followed job's run, over all its attempts, from its hosts' spans, and whether the run
    reached its budget. The lifecycle tells it of each relaunch (``relaunched``): one meter per run."""

    def __init__(
        self, launcher: Any, identifier: str, configuration: Any, source: PriceSource = PriceSource.CLOUD_CATALOG
    ):
        self.launcher, self.configuration = launcher, configuration
        self.source = source  # the built-in price table of the job's launcher (abilities.price_source)
        self.problem: str | None = None  # a price table that cannot be read: said once, metered unpriced
        try:
            self.overrides = cost.load_prices(getattr(configuration, "prices", None))
        except cost.PriceTableError as exc:
            self.overrides, self.problem = {}, str(exc)
        self.attempts: list[MeteredAttempt] = []
        self._start_attempt(identifier)
        self.budget = getattr(configuration, "max_cost_usd", None)

    def _start_attempt(self, identifier: str) -> None:
        spec = job_spec(self.configuration)  # a relaunch changed the configuration's accelerator (and spot)
        self.attempts.append(MeteredAttempt(identifier, spec, cost.price_for(spec, self.overrides, self.source)))

    @property
    def current(self) -> MeteredAttempt:
        return self.attempts[-1]

    @property
    def identifier(self) -> str:
        return self.current.identifier

    @property
    def spec(self) -> accelerators.AcceleratorSpec:
        return self.current.spec

    @property
    def price(self) -> Any:
        return self.current.price

    @property
    def spans(self) -> list[cost.HostSpan]:
        """Every attempt's hosts (empty: nothing has run yet)."""
        return [span for attempt in self.attempts for span in attempt.spans]

    def relaunched(self, identifier: str, ended: str) -> None:
        """The run goes on as another attempt ``identifier``: the last one is closed (a host still open ends now)
        with the spans last read of it, kept and billed; the new one is metered from here."""
        now = time.time()
        last = self.current
        last.spans = [span if span.end is not None else replace(span, end=now) for span in last.spans]
        last.ended = ended or "relaunched"
        self._start_attempt(identifier)

    async def observe(self) -> None:
        with contextlib.suppress(Exception):  # metering never fails a job; the last spans stand
            self.current.spans = await self.launcher.host_spans(self.identifier, self.configuration)

    def spent_before(self, now: float) -> float | None:
        """What the attempts before the current one cost (None: one of them ran unpriced)."""
        total = 0.0
        for attempt in self.attempts[:-1]:
            usd = attempt.cost(now).usd if attempt.spans else 0.0
            if usd is None:
                return None
            total += usd
        return total

    def now_cost(self) -> cost.JobCost:
        """The run's cost so far: every attempt summed; accelerator, spot and hosts are the current attempt's."""
        now = time.time()
        current = self.current.cost(now)
        if len(self.attempts) == 1:
            return current
        before = self.spent_before(now)
        costs = [attempt.cost(now) for attempt in self.attempts if attempt.spans]
        current.minutes = sum(c.minutes for c in costs)
        current.host_minutes = sum(c.host_minutes for c in costs)
        current.usd = (
            None if before is None or (current.usd is None and self.current.spans) else before + (current.usd or 0.0)
        )
        return current

    def rows(self) -> list[dict[str, Any]]:
        now = time.time()
        return [attempt.row(number, now) for number, attempt in enumerate(self.attempts, 1)]

    def over_budget(self) -> str | None:
        """The run's final message if its cost, all attempts together, has reached its budget, else None."""
        if not self.budget or not self.spans:
            return None
        now = time.time()
        left_for_this = float(self.budget) - (self.spent_before(now) or 0.0)
        if left_for_this > 0:
            if not self.current.spans:
                return None
            left = cost.seconds_to_budget(self.spec, self.current.spans, self.price, left_for_this, now)
            if left is None or left > 0:
                return None
        return cost.budget_message(float(self.budget), self.now_cost().minutes)


def _usd(value: float | None) -> str:
    return "unpriced" if value is None else f"${value:.4f}"


def cost_table(meter: JobMeter, call: str) -> tuple[cost.JobCost, list[dict[str, Any]]]:
    """The run's cost and its table: the first row is the run's total (what ``kinetic-prefect cost`` and the flow
    run's total read); a run of several attempts (fallbacks, preemptions) lists each attempt after it."""
    job = meter.now_cost()
    row = job.as_row(call)
    attempts = meter.rows()
    if attempts[-1]["pending_minutes"] is not None:
        row["pending_minutes"] = round(sum(a["pending_minutes"] or 0.0 for a in attempts), 4)
        row["run_minutes"] = round(sum(a["run_minutes"] or 0.0 for a in attempts), 4)
    if len(attempts) == 1:
        return job, [row]
    row["attempts"] = len(attempts)
    return job, [row] + [{"call": f"{call} attempt {a['attempt']}", **a} for a in attempts]


def _described(job: cost.JobCost, attempts: list[dict[str, Any]]) -> str:
    text = (
        f"{job.accelerator}{' (spot)' if job.spot else ''}, {job.hosts} host(s), {job.minutes:.2f} min: "
        f"{_usd(job.usd)}" + (f" at ${job.usd_per_hour:.4f}/h" if job.usd_per_hour else "")
    )
    if len(attempts) > 1:
        earlier = "; ".join(
            f"{a['accelerator']}{' (spot)' if a['spot'] else ''} {a['minutes']:.2f} min {_usd(a['usd'])} ({a['ended']})"
            for a in attempts[:-1]
        )
        text += f", over {len(attempts)} attempts (earlier: {earlier})"
    return text


async def publish_job_cost(worker: Any, flow_run: FlowRun, meter: JobMeter) -> cost.JobCost | None:
    """The job's cost artifact and event, then the calling flow run's running total (artifact and event)."""
    from prefect.client.schemas.actions import ArtifactCreate

    await meter.observe()
    if not meter.spans:
        return None  # never started: nothing ran, nothing to bill
    job, rows = cost_table(meter, flow_run.name)
    attempts = rows[1:]
    logger = worker.get_flow_run_logger(flow_run)
    if meter.problem:
        logger.warning(f"Cost not priced: {meter.problem}")
    described = _described(job, attempts)
    logger.info(f"Cost of this job: {described}")
    pool = getattr(worker, "_work_pool_name", None) or "POOL"
    source = job.price_source if job.usd is not None else how_to_price(pool, job.accelerator)
    try:
        await worker.client.create_artifact(
            ArtifactCreate(
                key=JOB_COST_ARTIFACT_KEY,
                type="table",
                data=json.dumps([shown_unpriced(row, pool) for row in rows]),
                flow_run_id=flow_run.id,
                description=f"Cost of kinetic job {flow_run.name}: {described} ({source})",
            )
        )
    except Exception as exc:
        logger.warning(f"Could not record the job's cost artifact ({type(exc).__name__}: {exc})")
        return job
    worker.emit_job_event(
        flow_run,
        EVENT_COST,
        meter.configuration,
        usd=job.usd,
        minutes=round(job.minutes, 4),
        hosts=job.hosts,
        spot=job.spot,
        usd_per_hour=job.usd_per_hour,
        pending_minutes=rows[0].get("pending_minutes"),
        attempts=attempts or None,
    )
    await publish_flow_total(worker, flow_run)
    return job


async def calling_flow_run_id(client: Any, flow_run: FlowRun) -> UUID | None:
    """The flow run that called this job: its tracking task run's (a call's, or a sweep's slot's, which serves
    several calls of that flow run), or None for a bare job run."""
    if flow_run.parent_task_run_id is None:
        return None
    tracker = await prefect_runs.read_task_run_or_none(client, flow_run.parent_task_run_id)
    return tracker.flow_run_id if tracker is not None else None


async def publish_flow_total(worker: Any, flow_run: FlowRun) -> cost.FlowCost | None:
    """Recompute the calling flow run's total from its jobs' cost artifacts and update its table artifact."""
    from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    client = worker.client
    try:
        parent = await calling_flow_run_id(client, flow_run)
        if parent is None:
            return None
        total = await flow_cost(client, parent)
        rows, description = flow_total_table(total)
        existing = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[FLOW_COST_ARTIFACT_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[parent])
            )
        )
        existing = sorted(existing, key=lambda a: a.created or 0)
        if existing:
            await client.update_artifact(existing[0].id, ArtifactUpdate(data=json.dumps(rows), description=description))
            for extra in existing[1:]:  # two jobs that ended at once may each have created one
                await client.delete_artifact(extra.id)
        else:
            await client.create_artifact(
                ArtifactCreate(
                    key=FLOW_COST_ARTIFACT_KEY,
                    type="table",
                    data=json.dumps(rows),
                    flow_run_id=parent,
                    description=description,
                )
            )
        _emit_flow_total(parent, total)
        return total
    except Exception as exc:  # the total is a report: it never fails the job
        worker.get_flow_run_logger(flow_run).warning(
            f"Could not update the flow run's cost total ({type(exc).__name__}: {exc})"
        )
        return None


def how_to_price(pool: str, accelerator: str) -> str:
    """What an unpriced job's cost cell says instead of a blank: that it is unpriced, and the command that prices it."""
    entry = json.dumps({accelerator: {"on_demand": "USD_PER_HOUR"}}).replace('"USD_PER_HOUR"', "USD_PER_HOUR")
    return (
        f"unpriced: pool {pool!r} has no price for {accelerator}; "
        f"price it: kinetic-prefect pool-set {pool} 'prices={entry}'"
    )


def shown_unpriced(row: dict[str, Any], pool: str) -> dict[str, Any]:
    """A cost table row as the UI shows it: "unpriced" and how to price it where there is no figure, never a blank
    beside a total (``cost_records`` reads "unpriced" back as no figure)."""
    if row.get("usd") is not None:
        return row
    shown = {**row, "usd": UNPRICED}
    if "price" in row:
        shown["price"] = how_to_price(pool, str(row.get("accelerator") or "?"))
    return shown


def flow_total_table(total: cost.FlowCost) -> tuple[list[dict[str, Any]], str]:
    """The flow run's cost table (one row per call, then the total) and its description. The total counts the priced
    calls only, and says how many are not counted; with none priced it says "unpriced", not $0."""
    columns = ("call", "accelerator", "spot", "hosts", "minutes", "usd", "price")
    rows = [{k: row.get(k) for k in columns} for row in total.rows]
    priced = len(rows) - total.unpriced
    usd: float | str
    if not priced:
        label, usd, money = "total (no call priced)", UNPRICED, "unpriced"
    elif total.unpriced:
        label = f"total of the {priced} priced call(s); {total.unpriced} unpriced, not counted"
        usd, money = round(total.total_usd, 6), f"${total.total_usd:.4f} for {priced} priced, {total.unpriced} unpriced"
    else:
        label, usd, money = "total", round(total.total_usd, 6), f"total ${total.total_usd:.4f}"
    shown = [{**row, "usd": UNPRICED} if row["usd"] is None else row for row in rows]
    shown.append(
        {
            "call": label,
            "accelerator": "",
            "spot": "",
            "hosts": sum(r.get("hosts") or 0 for r in rows),
            "minutes": round(sum(r.get("minutes") or 0 for r in rows), 4),
            "usd": usd,
            "price": "" if not total.unpriced else "unpriced calls: see their price column",
        }
    )
    return shown, f"Cost of the kinetic calls of this flow run: {len(rows)} call(s), {money}"


def _emit_flow_total(parent: UUID, total: cost.FlowCost) -> None:
    try:
        from prefect.events import emit_event

        emit_event(
            event=FLOW_COST_EVENT,
            resource={"prefect.resource.id": f"prefect.flow-run.{parent}"},
            payload={
                "total_usd": round(total.total_usd, 6),
                "calls": len(total.rows),
                "unpriced_calls": total.unpriced,
            },
        )
    except Exception:
        pass


async def record_budget_outcome(worker: Any, flow_run: FlowRun, configuration: Any, message: str) -> None:
    """Make the job's outcome say the budget stopped it (keeping the outputs the runner listed), so the caller
    raises BudgetExceeded instead of the JobTerminated the runner recorded."""
    from kinetic_prefect import signing
    from kinetic_prefect.storage import ObjectNotFound

    try:
        store = await worker.open_pool_store(configuration)
        layout = RunLayout(configuration.env[Env.RUN_ID])
        key = await key_blocks.signing_key()
        try:
            outcome = Outcome.from_json(await anyio.to_thread.run_sync(signing.get, store, layout.outcome, key))
        except (ObjectNotFound, signing.TamperedObject, ValueError):
            outcome = Outcome(status=FAILED)
        outcome.status, outcome.phase, outcome.error_type = FAILED, PHASE_FUNCTION, BUDGET_ERROR_TYPE
        outcome.message, outcome.user_error, outcome.traceback = message, True, ""
        await anyio.to_thread.run_sync(signing.delete, store, layout.result)
        await anyio.to_thread.run_sync(signing.put, store, layout.outcome, outcome.to_json(), key)
    except Exception as exc:  # the run still ends Failed with the budget's message
        worker.get_flow_run_logger(flow_run).warning(
            f"Could not record the budget stop in the job's outcome ({type(exc).__name__}: {exc})"
        )


__all__ = [
    "JobMeter",
    "MeteredAttempt",
    "cost_table",
    "flow_cost",
    "job_cost_rows",
    "publish_job_cost",
    "record_budget_outcome",
]
