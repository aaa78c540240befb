"""Caller side: the budget a call runs under, decided before anything is uploaded.

* ``max_cost_usd=`` on a task, else the pool's ``max_cost_usd`` default: the worker stops the job when its metered
  cost reaches it.
* A flow-level budget: the calling flow run's tag ``kinetic-max-cost-usd:<dollars>`` (a tag because Prefect has
  no other per-run field every way of starting a flow sets: ``with tags(...)``, a deployment's ``tags``, the UI's
  custom run). A call starts only while the flow run's kinetic calls have cost less than that, and gets what is
  left as its own budget (the smaller of it and the task's). Calls running side by side each get the whole
  remainder, so a fan-out can overshoot by what its other calls spend meanwhile.

A budget needs a price: a budget on an accelerator the pool has no price for fails here, naming the fix.
"""

from __future__ import annotations

from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.contract import FLOW_BUDGET_TAG_PREFIX
from kinetic_prefect.contract.launchers import PriceSource
from kinetic_prefect.errors import BudgetExceeded
from kinetic_prefect.shared import cost


def flow_budget(tags: list[str] | set[str] | tuple[str, ...]) -> float | None:
    """The budget a flow run's tags give (``kinetic-max-cost-usd:25``), or None."""
    for tag in tags or ():
        if tag.startswith(FLOW_BUDGET_TAG_PREFIX):
            raw = tag[len(FLOW_BUDGET_TAG_PREFIX) :]
            try:
                value = float(raw)
            except ValueError:
                value = None
            return cost.check_budget(value if value is not None else raw, what=f"flow run tag {tag!r}: budget")
    return None


def check_priced(
    spec: accelerators.AcceleratorSpec,
    budget: float | None,
    pool_name: str,
    prices: Any,
    fallbacks: tuple[accelerators.AcceleratorSpec, ...] = (),
    source: PriceSource = PriceSource.CLOUD_CATALOG,
) -> None:
    """A budget can only be enforced with a price for the accelerator (spot or on-demand, as the call runs), and
    for every entry of a fallback list: the call may land on any of them. ``source``: the built-in table of the
    pool's launcher, under the pool's ``prices``."""
    overrides = cost.load_prices(prices, origin=f"pool {pool_name!r}'s prices")
    if budget is None:
        return
    for choice in (spec, *fallbacks):
        if cost.host_rate(choice, cost.price_for(choice, overrides, source), choice.spot) is None:
            raise cost.PriceTableError(_unpriced_message(choice, budget, pool_name, bool(fallbacks)))


def _unpriced_message(spec: accelerators.AcceleratorSpec, budget: float, pool_name: str, in_list: bool) -> str:
    kind = "spot" if spec.spot else "on-demand"
    return (
        f"max_cost_usd={budget:g}: pool {pool_name!r} has no {kind} price for accelerator {spec.name!r}"
        + (" (an entry of the fallback list)" if in_list else "")
        + f", so the budget could not be enforced. Give the pool one, e.g. `kinetic-prefect pool-set {pool_name} "
        f'\'prices={{"{spec.name}": {{"on_demand": 0.5, "spot": 0.2}}}}\'`, or drop max_cost_usd.'
    )


async def call_budget(client: Any, task_budget: float | None, pool: Any, pool_variables: set[str]) -> float | None:
    """The budget this call runs under (task's or pool's, capped by the flow run's remainder), checked."""
    from prefect.context import FlowRunContext

    from kinetic_prefect.caller import _prefect

    budget = (
        task_budget
        if task_budget is not None
        else cost.check_budget(_prefect.pool_default(pool, "max_cost_usd"), what=f"pool {pool.name!r}'s max_cost_usd")
    )
    context = FlowRunContext.get()
    flow_run = context.flow_run if context is not None else None
    limit = flow_budget(flow_run.tags) if flow_run is not None else None
    if limit is not None and flow_run is not None:
        from kinetic_prefect.shared.cost_records import flow_cost

        spent = (await flow_cost(client, flow_run.id)).total_usd
        left = limit - spent
        if left <= 0:
            raise BudgetExceeded(
                f"flow run {flow_run.name!r}: budget of ${limit:g} reached (its kinetic calls cost "
                f"${spent:.4f}); no further call starts"
            )
        budget = left if budget is None else min(budget, left)
    if budget is not None and "max_cost_usd" not in pool_variables:
        raise ValueError(
            f"max_cost_usd={budget:g}: pool {pool.name!r} (type {pool.type!r}) cannot enforce a budget: "
            f"its base job template has no `max_cost_usd` variable (made before budgets). Update it, e.g. "
            f"`prefect work-pool update {pool.name} --base-job-template work_pools/{pool.type}.json`."
        )
    return budget


__all__ = ["call_budget", "check_priced", "flow_budget"]
