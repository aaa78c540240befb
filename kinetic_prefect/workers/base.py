"""Worker side: what every kinetic launcher shares.

A kinetic job does not run Prefect's flow engine: the job runner only writes an outcome record
to the artifact store. So the worker owns the child flow run's states: Running when the job
starts, then Completed or Failed from the outcome record. A job that exits without an outcome
returns a non-zero status and Prefect's BaseWorker reports the run as Crashed, which the caller
turns into a retry with a new job.
"""

from __future__ import annotations

import json
from typing import Any

from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import Abort
from prefect.states import Cancelled, Completed, Failed, Running
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseJobConfiguration, BaseWorkerResult
from pydantic import Field, PrivateAttr

from kinetic_prefect import accelerators, config
from kinetic_prefect.image import ImageSpec

RUNNER_COMMAND = "python -u -m kinetic_prefect.runner"
ENV_BLOCK_VARIABLE = "KINETIC_ENV_BLOCK"


def load_template(worker_type: str) -> dict[str, Any]:
    """The base job template shipped as data in ``work_pools/<type>.json``."""
    return json.loads((config.work_pools_dir() / f"{worker_type}.json").read_text())


class KineticJobConfiguration(BaseJobConfiguration):
    """Fields every kinetic job has; launchers add their own."""

    accelerator: str = Field(default="cpu")
    image_tag: str | None = Field(default=None)
    requirements: list[str] = Field(default_factory=list)
    python_version: str | None = Field(default=None)
    base_image: str | None = Field(default=None)
    store: str | None = Field(default=None)

    # Forwarded environment values (env= of @kinetic_task). Kept out of job variables and manifests:
    # in-process they are handed over in memory; through a polling worker they travel in a Prefect
    # Secret block that the worker reads once and deletes (ENV_BLOCK_VARIABLE names it).
    _secret_env: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def secret_env(self) -> dict[str, str]:
        return self._secret_env

    def set_secret_env(self, values: dict[str, str]) -> None:
        self._secret_env = dict(values)

    async def load_secret_env(self) -> None:
        block_name = self.env.pop(ENV_BLOCK_VARIABLE, None)
        if not block_name:
            return
        from prefect.blocks.system import Secret

        secret = await Secret.aload(block_name)
        value = secret.get()  # Prefect parses JSON secrets back into objects
        self._secret_env = value if isinstance(value, dict) else json.loads(value)
        await Secret.adelete(block_name)

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        if self.command == self._base_flow_run_command():
            self.command = RUNNER_COMMAND
        self.env["KINETIC_STORE"] = self.store or config.default_store_url()
        self.env.setdefault("KINETIC_RUN_PREFIX", f"runs/{flow_run.id}")
        spec = accelerators.resolve(self.accelerator)
        self.env.setdefault("KINETIC_ACCELERATOR", spec.name)
        self.labels["kinetic.accelerator"] = spec.name

    @property
    def image_spec(self) -> ImageSpec:
        kwargs = {"python": self.python_version} if self.python_version else {}
        return ImageSpec(
            requirements=tuple(self.requirements),
            family=accelerators.resolve(self.accelerator).family,
            base_image=self.base_image,
            **kwargs,
        )


class KineticWorkerResult(BaseWorkerResult):
    """``status_code`` 0: an outcome was recorded and the run's final state was set."""


class KineticWorkerMixin:
    """Shared outcome handling, mixed into each launcher's BaseWorker subclass.

    A mixin rather than a BaseWorker subclass: Prefect registers every BaseWorker subclass as
    a worker type, and this is not one.
    """

    client: Any
    get_flow_run_logger: Any

    @classmethod
    def check_accelerator(cls, spec: accelerators.AcceleratorSpec) -> None:
        """Raise before anything is uploaded if this launcher cannot run ``spec``."""

    async def cancellation_requested(self, flow_run: FlowRun) -> bool:
        """True when someone asked Prefect to cancel the run.

        Prefect's workers only cancel runs that have not started: a started run is expected to
        notice by itself through Prefect's flow engine, which kinetic jobs do not run. So the
        worker watches and stops the job itself.
        """
        current = await self.client.read_flow_run(flow_run.id)
        return current.state is not None and (current.state.is_cancelling() or current.state.is_cancelled())

    async def mark_cancelled(self, flow_run: FlowRun, message: str) -> None:
        try:
            await propose_state(self.client, Cancelled(message=message), flow_run_id=flow_run.id)
        except Abort:
            pass

    async def mark_running(self, flow_run: FlowRun, message: str) -> None:
        try:
            await propose_state(self.client, Running(message=message), flow_run_id=flow_run.id)
        except Abort:
            pass

    async def finish_from_outcome(self, flow_run: FlowRun, configuration: KineticJobConfiguration,
                                  exit_code: int, identifier: str) -> KineticWorkerResult:
        """Set Completed/Failed from the job's outcome record; non-zero means 'crashed, no outcome'."""
        logger = self.get_flow_run_logger(flow_run)
        if exit_code != 0:
            return KineticWorkerResult(identifier=identifier, status_code=exit_code)
        from kinetic_prefect.storage import ObjectNotFound, open_store

        store = open_store(configuration.env["KINETIC_STORE"])
        try:
            outcome = json.loads(store.get_bytes(f"{configuration.env['KINETIC_RUN_PREFIX']}/outcome.json"))
        except ObjectNotFound:
            logger.error("The job exited 0 but wrote no outcome record; reporting it as crashed.")
            return KineticWorkerResult(identifier=identifier, status_code=1)
        if outcome.get("status") == "completed":
            state = Completed(message=f"Job finished in {outcome.get('duration_s', 0):.2f}s")
        else:
            state = Failed(message=f"Failed while {outcome.get('phase')}: {outcome.get('error_type')}: "
                                   f"{outcome.get('message', '')[:500]}")
        try:
            await propose_state(self.client, state, flow_run_id=flow_run.id)
        except Abort:
            pass
        return KineticWorkerResult(identifier=identifier, status_code=0)


