"""``kinetic-prefect doctor``: is this machine ready to run kinetic jobs, and if not, what to do.

Each check talks to the real thing (the Prefect API, the pool, the store, the cluster) and, when it
fails, says how to fix it. The checks, in order:

- the Prefect API answers;
- the kinetic work pool exists, is a kinetic type, is not paused (workers online are reported);
- the artifact store is readable and writable (a tiny object written, read back and deleted), and for
  ``gs://`` stores, credentials are present (Application Default Credentials or an emulator);
- the pool's launcher's own checks, through its worker class's ``doctor`` hook (``workers/<launcher>/doctor.py``):
  for ``kinetic-gke`` pools the store is ``gs://``, the kube context loads, the cluster has a node with the GKE
  accelerator label of each accelerator the deployments use (plus ``--accelerator``), and the image settings are
  complete (``image``, or ``image_builder`` with what it needs).

The report and what the launchers' checks share are ``shared/doctor.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

from kinetic_prefect import accelerators, config
from kinetic_prefect.contract import WORKER_TYPES, Env
from kinetic_prefect.shared.doctor import (
    FAIL,
    OK,
    SKIP,
    WARN,
    Check,
    Problem,
    Report,
    check_gcs_credentials,
    error_text,
    pool_variable,
    quoted,
)

__all__ = ["Check", "Report", "check_options", "run_checks", "set_pool_variables"]

KINETIC_TYPES = WORKER_TYPES
_TYPES = " or ".join(WORKER_TYPES)  # what a fix names: every kinetic type


def _api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def check_api(report: Report, client) -> bool:
    url = _api_url()
    where = url or "a temporary server started for this command (no PREFECT_API_URL)"
    problem = client.api_healthcheck()
    if problem is not None:
        report.add(
            "Prefect API",
            FAIL,
            f"{where} does not answer: {error_text(problem)}",
            "start a server with `prefect server start` and point clients and workers at it: "
            "`prefect config set PREFECT_API_URL=http://HOST:4200/api` (or `prefect cloud login`)",
        )
        return False
    try:
        version = client.api_version()
    except Exception:  # noqa: BLE001 - the version is only informative
        version = "?"
    detail = f"{where} is healthy (server {version})"
    if url is None:
        detail += "; workers on other machines need a shared server: `prefect server start` and PREFECT_API_URL"
    report.add("Prefect API", OK, detail)
    return True


def check_pool(report: Report, client):
    """The pool (or None when it is missing and cannot be created on first use)."""
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect import workers

    name = report.pool
    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        _check_missing_pool(report, name)
        return None
    report.pool_type = pool.type
    if pool.type not in KINETIC_TYPES:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} is of type {pool.type!r}, not a kinetic worker type",
            f"kinetic tasks need a pool of type {_TYPES}: point {Env.WORK_POOL} at one, "
            f"or create one: `prefect work-pool create NAME --type kinetic-local`",
        )
        return pool
    if workers.find(pool.type) is None:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} is of type {pool.type!r}, but that worker type is not installed here",
            "install kinetic-prefect in this environment (its `prefect.collections` entry point registers "
            "the worker types): `uv sync` in the checkout, or `pip install -e .` from it",
        )
        return pool
    if pool.is_paused:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} ({pool.type}) is paused: polling workers get no runs",
            f"`prefect work-pool resume {quoted(name)}`",
        )
        return pool
    report.add("Work pool", OK, f"{name!r} is of type {pool.type}; {_workers_online(client, name)}")
    return pool


def _check_missing_pool(report: Report, name: str) -> None:
    """The default pool is created on first use; any other missing pool is a failure naming how to create it."""
    if name == config.DEFAULT_WORK_POOL:
        report.pool_type = config.DEFAULT_POOL_TYPE
        report.add(
            "Work pool",
            OK,
            f"{name!r} does not exist yet; kinetic-prefect creates it (type kinetic-local) on first use",
        )
        return
    report.add(
        "Work pool",
        FAIL,
        f"{name!r} does not exist on this Prefect server",
        f"create it: `prefect work-pool create {quoted(name)} --type kinetic-local` (jobs as local processes) "
        f"or `--type kinetic-gke` (Kubernetes Jobs on GKE); or point {Env.WORK_POOL} / --pool at an "
        "existing kinetic pool",
    )


def _workers_online(client: Any, name: str) -> str:
    from prefect.client.schemas.objects import WorkerStatus

    try:
        online = [w.name for w in client.read_workers_for_work_pool(name) if w.status == WorkerStatus.ONLINE]
    except Exception:  # noqa: BLE001 - informative only
        online = []
    if online:
        return f"{len(online)} worker(s) online ({', '.join(online[:3])})"
    return "no worker online: each call runs the pool's worker in-process"


def check_store(report: Report, url: str) -> None:
    from kinetic_prefect.storage import LocalStore, open_store

    is_gcs = url.startswith("gs://")
    if is_gcs and not check_gcs_credentials(report):
        report.add("Store", SKIP, f"{url}: not tried without credentials")
        return
    key = f"doctor/{socket.gethostname()}-{uuid.uuid4().hex[:12]}.txt"
    token = f"kinetic-prefect doctor {uuid.uuid4()}".encode()
    step = "opening"
    store = None
    try:
        store = open_store(url)
        step = "writing"
        store.put_bytes(key, token)
        step = "reading back"
        if store.get_bytes(key) != token:
            raise OSError("the object read back differs from the one written")
        step = "deleting"
        store.delete(key)
        if store.exists(key):
            raise OSError("the object is still there after delete")
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its fix
        if is_gcs:
            fix = (
                "give this identity (and the job pods' service account) read/write on the bucket, e.g. "
                f"`gcloud storage buckets add-iam-policy-binding gs://{url[5:].split('/')[0]} "
                "--member=serviceAccount:SA --role=roles/storage.objectAdmin`; check the bucket exists"
            )
        else:
            fix = (
                f"make {url} a directory this user can write (mkdir -p / chmod u+rwx / chown), or choose another "
                "store: the pool's `store` variable (`kinetic-prefect pool-set POOL store=/writable/dir`) or "
                f"{Env.STORE}"
            )
        report.add("Store", FAIL, f"{url}: failed while {step} a test object: {error_text(exc)}", fix)
        return
    finally:
        if isinstance(store, LocalStore):
            with contextlib.suppress(OSError):
                os.rmdir(store.root / "doctor")
    report.add("Store", OK, f"{url}: wrote, read back and deleted a test object")


# --------------------------------------------------------------------------------------------- GKE


def check_deployments(report: Report, client) -> None:
    """Every deployment with an active schedule: can its runs start (the flows' pool exists, a worker
    polls it), and does the kinetic pool it names (``job_variables.env.KINETIC_WORK_POOL``) exist?"""
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    try:
        deployments = client.read_deployments()
    except Exception as exc:  # noqa: BLE001
        report.add("Deployments", FAIL, f"cannot read deployments: {error_text(exc)}")
        return
    pools: dict[str, Any] = {}

    def pool_state(name: str) -> tuple[Any, int]:
        if name not in pools:
            try:
                found = client.read_work_pool(name)
                online = sum(w.status == WorkerStatus.ONLINE for w in client.read_workers_for_work_pool(name))
            except ObjectNotFound:
                found, online = None, 0
            pools[name] = (found, online)
        return pools[name]

    flows: dict[Any, str] = {}
    scheduled = [d for d in deployments if any(s.active for s in (d.schedules or []))]
    for deployment in scheduled:
        if deployment.flow_id not in flows:
            try:
                flows[deployment.flow_id] = client.read_flow(deployment.flow_id).name
            except Exception:  # noqa: BLE001
                flows[deployment.flow_id] = "?"
        title = f"Deployment {flows[deployment.flow_id]}/{deployment.name}"
        flows_pool = deployment.work_pool_name
        kinetic_pool = ((deployment.job_variables or {}).get("env") or {}).get(Env.WORK_POOL)
        problems = _flows_pool_problems(flows_pool, pool_state) + _kinetic_pool_problems(kinetic_pool, pool_state)
        accelerator = (deployment.parameters or {}).get("accelerator")
        if isinstance(accelerator, str) and accelerator:
            try:
                accelerators.resolve(accelerator)
            except ValueError as exc:
                problems.append((FAIL, error_text(exc), "`kinetic-prefect accelerators` lists the names"))
        if not problems:
            report.add(
                title,
                OK,
                f"flows on {flows_pool!r} ({pools[flows_pool][1]} worker(s) online)"
                + (f", kinetic tasks on {kinetic_pool!r}" if kinetic_pool else ""),
            )
        for status, detail, fix in problems:
            report.add(title, status, detail, fix)
    if not scheduled:
        report.add("Deployments", SKIP, "no deployment has an active schedule (`prefect deploy --all` creates them)")


def _flows_pool_problems(flows_pool: str | None, pool_state: Callable[[str], tuple[Any, int]]) -> list[Problem]:
    """Why a scheduled deployment's runs would not start: no pool, a missing pool, no worker polling it."""
    if not flows_pool:
        return [(FAIL, "has an active schedule but no work pool", "redeploy it with a work pool")]
    found, online = pool_state(flows_pool)
    if found is None:
        return [
            (
                FAIL,
                f"its flows' pool {flows_pool!r} does not exist: scheduled runs never start",
                f"`prefect work-pool create {quoted(flows_pool)} --type process`",
            )
        ]
    if not online:
        return [
            (
                WARN,
                f"no worker polls its flows' pool {flows_pool!r}: scheduled runs will be Late",
                f"`prefect worker start --pool {quoted(flows_pool)}` where {Env.PROJECT_DIR} names "
                "a checkout (see prefect.yaml)",
            )
        ]
    return []


def _kinetic_pool_problems(kinetic_pool: str | None, pool_state: Callable[[str], tuple[Any, int]]) -> list[Problem]:
    """Why the kinetic pool a deployment names (``job_variables.env.KINETIC_WORK_POOL``) cannot take its tasks."""
    if not kinetic_pool:
        return []
    found, _online = pool_state(kinetic_pool)
    if found is None:
        return [
            (
                FAIL,
                f"its kinetic tasks go to pool {kinetic_pool!r}, which does not exist",
                f"`prefect work-pool create {quoted(kinetic_pool)} --type kinetic-gke` (or "
                "kinetic-local), then `kinetic-prefect doctor --pool " + quoted(kinetic_pool) + "`",
            )
        ]
    if found.type not in KINETIC_TYPES:
        return [
            (
                FAIL,
                f"its kinetic tasks go to pool {kinetic_pool!r} of type {found.type!r}",
                f"{Env.WORK_POOL} must name a pool of type {_TYPES}",
            )
        ]
    return []


# --------------------------------------------------------------------------------------------- all


def check_options(gke_cluster: str | None) -> None:
    """Doctor's options, before anything is checked: ``--gke-cluster`` is a cluster's path (ValueError naming the
    form when it is not)."""
    if gke_cluster:
        from kinetic_prefect.workers.gke.doctor import GKECluster

        GKECluster.from_path(gke_cluster)


def _launcher_doctor(pool_type: str | None) -> Callable[..., None]:
    """The checks of the pool's launcher (its worker class's ``doctor`` hook); for a pool that is missing, not a
    kinetic type or not installed here, the default pool type's (what a call would fall back to)."""
    from kinetic_prefect import workers

    for candidate in (pool_type, config.DEFAULT_POOL_TYPE):
        hook = getattr(workers.find(candidate), "doctor", None)
        if hook is not None:
            return hook
    raise LookupError(f"no kinetic worker type is installed here ({', '.join(WORKER_TYPES)})")


def run_checks(
    pool: str | None = None,
    accelerator: list[str] | None = None,
    store: str | None = None,
    deployments: bool = False,
    gke_cluster: str | None = None,
) -> Report:
    """Every check; ``gke_cluster`` (projects/P/locations/L/clusters/C) names the GKE cluster whose node pools are
    read when the kube context's name does not say it (ValueError when malformed, before anything is checked)."""
    import contextlib

    from prefect import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    check_options(gke_cluster)
    report = Report(pool=pool or config.default_work_pool())
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}))
        try:
            client = stack.enter_context(get_client(sync_client=True))
        except Exception as exc:  # noqa: BLE001 - e.g. the ephemeral server did not start in time
            client = None
            report.add(
                "Prefect API",
                FAIL,
                f"{_api_url() or 'the ephemeral server'} is not available: {error_text(exc)}",
                "run a server (`prefect server start`) and `prefect config set PREFECT_API_URL=http://HOST:4200/api`"
                "; without one, a slow machine may need PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90",
            )
        api_ok = client is not None and check_api(report, client)
        pool_obj = check_pool(report, client) if api_ok else None
        if not api_ok:
            report.add("Work pool", SKIP, f"{report.pool!r}: not checked without the Prefect API")
        report.store = store or pool_variable(pool_obj, "store") or config.default_store_url()
        check_store(report, report.store)
        _launcher_doctor(report.pool_type)(report, client, pool_obj, list(accelerator or []), gke_cluster=gke_cluster)
        if deployments and api_ok:
            check_deployments(report, client)
    return report


def set_pool_variables(pool_name: str, assignments: list[str]) -> dict[str, Any]:
    """Set defaults of a pool's job variables (``key=value``; JSON values parse, anything else is a string)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(pool_name)
        template = json.loads(json.dumps(pool.base_job_template))
        properties = template.setdefault("variables", {}).setdefault("properties", {})
        changed: dict[str, Any] = {}
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ValueError(f"{item!r}: expected KEY=VALUE")
            if key not in properties:
                raise ValueError(
                    f"pool {pool_name!r} ({pool.type}) has no variable {key!r}; it has: {', '.join(sorted(properties))}"
                )
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            if raw == "":
                value = None  # unset: no default at all (a null default is not of the variable's type)
                properties[key].pop("default", None)
            else:
                properties[key]["default"] = value
            changed[key] = value
        client.update_work_pool(pool_name, WorkPoolUpdate(base_job_template=template))
    return changed
