"""A floor warm runner's or floor pod's idle time as its pool's cost: priced at the pool's rate for its accelerator
and published as the event ``kinetic.work-pool.warm-idle`` (``contract.WARM_IDLE_EVENT``) on the work pool.

The idle time of a ``min_warm`` runner (kinetic-local) or floor pod (kinetic-gke) is no call's. Whoever ends one
and can reach Prefect publishes it: ``kinetic-prefect warm down`` for each one it ends, and for one that left by
itself at its pool's ``warm_floor_idle_seconds``: a kinetic-local runner's launcher (the polling worker, or the
caller for in-process submission; the runner writes ``WarmRunnerFiles.LEFT`` as it leaves), and for a kinetic-gke
floor pod (``WarmPodKeys.left`` in the store) the next launcher handing its pool a call or ``warm list|down``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.contract import WARM_IDLE_EVENT
from kinetic_prefect.shared import cost
from kinetic_prefect.shared.prices import Price


@dataclass(frozen=True)
class IdleRunner:
    """A warm runner or floor pod whose idle time is billed: ``runner`` is a pid or a pod's ``namespace/Job``."""

    runner: str
    pool: str | None
    accelerator: str
    floor: bool
    calls: int


def idle_cost(accelerator: str, idle_since: float, until: float, prices: dict[str, Price]) -> cost.JobCost:
    """Idle time from ``idle_since`` to ``until`` as a one-host job's cost at the pool's price for ``accelerator``
    (an unknown or empty one: cpu)."""
    try:
        spec = accelerators.resolve(accelerator or "cpu")
    except accelerators.UnknownAcceleratorError:
        spec = accelerators.resolve("cpu")
    span = cost.HostSpan(idle_since, until, spec.spot)
    return cost.job_cost(spec, [span], cost.price_for(spec, prices), until)


def pool_prices(pool: str | None) -> tuple[Any, dict[str, Price]]:
    """The work pool (None: no pool, no server, no such pool) and its ``prices`` variable's default ({} when
    unreadable: the built-in prices)."""
    if not pool:
        return None, {}
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            work_pool = client.read_work_pool(pool)
    except Exception:  # no server, no such pool: the idle time is shown at the built-in prices, on no pool
        return None, {}
    try:
        default = work_pool.base_job_template["variables"]["properties"].get("prices", {}).get("default")
        return work_pool, cost.load_prices(default)
    except Exception:  # a bad table: the built-in prices
        return work_pool, {}


def publish_idle(who: IdleRunner, idle: cost.JobCost, work_pool: Any, drain: bool = False) -> None:
    """``who``'s idle time as the pool's cost: the event on ``prefect.work-pool.<id>`` (on the runner where the
    pool is unknown). It never fails its caller. ``drain``: wait until the event is sent (a command about to exit;
    never in a long-lived process, where it would stop the events worker other threads are using)."""
    try:
        from prefect.events import emit_event
        from prefect.events.worker import EventsWorker

        resource = f"prefect.work-pool.{work_pool.id}" if work_pool is not None else f"kinetic.warm-runner.{who.runner}"
        emit_event(
            event=WARM_IDLE_EVENT,
            resource={
                "prefect.resource.id": resource,
                "prefect.resource.name": who.pool or "",
                "kinetic.accelerator": who.accelerator,
            },
            payload={
                "accelerator": idle.accelerator,
                "spot": idle.spot,
                "hosts": 1,
                "minutes": round(idle.minutes, 4),
                "usd_per_hour": idle.usd_per_hour,
                "usd": None if idle.usd is None else round(idle.usd, 6),
                "floor": who.floor,
                "calls": who.calls,
                "runner": who.runner,
            },
        )
        if drain:
            EventsWorker.drain_all()
    except Exception:  # the cost is a report: it never fails what ended the runner
        pass


__all__ = ["IdleRunner", "idle_cost", "pool_prices", "publish_idle"]
