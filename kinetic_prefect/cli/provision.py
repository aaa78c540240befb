"""``kinetic-prefect up`` / ``down`` / ``pool add|remove|list``: what a platform's pools run on, made from zero and
removed again. ``--platform`` names a registered launcher's provisioning (its ``commands`` module's ``provisioning()``,
``workers.provisioning``): gke, the GKE cluster, node pools, registry, bucket, worker and work pool
(``workers.gke.provision``); vertex, no cluster (``workers.vertex.provision``). ``pool`` is GKE's node pools.

    kinetic-prefect up --platform vertex --project P [--region R] [--pool-name NAME] [--dry-run] [--yes]
    kinetic-prefect down --platform vertex --project P [--region R] [--delete-data] [--delete-signing-key] [--dry-run]
    kinetic-prefect up --project P --zone Z [--cluster NAME] [--accelerator A ...] [--spot] [--reservation R]
                       [--min-nodes N] [--pool-name NAME] [--worker-image IMAGE] [--dry-run] [--yes]
    kinetic-prefect down --project P --zone Z [--cluster NAME] [--pool-name NAME] [--delete-data]
                         [--delete-signing-key] [--dry-run] [--yes]
    kinetic-prefect pool add ACCELERATOR --project P --zone Z [--cluster NAME] [--spot] [--reservation R]
                       [--min-nodes N] [--preload-disk-image IMAGE] [--dry-run]
    kinetic-prefect pool remove ACCELERATOR|NODE_POOL --project P --zone Z [--cluster NAME] [--spot] [--dry-run]
                       [--yes]
    kinetic-prefect pool list --project P --zone Z [--cluster NAME] [--json]

Every option is checked before the first request; each resource is looked up before anything is made, and what
exists is kept, so a second ``up`` changes nothing and one that failed halfway resumes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Typer carries its own copy of click; its ClickException is the base of typer.BadParameter.
ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

pool_app = typer.Typer(
    name="pool", help="Accelerator node pools of the cluster: add, remove, list.", no_args_is_help=True
)

_INSTALL = (
    "provisioning needs the gcp and k8s extras: uv sync --inexact --extra gcp --extra k8s in the checkout "
    "(pip: pip install -e '.[gcp,k8s]')"
)
_PROJECT = typer.Option(None, "--project", envvar="GOOGLE_CLOUD_PROJECT", metavar="PROJECT_ID", help="GCP project ID")
_ZONE = typer.Option(..., "--zone", metavar="ZONE", help="the cluster's zone, e.g. us-central1-a")
_CLUSTER = typer.Option("kinetic-cluster", "--cluster", metavar="NAME", help="GKE cluster name")
# No default value here: the provisioning names the pool (after its type); it is imported only when a command runs.
_POOL_NAME = typer.Option(
    None, "--pool-name", metavar="NAME", help="the kinetic-gke work pool  [default: kinetic-gke]", show_default=False
)
_SPOT = typer.Option(False, "--spot", help="Spot VMs (cheaper, may be preempted)")
_RESERVATION = typer.Option(None, "--reservation", metavar="NAME", help="consume this Compute Engine reservation")
_MIN_NODES = typer.Option(0, "--min-nodes", metavar="N", help="nodes kept running (default 0: scale to zero)")
_YES = typer.Option(False, "--yes", "-y", help="do not ask before changing anything")
_DRY_RUN = typer.Option(False, "--dry-run", help="print the plan (exists / will create) and change nothing")
_DRY_RUN_DELETE = typer.Option(False, "--dry-run", help="print what would be deleted and delete nothing")
NODE_POOLS_PLATFORM = "gke"  # `pool add|remove|list`: the node pools of a GKE cluster
_PLATFORM = typer.Option("gke", "--platform", help="gke (a cluster) or vertex (Vertex AI: no cluster)")
_REGION = typer.Option(None, "--region", metavar="REGION", help="vertex: the jobs' region (default us-central1)")
_STATE_STYLE = {"exists": "green", "will create": "yellow", "will update": "yellow", "will delete": "red"}


def _console() -> Console:
    return Console(file=sys.stdout, soft_wrap=True, highlight=False)


def make_clients(project: str, platform: Any) -> Any:
    """The platform's Google (and Kubernetes) clients (tests replace this with fakes that record the requests)."""
    return platform.make_clients(project)


def _platform(name: str) -> Any:
    """The provisioning of the launcher whose ``--platform`` name is ``name`` (its ``commands`` module's
    ``PLATFORM`` and ``provisioning()``); the CLI knows no platform by name, and imports no other launcher."""
    from kinetic_prefect import workers

    sides = workers.commands_modules()
    named = sorted(side.PLATFORM for side in sides if hasattr(side, "PLATFORM"))
    for side in sides:
        if getattr(side, "PLATFORM", None) == name:
            try:
                return side.provisioning()
            except ModuleNotFoundError as missing:
                raise ClickException(f"--platform {name!r}: {missing.name} is not installed: {_INSTALL}") from None
    raise ClickException(f"--platform {name!r}: the launchers provision {', '.join(named) or 'nothing'}")


def _provision() -> Any:
    try:
        from kinetic_prefect.workers.gke.provision import commands
    except ModuleNotFoundError as missing:
        raise ClickException(f"{missing.name} is not installed: {_INSTALL}") from None
    return commands


_NO_CREDENTIALS = (
    "no Google credentials: run `gcloud auth application-default login` "
    "(or set GOOGLE_APPLICATION_CREDENTIALS to a service account key file)"
)


def _without_credentials(exc: BaseException) -> bool:
    try:
        from google.auth.exceptions import DefaultCredentialsError
    except ModuleNotFoundError:
        return False
    return isinstance(exc, DefaultCredentialsError)


def _clients(project: str, platform: Any) -> Any:
    try:
        clients = make_clients(project, platform)
    except Exception as exc:
        if _without_credentials(exc):
            raise ClickException(_NO_CREDENTIALS) from None
        raise
    console = _console()
    clients.say = lambda line: console.print(escape(line))
    return clients


def _show(title: str, planned: list[Any]) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("resource", "name", "state", "detail"):
        table.add_column(column, overflow="fold")
    for step in planned:
        style = _STATE_STYLE.get(step.state, "dim")
        table.add_row(step.kind, escape(step.name), f"[{style}]{step.state}[/]", escape(step.note))
    console = _console()
    console.width = max(console.width, 140)
    console.print(table)


def _run(title: str, planned: list[Any], *, dry_run: bool, yes: bool, question: str, rerun: str) -> None:
    from kinetic_prefect.workers import provisioning

    _show(title, planned)
    todo = [s for s in planned if s.action is not None]
    if dry_run or not todo:
        _console().print("dry run: nothing was changed." if dry_run else "Nothing to do.")
        return
    if not yes:
        typer.confirm(question.format(n=len(todo)), abort=True)
    try:
        provisioning.apply(planned, _console().print)
    except provisioning.StepFailed as failed:
        made = ", ".join(f"{s.kind} {s.name}" for s in failed.done) or "nothing"
        raise ClickException(f"{failed}\ndone before it: {made}. {rerun}") from None


def _guard(call: Any) -> Any:
    from kinetic_prefect.workers.provisioning import ProvisionError

    try:
        return call()
    except ProvisionError as exc:
        raise ClickException(str(exc)) from None
    except Exception as exc:  # a client that looks its credentials up late (the cluster's Kubernetes API)
        if _without_credentials(exc):
            raise ClickException(_NO_CREDENTIALS) from None
        raise


def up_command(
    project: str | None = _PROJECT,
    zone: str | None = typer.Option(None, "--zone", metavar="ZONE", help="gke: the cluster's zone, e.g. us-central1-a"),
    cluster: str = _CLUSTER,
    accelerator: list[str] | None = typer.Option(
        None, "--accelerator", "-a", metavar="NAME", help="gke: a node pool for this accelerator (repeatable)"
    ),
    spot: bool = _SPOT,
    reservation: str | None = _RESERVATION,
    min_nodes: int = _MIN_NODES,
    pool_name: str | None = _POOL_NAME,
    worker_image: str | None = typer.Option(
        None, "--worker-image", metavar="IMAGE", help="gke: run a worker in the cluster from this image"
    ),
    dry_run: bool = _DRY_RUN,
    yes: bool = _YES,
    platform: str = _PLATFORM,
    region: str | None = _REGION,
) -> None:
    """Make what a platform's pools run on; what exists is kept. gke: the GKE cluster, its accelerator node pools,
    the image registry, the store bucket, the in-cluster worker and the kinetic-gke work pool. vertex: no cluster
    (APIs, registry, bucket, the jobs' service account, the kinetic-vertex pool; see docs/vertex.md)."""
    from kinetic_prefect.workers.provisioning import Options

    chosen = _platform(platform)
    options = Options(
        project=project,
        zone=zone,
        region=region,
        cluster=cluster,
        accelerators=tuple(accelerator or ()),
        spot=spot,
        reservation=reservation,
        min_nodes=min_nodes,
        pool_name=pool_name,
        worker_image=worker_image,
    )
    plan = _guard(lambda: chosen.plan_up(options, lambda p: _clients(p, chosen)))
    _run(plan.title, plan.steps, dry_run=dry_run, yes=yes, question=plan.question, rerun=plan.rerun)
    if not dry_run:
        for line in plan.next_steps:
            _console().print(escape(line))


def down_command(
    project: str | None = _PROJECT,
    zone: str | None = typer.Option(None, "--zone", metavar="ZONE", help="gke: the cluster's zone"),
    cluster: str = _CLUSTER,
    pool_name: str | None = _POOL_NAME,
    delete_data: bool = typer.Option(False, "--delete-data", help="also delete the bucket when it holds objects"),
    delete_signing_key: bool = typer.Option(
        False, "--delete-signing-key", help="also delete the signing key (objects signed with it stop verifying)"
    ),
    dry_run: bool = _DRY_RUN_DELETE,
    yes: bool = _YES,
    platform: str = _PLATFORM,
    region: str | None = _REGION,
) -> None:
    """Delete what `up` made (gke: the work pool, the cluster with its node pools and worker, the registry, the
    bucket; vertex: the work pool, registry, bucket and the jobs' service account); a bucket that holds objects is
    kept unless --delete-data, the signing key unless --delete-signing-key."""
    from kinetic_prefect.workers.provisioning import Options

    chosen = _platform(platform)
    options = Options(
        project=project,
        zone=zone,
        region=region,
        cluster=cluster,
        pool_name=pool_name,
        delete_data=delete_data,
        delete_signing_key=delete_signing_key,
    )
    plan = _guard(lambda: chosen.plan_down(options, lambda p: _clients(p, chosen)))
    _run(plan.title, plan.steps, dry_run=dry_run, yes=yes, question=plan.question, rerun=plan.rerun)


@pool_app.command("add")
def pool_add_command(
    accelerator: str = typer.Argument(..., metavar="ACCELERATOR", help="e.g. l4, a100x4, tpu-v6e-16, h100:spot"),
    project: str | None = _PROJECT,
    zone: str = _ZONE,
    cluster: str = _CLUSTER,
    spot: bool = _SPOT,
    reservation: str | None = _RESERVATION,
    min_nodes: int = _MIN_NODES,
    preload_disk_image: str | None = typer.Option(
        None,
        "--preload-disk-image",
        metavar="IMAGE",
        help="a disk image holding the pipeline's container images (GKE's gke-disk-image-builder makes it): each "
        "new node gets it as a secondary boot disk, so the job's image is on the node when it joins",
    ),
    dry_run: bool = _DRY_RUN,
) -> None:
    """Add a node pool for an accelerator (autoscaling from --min-nodes, 0 by default; image streaming on)."""
    commands = _provision()
    from kinetic_prefect.workers.gke.provision import plan

    settings = _guard(lambda: plan.settings(project, zone, cluster))
    pool = _guard(
        lambda: plan.node_pool_spec(
            accelerator,
            spot=spot,
            reservation=reservation,
            min_nodes=min_nodes,
            preload_disk_image=preload_disk_image,
        )
    )
    clients = _clients(settings.project, _platform(NODE_POOLS_PLATFORM))
    planned = _guard(lambda: commands.plan_pool_add(clients, settings, pool))
    _run(
        f"kinetic-prefect pool add: {settings.cluster}",
        planned,
        dry_run=dry_run,
        yes=True,  # a pool scaled to zero costs nothing until a job asks for it
        question="",
        rerun="Run the same `kinetic-prefect pool add` again to retry.",
    )


@pool_app.command("remove")
def pool_remove_command(
    target: str = typer.Argument(..., metavar="ACCELERATOR|NODE_POOL", help="an accelerator, or a node pool's name"),
    project: str | None = _PROJECT,
    zone: str = _ZONE,
    cluster: str = _CLUSTER,
    spot: bool = typer.Option(False, "--spot", help="the accelerator's Spot pools"),
    dry_run: bool = _DRY_RUN_DELETE,
    yes: bool = _YES,
) -> None:
    """Delete a node pool: the one named, or those of the accelerator (asks first unless --yes)."""
    commands = _provision()
    from kinetic_prefect.workers.gke.provision import plan

    settings = _guard(lambda: plan.settings(project, zone, cluster))
    clients = _clients(settings.project, _platform(NODE_POOLS_PLATFORM))
    planned = _guard(lambda: commands.plan_pool_remove(clients, settings, target, spot))
    _run(
        f"kinetic-prefect pool remove: {settings.cluster}",
        planned,
        dry_run=dry_run,
        yes=yes,
        question="Delete {n} node pool(s)? Jobs running on them are stopped",
        rerun="Run the same `kinetic-prefect pool remove` again to finish.",
    )


@pool_app.command("list")
def pool_list_command(
    project: str | None = _PROJECT,
    zone: str = _ZONE,
    cluster: str = _CLUSTER,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """The cluster's node pools: accelerator, spot, reservation, min/max and current nodes."""
    import dataclasses

    commands = _provision()
    from kinetic_prefect.workers.gke.provision import plan

    settings = _guard(lambda: plan.settings(project, zone, cluster))
    rows = _guard(lambda: commands.pool_rows(_clients(settings.project, _platform(NODE_POOLS_PLATFORM)), settings))
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
        return
    table = Table(title=f"node pools of {settings.cluster}", title_justify="left")
    for column in ("name", "accelerator", "spot", "reservation", "min", "max", "nodes", "status"):
        table.add_column(column)
    for r in rows:
        nodes = "?" if r.nodes is None else str(r.nodes)
        spot_text = "yes" if r.spot else "no"
        table.add_row(
            r.name, r.accelerator, spot_text, r.reservation or "-", str(r.min_nodes), str(r.max_nodes), nodes, r.status
        )
    console = _console()
    console.width = max(console.width, 120)
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``up``, ``down`` and ``pool`` to the ``kinetic-prefect`` app."""
    app.command("up")(up_command)
    app.command("down")(down_command)
    app.add_typer(pool_app)
