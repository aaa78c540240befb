"""The core of ``kinetic-prefect doctor``, shared by its command (``cli/doctor.py``) and the checks each launcher
adds for its own pools (``workers/<launcher>/doctor.py``, reached through the worker class's ``doctor`` hook): the
report and its checks, the fix a check names, the store's credentials, and the accelerators a pool is asked for.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.contract import Env

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"
Problem = tuple[str, str, str]  # (status, detail, fix)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Report:
    pool: str
    pool_type: str | None = None
    store: str | None = None
    accelerators: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def add(self, name: str, status: str, detail: str, fix: str = "") -> Check:
        check = Check(name, status, detail, fix)
        self.checks.append(check)
        return check

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "pool": self.pool,
            "pool_type": self.pool_type,
            "store": self.store,
            "accelerators": self.accelerators,
            "checks": [asdict(c) for c in self.checks],
        }


def quoted(value: str) -> str:
    return shlex.quote(str(value))


def pool_set(pool: str, **settings: str) -> str:
    """The ``kinetic-prefect pool-set`` command that sets ``settings`` on ``pool`` (a check's fix)."""
    return "kinetic-prefect pool-set " + quoted(pool) + " " + " ".join(f"{k}={quoted(v)}" for k, v in settings.items())


def error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def pool_variable(pool: Any, name: str) -> Any:
    """The default of the pool's variable ``name`` (None without a pool)."""
    if pool is None:
        return None
    return pool.base_job_template.get("variables", {}).get("properties", {}).get(name, {}).get("default")


def check_gcs_credentials(report: Report) -> bool:
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        import google.auth  # noqa: F401
        from google.cloud import storage  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        report.add(
            "GCS credentials",
            FAIL,
            "the Google Cloud libraries are not installed",
            "install the gcp extra: `uv sync --inexact --extra gcp` in the checkout (pip: `pip install -e '.[gcp]'`)",
        )
        return False
    if emulator:
        report.add("GCS credentials", OK, f"STORAGE_EMULATOR_HOST={emulator}: a GCS emulator, no credentials needed")
        return True
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default()
    except DefaultCredentialsError as exc:
        report.add(
            "GCS credentials",
            FAIL,
            f"no Application Default Credentials: {error_text(exc)}",
            "on a workstation: `gcloud auth application-default login`; elsewhere: "
            "GOOGLE_APPLICATION_CREDENTIALS=/path/key.json, or Workload Identity for pods in GKE",
        )
        return False
    report.add(
        "GCS credentials",
        OK,
        f"Application Default Credentials ({type(credentials).__name__}{', project ' + project if project else ''})",
    )
    return True


def deployment_accelerators(client: Any, pool_name: str) -> dict[str, list[str]]:
    """Accelerator name -> deployments whose flow runs send their kinetic tasks to ``pool_name``
    (``KINETIC_WORK_POOL`` in the deployment's job variables) with an ``accelerator`` parameter."""
    found: dict[str, list[str]] = {}
    try:
        deployments = client.read_deployments()
    except Exception:  # noqa: BLE001 - then only --accelerator counts
        return found
    flows = {}
    for deployment in deployments:
        env = (deployment.job_variables or {}).get("env") or {}
        if env.get(Env.WORK_POOL) != pool_name:
            continue
        accelerator = (deployment.parameters or {}).get("accelerator")
        if not isinstance(accelerator, str) or not accelerator:
            continue
        if deployment.flow_id not in flows:
            try:
                flows[deployment.flow_id] = client.read_flow(deployment.flow_id).name
            except Exception:  # noqa: BLE001
                flows[deployment.flow_id] = "?"
        found.setdefault(accelerator, []).append(f"{flows[deployment.flow_id]}/{deployment.name}")
    return found


def check_accelerator_names(report: Report, names: list[str], where: str) -> None:
    """Each name is in the catalog; ``where`` says what the name means on the pool's launcher."""
    for name in names:
        try:
            spec = accelerators.resolve(name)
        except ValueError as exc:
            report.add(f"Accelerator {name}", FAIL, error_text(exc), "`kinetic-prefect accelerators` lists the names")
            continue
        report.add(f"Accelerator {name}", OK, f"{spec.name} ({spec.family}); {where}")
