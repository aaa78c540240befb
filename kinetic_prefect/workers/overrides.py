"""Worker side: a call widens nothing its pool pins (issue 45, finding 7).

Whoever may create a flow run on a pool sends its job variables, and before this a worker ran whatever they said with
the pool's signing keys: ``command`` and ``inherit_env: ["*"]`` on kinetic-local (any command, the worker's whole
environment), ``service_account_name``, ``namespace`` or another ``cluster_config`` on kinetic-gke. Each pool type's
variables model lists what a call may set (``caller_variables``: ``workers/<launcher>/variables.py``, read from
the worker class registered for the pool's type); the pool pins every other variable. ``refuse_overrides`` says why
a run is refused, and ``PinnedPoolVariables`` refuses it in the worker before anything is built, launched or handed
a key: the run ends Failed with that message.
"""

from __future__ import annotations

from typing import Any

import anyio
from prefect.client.schemas.objects import FlowRun
from prefect.states import Failed

from kinetic_prefect.contract.job_variables import (
    WORKER_ONLY_ENV,
    env_refusal,
    override_refusal,
    pinned_overrides,
    reserved_env_names,
    sent_variables,
)
from kinetic_prefect.workers.base import kinetic_worker_class
from kinetic_prefect.workers.lifecycle import KineticWorker, KineticWorkerResult


def caller_variables(pool_type: str) -> frozenset[str]:
    """What a call may set on a pool of ``pool_type`` (its worker class's variables model's list)."""
    allowed: frozenset[str] = kinetic_worker_class(pool_type).job_configuration_variables.caller_variables
    return allowed


def refuse_overrides(flow_run: Any, configuration: Any, work_pool: Any, deployment: Any = None) -> str | None:
    """Why this run may not start on ``work_pool``, or None: its job variables (its deployment's, then its own) set
    a variable the pool pins to another value than the pool's, or its ``env`` names what only the worker sets or
    no job gets. ``configuration``'s env is looked at too, for a worker-only name that came any other way."""
    allowed = caller_variables(work_pool.type)
    sent = sent_variables(getattr(deployment, "job_variables", None), flow_run.job_variables)
    found = pinned_overrides(allowed, sent, work_pool.base_job_template)
    if found:
        return override_refusal(work_pool.name, allowed, found)
    env = getattr(configuration, "env", None) or {}
    reserved = sorted({*reserved_env_names(sent.get("env")), *(name for name in env if name in WORKER_ONLY_ENV)})
    if reserved:
        return env_refusal(work_pool.name, reserved)
    return None


class PinnedPoolVariables(KineticWorker):
    """Mixed in before the lifecycle: ``run`` refuses a run that widens what the pool pins, then runs the rest."""

    async def run(
        self, flow_run: FlowRun, configuration: Any, task_status: anyio.abc.TaskStatus[str] | None = None
    ) -> KineticWorkerResult:
        work_pool = getattr(self, "_work_pool", None)
        deployment = None
        if flow_run.deployment_id is not None:
            deployment = await self.client.read_deployment(flow_run.deployment_id)
        if work_pool is None:
            refusal: str | None = "Refused: the worker has no pool to check this run's job variables against."
        else:
            refusal = refuse_overrides(flow_run, configuration, work_pool, deployment)
        if refusal is None:
            return await super().run(flow_run, configuration, task_status)
        self.get_flow_run_logger(flow_run).error(refusal)
        await self._propose(flow_run, Failed(message=refusal))
        if task_status is not None:
            task_status.started("refused")
        return KineticWorkerResult(identifier="refused", status_code=0)
