"""``kinetic-prefect jobs list | status | logs [-f] | result | cancel | cleanup | debug``: Kinetic's job commands, read
from Prefect's records of the jobs' runs and from the store (through kinetic_prefect.kinetic's ``JobHandle``)."""

from __future__ import annotations

import json
import sys

import typer

from kinetic_prefect.contract import DEBUG_PORT

jobs_app = typer.Typer(
    name="jobs",
    help="Kinetic jobs: list them, follow, collect, cancel and clean them up.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _handle(job_id: str):  # noqa: ANN202 - JobHandle, imported lazily (the CLI starts without Prefect)
    from kinetic_prefect.kinetic.job_lookup import attach

    try:
        return attach(job_id)
    except (LookupError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="JOB_ID") from None


@jobs_app.command("list")
def list_command(
    include_finished: bool = typer.Option(False, "--all", help="also jobs that have ended (the latest --limit)"),
    pool: str | None = typer.Option(None, "--pool", help="only jobs of this work pool"),
    limit: int = typer.Option(200, "--limit", help="at most this many jobs"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """The jobs whose runs have not ended: id, function, accelerator, pool, status, created."""
    from kinetic_prefect.kinetic.job_lookup import list_jobs

    jobs = list_jobs(include_finished=include_finished, limit=limit, work_pool=pool)
    rows = [{**job.to_dict(), "status": job.status().value} for job in jobs]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        print("No jobs." if include_finished else "No live jobs (--all lists the ended ones too).")
        return
    print(f"{'JOB ID':36}  {'FUNCTION':24}  {'ACCELERATOR':16}  {'POOL':20}  {'STATUS':9}  CREATED")
    for row in rows:
        print(
            f"{row['job_id']:36}  {row['func_name'][:24]:24}  {row['accelerator'][:16]:16}  "
            f"{row['work_pool'][:20]:20}  {row['status']:9}  {row['created_at'][:19]}"
        )


@jobs_app.command("status")
def status_command(job_id: str = typer.Argument(..., metavar="JOB_ID")) -> None:
    """The job's status (PENDING, RUNNING, SUCCEEDED, FAILED, NOT_FOUND) and its run's Prefect state."""
    job = _handle(job_id)
    state = job.state()
    detail = f" (Prefect: {state.name}{': ' + state.message if state and state.message else ''})" if state else ""
    print(f"{job.job_id}  {job.func_name}  {job.status().value}{detail}")
    rows = _startup_rows(job.job_id)
    if rows:
        print("start-up:")
        for row in rows:
            print(f"  {row['step']:18} {row['at']:12} {row['after']:>10}  {row['note']}".rstrip())


def _startup_rows(job_id: str) -> list[dict[str, str]]:
    """The job run's start-up timeline (the launcher's table artifact), [] where its launcher keeps none."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from kinetic_prefect.contract import STARTUP_ARTIFACT_KEY

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[STARTUP_ARTIFACT_KEY]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(job_id)]),
            ),
            limit=1,
        )
    data = found[0].data if found else None
    if isinstance(data, str):
        data = json.loads(data)
    return data if isinstance(data, list) else []


@jobs_app.command("logs")
def logs_command(
    job_id: str = typer.Argument(..., metavar="JOB_ID"),
    follow: bool = typer.Option(False, "--follow", "-f", help="print the output as it comes, until the job ends"),
    tail: int | None = typer.Option(None, "--tail", "-n", help="only the last N lines"),
) -> None:
    """The job's output (its run's logs)."""
    if follow and tail is not None:
        raise typer.BadParameter("--follow and --tail exclude each other: pick one", param_hint="--follow/--tail")
    job = _handle(job_id)
    if follow:
        job.logs(follow=True)
    else:
        text = job.tail(tail) if tail is not None else job.logs()
        if text:
            print(text)


@jobs_app.command("result")
def result_command(
    job_id: str = typer.Argument(..., metavar="JOB_ID"),
    timeout: float | None = typer.Option(None, "--timeout", help="wait at most this many seconds"),
    cleanup: bool = typer.Option(True, "--cleanup/--no-cleanup", help="delete the payload and result once collected"),
) -> int:
    """Wait for the job and print its value (repr); a failed job prints its exception and exits 1."""
    job = _handle(job_id)
    try:
        value = job.result(timeout=timeout, cleanup=cleanup)
    except TimeoutError as exc:
        print(str(exc), file=sys.stderr)
        return 124
    except Exception as exc:  # the job's own exception (its remote traceback attached)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        remote = getattr(exc, "remote_traceback", None)
        if remote:
            print(remote, file=sys.stderr)
        return 1
    print(repr(value))
    return 0


@jobs_app.command("cancel")
def cancel_command(job_id: str = typer.Argument(..., metavar="JOB_ID")) -> int:
    """Stop the job's machine, then end its run Cancelled (its payload and result deleted, its outputs kept); says
    what it stopped. Exits 1, the run left as it was, when the machine could not be stopped."""
    from kinetic_prefect.kinetic.jobs import JobNotStopped

    job = _handle(job_id)
    try:
        stopped = job.cancel()
    except JobNotStopped as exc:
        print(str(exc), file=sys.stderr)
        return 1
    state = job.state()
    print(f"{job.job_id}  {state.name if state else 'gone'}" + (f": {stopped}" if stopped else ""))
    return 0


@jobs_app.command("cleanup")
def cleanup_command(
    job_id: str = typer.Argument(..., metavar="JOB_ID"),
    k8s: bool = typer.Option(True, "--k8s/--no-k8s", help="stop the job if it still runs"),
    gcs: bool = typer.Option(True, "--gcs/--no-gcs", help="delete its payload, result and outcome in the store"),
) -> None:
    """Stop the job (if it runs) and delete its objects in the store (outputs stay)."""
    job = _handle(job_id)
    job.cleanup(k8s=k8s, gcs=gcs)
    print(f"{job.job_id}  cleaned up")


@jobs_app.command("debug")
def debug_command(
    job_id: str = typer.Argument(..., metavar="JOB_ID"),
    port: int = typer.Option(DEBUG_PORT, "--port", "-p", help="the local port an editor attaches to"),
    wait: float = typer.Option(600.0, "--wait", help="how long to wait for the job to start its debugger (seconds)"),
) -> int:
    """Forward 127.0.0.1:PORT to a debug job's debugpy (debug=True) until it ends or Ctrl-C; prints launch.json."""
    from kinetic_prefect.kinetic.debug import NotADebugJob, forward

    job = _handle(job_id)
    try:
        forward(job, port, wait)
    except NotADebugJob as exc:
        raise typer.BadParameter(str(exc), param_hint="JOB_ID") from None
    except (RuntimeError, TimeoutError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Stopped forwarding; the job goes on (`kinetic-prefect jobs cancel` stops it).", file=sys.stderr)
    return 0


__all__ = ["jobs_app"]
