"""``kinetic-prefect warm list | down``: the warm runners kept on this machine (kinetic-local's ``keep_warm_seconds``
and ``min_warm``), what their idle time costs, and ending them.

``down`` ends the idle ones (a runner busy with a call is left to finish it) and does not change the pool: a pool
with ``min_warm`` starts its floor again with its next call. Set ``min_warm=0`` (``kinetic-prefect pool-set P
min_warm=0``) to keep it down, or ``warm_floor_idle_seconds`` to let floor runners leave by themselves. The idle
time of each floor runner ended is published as the pool's cost: the event ``kinetic.work-pool.warm-idle`` on the
work pool, with the fields of a job's ``kinetic.job.cost`` (accelerator, spot, hosts, minutes, usd_per_hour, usd).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import typer

from kinetic_prefect import accelerators, config
from kinetic_prefect.contract import WARM_IDLE_EVENT
from kinetic_prefect.shared import cost
from kinetic_prefect.workers.local import warm

warm_app = typer.Typer(
    name="warm",
    help="Warm runners (kinetic-local): list them and what their idle time costs; end them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _pool_prices(pool: str | None, cache: dict[str | None, tuple[Any, dict]]) -> tuple[Any, dict]:
    """The work pool (or None) and its ``prices`` variable's default, read once per pool; {} when unreadable."""
    if pool not in cache:
        found: tuple[Any, dict] = (None, {})
        if pool:
            try:
                from prefect import get_client

                with get_client(sync_client=True) as client:
                    work_pool = client.read_work_pool(pool)
                default = work_pool.base_job_template["variables"]["properties"].get("prices", {}).get("default")
                found = (work_pool, cost.load_prices(default))
            except Exception:  # no server, no such pool, a bad table: the idle time is shown unpriced
                pass
        cache[pool] = found
    return cache[pool]


def idle_cost(info: warm.RunnerInfo, prices: dict, now: float) -> cost.JobCost:
    """A runner's idle time as a one-host job's cost at the pool's price for its accelerator."""
    try:
        spec = accelerators.resolve(info.accelerator or "cpu")
    except accelerators.UnknownAcceleratorError:
        spec = accelerators.resolve("cpu")
    span = cost.HostSpan(info.idle_since or now, now, spec.spot)
    return cost.job_cost(spec, [span], cost.price_for(spec, prices), now)


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.1f}min"


def _rows(pool: str | None) -> list[tuple[warm.RunnerInfo, cost.JobCost]]:
    now, cache = time.time(), {}  # type: ignore[var-annotated]
    runners = warm.list_runners(config.cache_dir() / "warm", pool)
    return [(info, idle_cost(info, _pool_prices(info.pool, cache)[1], now)) for info in runners]


@warm_app.command("list")
def list_command(pool: str | None = typer.Option(None, "--pool", help="only this work pool's runners")) -> None:
    """Each warm runner on this machine: pool, accelerator, since, idle for, calls served, floor, idle cost."""
    rows = _rows(pool)
    if not rows:
        print("No warm runners.")
        return
    now = time.time()
    print(f"{'POOL':20}  {'ACCELERATOR':12}  {'PID':>7}  {'SINCE':19}  {'IDLE FOR':9}  {'CALLS':>5}  FLOOR  IDLE COST")
    for info, idle in rows:
        since = datetime.fromtimestamp(info.since, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
        idle_for = "busy" if info.idle_since is None else _ago(info.idle_seconds(now))
        calls = "-" if info.calls < 0 else str(info.calls)
        usd = "unpriced" if idle.usd is None else f"${idle.usd:.4f}"
        print(
            f"{(info.pool or '-')[:20]:20}  {info.accelerator[:12]:12}  {info.pid:>7}  {since:19}  {idle_for:9}  "
            f"{calls:>5}  {'yes' if info.floor else 'no':5}  {usd}"
        )


def publish_idle(info: warm.RunnerInfo, idle: cost.JobCost, work_pool: Any) -> None:
    """The ended floor runner's idle time as the pool's cost (an event; it never fails the command)."""
    try:
        from prefect.events import emit_event
        from prefect.events.worker import EventsWorker

        resource = f"prefect.work-pool.{work_pool.id}" if work_pool is not None else f"kinetic.warm-runner.{info.pid}"
        emit_event(
            event=WARM_IDLE_EVENT,
            resource={
                "prefect.resource.id": resource,
                "prefect.resource.name": info.pool or "",
                "kinetic.accelerator": info.accelerator,
            },
            payload={
                "accelerator": idle.accelerator,
                "spot": idle.spot,
                "hosts": 1,
                "minutes": round(idle.minutes, 4),
                "usd_per_hour": idle.usd_per_hour,
                "usd": None if idle.usd is None else round(idle.usd, 6),
                "floor": info.floor,
                "calls": info.calls,
            },
        )
        EventsWorker.drain_all()
    except Exception:
        pass


@warm_app.command("down")
def down_command(
    pool: str | None = typer.Option(None, "--pool", help="only this work pool's runners"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """End the idle warm runners (busy ones finish their call). The pool is not changed: with min_warm its next
    call starts the floor again; `kinetic-prefect pool-set P min_warm=0` keeps it down."""
    rows = _rows(pool)
    if not rows:
        print("No warm runners.")
        return
    if not yes and not typer.confirm(f"End {len(rows)} warm runner(s)?"):
        raise typer.Exit(1)
    cache: dict[str | None, tuple[Any, dict]] = {}
    ended = 0
    for info, idle in rows:
        if not warm.stop_idle(info):
            print(f"runner {info.pid} ({info.pool or '-'}, {info.accelerator}) is busy with a call: left to finish it")
            continue
        ended += 1
        usd = "unpriced" if idle.usd is None else f"${idle.usd:.4f}"
        print(f"ended runner {info.pid} ({info.pool or '-'}, {info.accelerator}), idle {idle.minutes:.2f} min: {usd}")
        if info.floor:
            publish_idle(info, idle, _pool_prices(info.pool, cache)[0])
    floors = sorted({info.pool or "-" for info, _ in rows if info.floor})
    print(f"{ended} warm runner(s) ended.")
    if floors:
        print(
            f"min_warm floor of {', '.join(floors)}: its next call starts it again; "
            "`kinetic-prefect pool-set POOL min_warm=0` keeps it down."
        )


__all__ = ["WARM_IDLE_EVENT", "idle_cost", "warm_app"]
