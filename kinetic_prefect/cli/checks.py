"""``kinetic-prefect doctor`` and ``pool-set``: check that jobs can run here, and set a pool's variable defaults (the
checks themselves are ``cli.doctor``'s)."""

from __future__ import annotations

import json
import sys

import typer
from rich.markup import escape

from kinetic_prefect.cli.console import ClickException, make_console
from kinetic_prefect.contract import Env

_SYMBOLS = {"ok": "[green]✓[/]", "fail": "[red]✗[/]", "warn": "[yellow]![/]", "skip": "[dim]-[/]"}


def doctor_command(
    pool: str | None = typer.Option(
        None, "--pool", metavar="NAME", help=f"the kinetic work pool (default: ${Env.WORK_POOL} or kinetic-local)"
    ),
    accelerator: list[str] | None = typer.Option(
        None, "--accelerator", "-a", metavar="NAME", help="also check a node pool for this accelerator (repeatable)"
    ),
    store: str | None = typer.Option(None, "--store", metavar="URL", help="check this store instead of the pool's"),
    deployments: bool = typer.Option(
        False,
        "--deployments",
        help="also check every deployment with an active schedule: its pools exist, a worker polls them",
    ),
    gke_cluster: str | None = typer.Option(
        None,
        "--gke-cluster",
        metavar="projects/P/locations/L/clusters/C",
        help="read node pools from this GKE cluster when the kube context is not named gke_P_L_C",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the checks as JSON"),
) -> None:
    """Check that kinetic jobs can run here: Prefect API, work pool, store, and for GKE the cluster and images.

    Exits 1 when any check fails; each failure prints its fix."""
    from kinetic_prefect.cli.doctor import check_options, run_checks

    try:
        check_options(gke_cluster)
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    report = run_checks(
        pool=pool, accelerator=list(accelerator or []), store=store, deployments=deployments, gke_cluster=gke_cluster
    )
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        console = make_console()
        console.print(
            f"[bold]kinetic-prefect doctor[/]: pool {escape(report.pool)!s}"
            f" ({escape(report.pool_type or '?')}), store {escape(report.store or '?')}"
        )
        width = max(len(c.name) for c in report.checks)
        for check in report.checks:
            console.print(f" {_SYMBOLS[check.status]} {escape(check.name.ljust(width))}  {escape(check.detail)}")
            if check.fix and check.status in ("fail", "warn"):
                console.print(f"   {' ' * width}  [bold]fix:[/] {escape(check.fix)}")
        failed = sum(c.status == "fail" for c in report.checks)
        console.print("[green]All checks passed.[/]" if not failed else f"[red]{failed} check(s) failed.[/]")
    if not report.ok:
        raise typer.Exit(1)


def pool_set_command(
    pool: str = typer.Argument(..., help="work pool name"),
    assignments: list[str] = typer.Argument(
        ..., metavar="KEY=VALUE...", help="job variable defaults (JSON values parse; KEY= clears)"
    ),
) -> None:
    """Set defaults of a work pool's job variables, e.g. `pool-set gpu gcp_project=my-project store=gs://b/k`."""
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect.cli.doctor import set_pool_variables

    _check_prices(pool, assignments)
    try:
        changed = set_pool_variables(pool, assignments)
    except ObjectNotFound:
        raise ClickException(f"work pool {pool!r} does not exist") from None
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    for key, value in changed.items():
        sys.stdout.write(f"{pool}: {key} = {json.dumps(value)}\n")


def _check_prices(pool: str, assignments: list[str]) -> None:
    """A ``prices=`` value is read as a call reads it, before anything is written: an unknown accelerator is
    refused here, naming it and the closest catalog names, not at the pool's next call. A price file's path is
    read only where it exists on this machine (it may name a file on the workers' machines)."""
    from pathlib import Path

    from kinetic_prefect.shared.cost import PriceTableError, load_prices

    for item in assignments:
        key, _, raw = item.partition("=")
        if key != "prices" or not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw  # as set_pool_variables stores it: a path, or JSON text that load_prices reports on
        if isinstance(value, str) and not value.strip().startswith("{") and not Path(value).expanduser().is_file():
            continue
        try:
            load_prices(value, origin=f"pool-set {pool} prices")
        except PriceTableError as exc:
            raise ClickException(f"{str(exc).rstrip('.')}. Nothing was changed.") from None


def register(app: typer.Typer) -> None:
    """Add ``doctor`` and ``pool-set`` to the ``kinetic-prefect`` app."""
    app.command("doctor")(doctor_command)
    app.command("pool-set")(pool_set_command)
