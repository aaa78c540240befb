"""``kinetic-prefect``: helper commands (the work itself goes through Prefect's own CLI).

    kinetic-prefect doctor [--pool NAME] [--accelerator NAME ...] [--store URL] [--deployments] [--gke-cluster PATH]
                           [--json]
    kinetic-prefect accelerators [--family gpu|tpu|cpu] [--json]
    kinetic-prefect catalog [--write-readme README.md]
    kinetic-prefect pool-set POOL KEY=VALUE ...
    kinetic-prefect gke-worker-image --repository REPOSITORY [--push] [--base-image IMAGE]
    kinetic-prefect gke-worker-manifests --pool NAME (--image IMAGE | --repository REPOSITORY) [--namespace NS]
    kinetic-prefect up | down | pool add|remove|list   (cli.provision: GKE from zero)
    kinetic-prefect jobs list | status | logs [-f] | result | cancel | cleanup   (cli.jobs)
    kinetic-prefect cleanup [--store DIR] [--older-than MINUTES] [--uncollected-older-than MINUTES] [--yes]
    kinetic-prefect cost [--flow-run ID ...] [--deployment FLOW/NAME] [--flow NAME] [--since DATE] [--until DATE]
                         [--last N] [--json]
    kinetic-prefect cost --estimate TASK_OR_ACCELERATORS --minutes N [--hosts N] [--json]

Typer + rich, like Prefect's own CLI. ``main(argv)`` returns the exit status instead of exiting, so
scripts and tests can call it in-process.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kinetic_prefect import accelerators
from kinetic_prefect.contract import Env

# Typer 0.29 carries its own copy of click; its ClickException is the base of typer.BadParameter.
ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

CATALOG_START, CATALOG_END = "<!-- catalog:start -->", "<!-- catalog:end -->"

app = typer.Typer(
    name="kinetic-prefect",
    help="Helper commands for kinetic-prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _console() -> Console:
    # Made per call (not at import), so it writes to whatever sys.stdout is now (pytest's capsys, pipes).
    return Console(file=sys.stdout, soft_wrap=True, highlight=False)


def readme_with_catalog(text: str) -> str:
    """The README text with the generated catalog table between its markers."""
    pattern = re.compile(re.escape(CATALOG_START) + r".*?" + re.escape(CATALOG_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"the README has no {CATALOG_START} ... {CATALOG_END} section")
    block = f"{CATALOG_START}\n{accelerators.markdown_table().rstrip()}\n{CATALOG_END}"
    return pattern.sub(lambda _: block, text)


@app.command("catalog")
def catalog_command(
    write_readme: Path | None = typer.Option(
        None, "--write-readme", metavar="README", help="rewrite the catalog section of this file"
    ),
) -> None:
    """Print the accelerator catalog as a Markdown table (or write it into the README)."""
    if write_readme:
        write_readme.write_text(readme_with_catalog(write_readme.read_text()))
    else:
        sys.stdout.write(accelerators.markdown_table())


@app.command("accelerators")
def accelerators_command(
    family: str | None = typer.Option(None, "--family", metavar="FAMILY", help="only this family: cpu, gpu or tpu"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """List the accelerator names @kinetic_task(accelerator=...) accepts, with what GKE runs them on."""
    specs = [s for s in accelerators.catalog() if family is None or s.family == family]
    if family is not None and not specs:
        raise typer.BadParameter(f"{family!r}: choose cpu, gpu or tpu", param_hint="--family")
    if as_json:
        rows = [
            {
                "name": s.name,
                "family": s.family,
                "chips": s.chips,
                "hosts": s.hosts,
                "chips_per_host": s.chips_per_host,
                "gke_accelerator": s.gke_accelerator,
                "tpu_topology": s.tpu_topology,
                "machine_type": s.machine_type,
                "node_selector": s.node_selector,
            }
            for s in specs
        ]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="kinetic accelerator catalog (any name also takes :spot)")
    for column in ("name", "family", "chips", "hosts x chips/host", "GKE accelerator", "TPU topology", "machine type"):
        table.add_column(column, justify="right" if column == "chips" else "left", no_wrap=True)
    for s in specs:
        table.add_row(
            s.name,
            s.family,
            str(s.chips),
            f"{s.hosts} x {s.chips_per_host}",
            s.gke_accelerator or "-",
            s.tpu_topology or "-",
            s.machine_type,
        )
    console = _console()
    console.width = max(console.width, 120)
    console.print(table)


_SYMBOLS = {"ok": "[green]✓[/]", "fail": "[red]✗[/]", "warn": "[yellow]![/]", "skip": "[dim]-[/]"}


@app.command("doctor")
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
    from kinetic_prefect.cli.doctor import GKECluster, run_checks

    try:
        if gke_cluster:
            GKECluster.from_path(gke_cluster)
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    report = run_checks(
        pool=pool, accelerator=list(accelerator or []), store=store, deployments=deployments, gke_cluster=gke_cluster
    )
    if as_json:
        sys.stdout.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        console = _console()
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


@app.command("pool-set")
def pool_set_command(
    pool: str = typer.Argument(..., help="work pool name"),
    assignments: list[str] = typer.Argument(
        ..., metavar="KEY=VALUE...", help="job variable defaults (JSON values parse; KEY= clears)"
    ),
) -> None:
    """Set defaults of a work pool's job variables, e.g. `pool-set gpu gcp_project=my-project store=gs://b/k`."""
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect.cli.doctor import set_pool_variables

    try:
        changed = set_pool_variables(pool, assignments)
    except ObjectNotFound:
        raise ClickException(f"work pool {pool!r} does not exist") from None
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    for key, value in changed.items():
        sys.stdout.write(f"{pool}: {key} = {json.dumps(value)}\n")


@app.command("gke-worker-image")
def gke_worker_image_command(
    repository: str = typer.Option(
        ...,
        "--repository",
        metavar="REPOSITORY",
        help="where the image goes, e.g. us-docker.pkg.dev/PROJECT/REPO (the image is "
        "REPOSITORY/kinetic-gke-worker:<version>-<digest>)",
    ),
    push: bool = typer.Option(False, "--push", help="docker push the image after building it"),
    base_image: str | None = typer.Option(
        None,
        "--base-image",
        metavar="IMAGE",
        help="the Dockerfile's BASE_IMAGE, Debian-based with Python >= 3.11 "
        "(default: the Dockerfile's, python:3.12-slim)",
    ),
    source: Path | None = typer.Option(
        None,
        "--source",
        metavar="CHECKOUT",
        help="the kinetic-prefect checkout to build (default: the one this kinetic-prefect runs from)",
    ),
    network: str | None = typer.Option(
        None, "--network", metavar="NETWORK", help="passed to `docker build --network` (e.g. host)"
    ),
    ca_bundle: Path | None = typer.Option(
        None,
        "--ca-bundle",
        metavar="FILE",
        help="a CA bundle pip and uv trust during the build (behind a TLS-intercepting proxy); not kept in the image",
    ),
    docker: str = typer.Option("docker", "--docker", metavar="COMMAND", help="the docker CLI to use"),
    print_only: bool = typer.Option(False, "--print", help="only print the image reference; build nothing"),
) -> None:
    """Build the in-cluster kinetic-gke worker image (docker/kinetic-gke-worker.Dockerfile) and print its reference.

    The build log goes to stderr, the reference alone to stdout: IMAGE=$(kinetic-prefect gke-worker-image ...)."""
    from kinetic_prefect.workers.gke import worker_image as gke_worker_image

    base_image = base_image or gke_worker_image.DEFAULT_BASE_IMAGE
    try:
        if print_only:
            image = gke_worker_image.image_reference(repository, source, base_image)
        else:
            extra = gke_worker_image.ca_bundle_files(ca_bundle) if ca_bundle else None
            image = gke_worker_image.build(
                repository,
                source=source,
                base_image=base_image,
                push=push,
                docker=docker,
                network=network,
                extra_files=extra,
            )
    except (gke_worker_image.WorkerImageError, OSError) as exc:
        raise ClickException(str(exc)) from None
    sys.stdout.write(image + "\n")


@app.command("gke-worker-manifests")
def gke_worker_manifests_command(
    pool: str = typer.Option(..., "--pool"),
    image: str | None = typer.Option(
        None, "--image", help="the worker's image (default: the one `gke-worker-image --repository` builds)"
    ),
    repository: str | None = typer.Option(
        None,
        "--repository",
        metavar="REPOSITORY",
        help="name the image `gke-worker-image --repository REPOSITORY` builds from this checkout",
    ),
    base_image: str | None = typer.Option(
        None, "--base-image", metavar="IMAGE", help="the --base-image that image was built with"
    ),
    source: Path | None = typer.Option(None, "--source", metavar="CHECKOUT"),
    namespace: str = typer.Option("default", "--namespace"),
) -> None:
    """Print manifests that run a kinetic-gke worker in a cluster (pipe them to `kubectl apply -f -`)."""
    import yaml

    from kinetic_prefect.workers.gke.deploy import worker_manifests

    if image is None:
        if repository is None:
            raise typer.BadParameter(
                "give --image IMAGE, or --repository REPOSITORY for the image "
                "`kinetic-prefect gke-worker-image --repository REPOSITORY` builds",
                param_hint="'--image'",
            )
        from kinetic_prefect.workers.gke import worker_image as gke_worker_image

        try:
            image = gke_worker_image.image_reference(
                repository, source, base_image or gke_worker_image.DEFAULT_BASE_IMAGE
            )
        except gke_worker_image.WorkerImageError as exc:
            raise ClickException(f"{exc}; or give --image") from None
    sys.stdout.write(yaml.safe_dump_all(worker_manifests(pool, namespace=namespace, image=image), sort_keys=False))


@app.command("cleanup")
def cleanup_command(
    store: str | None = typer.Option(
        None, "--store", metavar="DIR", help=f"the local store (default: {Env.STORE} or ~/.cache/kinetic-prefect/store)"
    ),
    older_than: float = typer.Option(60.0, "--older-than", metavar="MINUTES", help="only what is at least this old"),
    uncollected_older_than: float | None = typer.Option(
        None,
        "--uncollected-older-than",
        metavar="MINUTES",
        help="also results nobody collected, this old (without it results are kept until collected)",
    ),
    yes: bool = typer.Option(False, "--yes", help="delete what is listed (without it: a dry run)"),
) -> None:
    """List (or with --yes remove) what crashed calls and jobs left: payloads whose job wrote no result, empty
    run and checkpoint folders, dead local jobs' folders, jobs' temporary folders, the records of sweeps that are
    over (never a live sweep's, nor its inputs' payloads); uncollected results only with --uncollected-older-than."""
    from kinetic_prefect.cli.cleanup import active_runs, describe, find, remove, store_root

    try:
        root = store_root(store)
        active = active_runs()
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    except Exception as exc:  # the API: without it, objects of running jobs cannot be told apart
        raise ClickException(
            f"cannot read Prefect's unfinished kinetic runs ({type(exc).__name__}: {exc}); "
            "cleanup needs them to leave running jobs alone: check PREFECT_API_URL"
        ) from None
    for name, value in (("--older-than", older_than), ("--uncollected-older-than", uncollected_older_than)):
        if value is not None and value < 0:
            raise ClickException(f"{name} {value:g}: give an age in minutes, 0 or more")
    leftovers = find(
        root,
        older_than * 60,
        active=active,
        uncollected_older_than_s=None if uncollected_older_than is None else uncollected_older_than * 60,
    )
    sys.stdout.write(describe(leftovers, deleting=yes))
    if yes and leftovers:
        sys.stdout.write(f"removed {remove(leftovers)} of {len(leftovers)}\n")


def _print_estimate(target: str | None, minutes: float | None, hosts: int | None, as_json: bool) -> None:
    from kinetic_prefect.cli.cost import estimate, estimate_table

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
    console = _console()
    console.width = max(console.width, 120)
    console.print(estimate_table(rows, minutes))
    console.print("The call runs on the first entry that has capacity; each row is what it would cost there.")
    for row in rows:
        if row.usd is None:  # say why, and where a figure can come from
            console.print(f"{row.accelerator}: {row.note} (a pool's own figure: pool-set POOL 'prices=...')")


@app.command("cost")
def cost_command(
    flow_run: list[str] | None = typer.Option(None, "--flow-run", metavar="ID", help="a flow run (repeatable)"),
    deployment: str | None = typer.Option(None, "--deployment", metavar="FLOW/NAME", help="runs of a deployment"),
    flow_name: str | None = typer.Option(None, "--flow", metavar="NAME", help="runs of a flow"),
    since: datetime | None = typer.Option(None, "--since", metavar="DATE", help="runs started at or after DATE"),
    until: datetime | None = typer.Option(None, "--until", metavar="DATE", help="runs started before DATE"),
    last: int = typer.Option(10, "--last", metavar="N", help="the N most recent runs (0: all in the range)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    estimate: str | None = typer.Option(
        None, "--estimate", metavar="TASK_OR_ACCELERATORS", help="estimate, before running: l4,a100x4 or MODULE:TASK"
    ),
    minutes: float | None = typer.Option(None, "--minutes", metavar="N", help="with --estimate: minutes of run"),
    hosts: int | None = typer.Option(None, "--hosts", metavar="N", help="with --estimate: hosts of a group"),
) -> None:
    """What flow runs' kinetic calls cost, from Prefect's records (the cost artifacts the workers left); with
    --estimate, what a fallback list would cost for --minutes, from the built-in list prices."""
    if estimate is not None or minutes is not None or hosts is not None:
        return _print_estimate(estimate, minutes, hosts, as_json)
    from prefect.utilities.asyncutils import run_coro_as_sync

    from kinetic_prefect.cli.cost import flow_run_costs

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
    console = _console()
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


from kinetic_prefect.cli.jobs import jobs_app  # noqa: E402 - kinetic-prefect jobs ...

app.add_typer(jobs_app)

from kinetic_prefect.cli import provision  # noqa: E402 - kinetic-prefect up | down | pool add|remove|list

provision.register(app)

from kinetic_prefect.cli.warm import warm_app  # noqa: E402 - kinetic-prefect warm list | down

app.add_typer(warm_app)


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns its exit status (usage errors print their message and return 2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        result = typer.main.get_command(app).main(args=args, prog_name="kinetic-prefect", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except ClickException as exc:
        exc.show()
        return exc.exit_code
    except typer.Abort:
        sys.stderr.write("Aborted.\n")
        return 1
    return result if isinstance(result, int) else 0
