"""``kinetic-prefect warm list | down``: the warm runners kept on this machine (kinetic-local's ``keep_warm_seconds``
and ``min_warm``) and the floor pods of kinetic-gke pools (``min_warm``: Jobs labelled
``kinetic.prefect.io/warm-floor``, read through each pool's cluster), what their idle time costs, and ending them.

``down`` ends the idle ones (a runner or pod busy with a call is left to finish it) and does not change the pool: a
pool with ``min_warm`` starts its floor again with its next call. Set ``min_warm=0`` (``kinetic-prefect pool-set P
min_warm=0``) to keep it down, or ``warm_floor_idle_seconds`` to let floor runners and pods leave by themselves. The
idle time of each floor runner or pod ended is published as the pool's cost: the event
``kinetic.work-pool.warm-idle`` on the work pool, with the fields of a job's ``kinetic.job.cost`` (accelerator,
spot, hosts, minutes, usd_per_hour, usd); the pricing and the event are ``kinetic_prefect.shared.warm_idle``'s.
A floor runner that leaves by its ``warm_floor_idle_seconds`` is billed the same way: a kinetic-local one by the
process that started it (``workers.local.warm``); a kinetic-gke pod leaves a record in its store, which the next
launcher handing its pool a call, or ``list`` and ``down`` here, publish (``workers.gke.warm.bill_left_floor_pods``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import typer

from kinetic_prefect import config
from kinetic_prefect.contract import WARM_IDLE_EVENT
from kinetic_prefect.shared import cost, warm_idle
from kinetic_prefect.workers.local import warm


@dataclass
class Row:
    """One warm runner (kinetic-local) or floor pod (kinetic-gke) as ``list`` and ``down`` show it."""

    runner: str  # a runner's pid; a floor pod's namespace/job
    pool: str | None
    accelerator: str
    since: float
    floor: bool
    idle_since: float | None  # None: busy with a call
    calls: int
    end: Callable[[], bool]  # ends it if it is idle; False: busy, left running

    def idle_seconds(self, now: float) -> float:
        return 0.0 if self.idle_since is None else max(0.0, now - self.idle_since)


warm_app = typer.Typer(
    name="warm",
    help="Warm runners (kinetic-local) and floor pods (kinetic-gke): list them and what their idle time costs; "
    "end them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _pool_prices(pool: str | None, cache: dict[str | None, tuple[Any, dict]]) -> tuple[Any, dict]:
    """The work pool (or None) and its prices, read once per pool."""
    if pool not in cache:
        cache[pool] = warm_idle.pool_prices(pool)
    return cache[pool]


def idle_cost(info: Row, prices: dict, now: float) -> cost.JobCost:
    """A runner's idle time as a one-host job's cost at the pool's price for its accelerator."""
    return warm_idle.idle_cost(info.accelerator, info.idle_since or now, now, prices)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.1f}min"


def _local_rows(pool: str | None) -> list[Row]:
    return [
        Row(
            str(r.pid),
            r.pool,
            r.accelerator,
            r.since,
            r.floor,
            r.idle_since,
            r.calls,
            functools.partial(warm.stop_idle, r),
        )
        for r in warm.list_runners(config.cache_dir() / "warm", pool)
    ]


def _pool_floor_pods(work_pool: Any) -> Callable[[Any], list[tuple[Any, Callable[[], bool]]]] | None:
    """The hook of the pool's worker class that lists its floor pods in a cluster (``floor_pods``), or None: a
    launcher whose warm runners live on this machine (read above), or a type not installed here."""
    from kinetic_prefect import workers

    return getattr(workers.find(work_pool.type), "floor_pods", None)


def _cluster_rows(pool: str | None, problems: list[str]) -> list[Row]:
    """The floor pods of ``pool`` (else of every pool whose launcher keeps them in a cluster)."""
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            pools = [client.read_work_pool(pool)] if pool else client.read_work_pools()
    except Exception:  # no server, no such pool: only this machine's runners
        return []
    rows = []
    for work_pool in pools:
        lister = _pool_floor_pods(work_pool)
        if lister is None:
            continue
        try:
            pods = lister(work_pool)
        except Exception as exc:  # noqa: BLE001 - one unreachable cluster does not hide the others
            problems.append(f"pool {work_pool.name}: its floor pods could not be read ({type(exc).__name__}: {exc})")
            continue
        rows += [Row(p.runner, p.pool, p.accelerator, p.since, True, p.idle_since, p.calls, end) for p, end in pods]
    return rows


def _rows(pool: str | None, problems: list[str]) -> list[tuple[Row, cost.JobCost]]:
    now, cache = time.time(), {}  # type: ignore[var-annotated]
    runners = _local_rows(pool) + _cluster_rows(pool, problems)
    return [(info, idle_cost(info, _pool_prices(info.pool, cache)[1], now)) for info in runners]


def _rows_or_say_none(pool: str | None) -> list[tuple[Row, cost.JobCost]]:
    """The warm runners and floor pods, after printing what could not be read; says so when there are none."""
    problems: list[str] = []
    rows = _rows(pool, problems)
    _say_problems(problems)
    if not rows:
        print("No warm runners.")
    return rows


def _say_problems(problems: list[str]) -> None:
    for problem in problems:
        print(problem)


@warm_app.command("list")
def list_command(pool: str | None = typer.Option(None, "--pool", help="only this work pool's runners")) -> None:
    """Each warm runner on this machine and each floor pod of the kinetic-gke pools: pool, accelerator, runner (pid
    or namespace/Job), since, idle for, calls served, floor, idle cost."""
    rows = _rows_or_say_none(pool)
    if not rows:
        return
    now = time.time()
    width = max(7, *(len(info.runner) for info, _ in rows))
    print(
        f"{'POOL':20}  {'ACCELERATOR':12}  {'RUNNER':>{width}}  {'SINCE':19}  {'IDLE FOR':9}  {'CALLS':>5}  FLOOR  "
        "IDLE COST"
    )
    for info, idle in rows:
        since = datetime.fromtimestamp(info.since, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
        idle_for = "busy" if info.idle_since is None else _ago(info.idle_seconds(now))
        calls = "-" if info.calls < 0 else str(info.calls)
        usd = "unpriced" if idle.usd is None else f"${idle.usd:.4f}"
        print(
            f"{(info.pool or '-')[:20]:20}  {info.accelerator[:12]:12}  {info.runner:>{width}}  {since:19}  "
            f"{idle_for:9}  {calls:>5}  {'yes' if info.floor else 'no':5}  {usd}"
        )


def publish_idle(info: Row, idle: cost.JobCost, work_pool: Any) -> None:
    """The ended floor runner's or pod's idle time as the pool's cost (an event; it never fails the command)."""
    who = warm_idle.IdleRunner(info.runner, info.pool, info.accelerator, info.floor, info.calls)
    warm_idle.publish_idle(who, idle, work_pool, drain=True)


@warm_app.command("down")
def down_command(
    pool: str | None = typer.Option(None, "--pool", help="only this work pool's runners"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """End the idle warm runners and floor pods (busy ones finish their call). The pool is not changed: with
    min_warm its next call starts the floor again; `kinetic-prefect pool-set P min_warm=0` keeps it down."""
    rows = _rows_or_say_none(pool)
    if not rows:
        return
    if not yes and not typer.confirm(f"End {len(rows)} warm runner(s)?"):
        raise typer.Exit(1)
    cache: dict[str | None, tuple[Any, dict]] = {}
    ended = 0
    for info, idle in rows:
        if not info.end():
            print(
                f"runner {info.runner} ({info.pool or '-'}, {info.accelerator}) is busy with a call: left to finish it"
            )
            continue
        ended += 1
        usd = "unpriced" if idle.usd is None else f"${idle.usd:.4f}"
        print(
            f"ended runner {info.runner} ({info.pool or '-'}, {info.accelerator}), idle {idle.minutes:.2f} min: {usd}"
        )
        if info.floor:
            publish_idle(info, idle, _pool_prices(info.pool, cache)[0])
    floors = sorted({info.pool or "-" for info, _ in rows if info.floor})
    print(f"{ended} warm runner(s) ended.")
    if floors:
        print(
            f"min_warm floor of {', '.join(floors)}: its next call starts it again; "
            "`kinetic-prefect pool-set POOL min_warm=0` keeps it down."
        )


__all__ = ["WARM_IDLE_EVENT", "Row", "idle_cost", "warm_app"]
