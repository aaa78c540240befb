"""The ``kinetic-local`` worker type: jobs as local processes (``launcher``) in hash-keyed uv environments
(``environments``), with warm runners (``warm``); the embedded default, needing no cloud."""

from __future__ import annotations

import os
import socket
from typing import Any

from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseWorker

from kinetic_prefect.contract import LOCAL_WORKER_TYPE
from kinetic_prefect.contract.launchers import DebugForwarding, LauncherAbilities, PriceSource, SweepSlots
from kinetic_prefect.workers.base import load_template
from kinetic_prefect.workers.lifecycle import KineticWorker
from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration
from kinetic_prefect.workers.local.launcher import LocalJobLauncher
from kinetic_prefect.workers.local.variables import KineticLocalVariables
from kinetic_prefect.workers.overrides import PinnedPoolVariables


# PinnedPoolVariables first: a run whose job variables widen what the pool pins is refused before the lifecycle.
# (mypy is told to ignore the class line: run() returns a BaseWorkerResult subclass)
class KineticLocalWorker(PinnedPoolVariables, KineticWorker, BaseWorker):  # type: ignore[misc]
    type = LOCAL_WORKER_TYPE
    job_configuration = KineticLocalJobConfiguration
    launcher: LocalJobLauncher
    job_configuration_variables = KineticLocalVariables
    _description = "Runs @kinetic_task jobs as local processes in hash-keyed uv environments."
    abilities = LauncherAbilities(
        runs_images=False,  # an environment is a uv venv from requirements=, not an image
        sweep_slots=SweepSlots.ALWAYS,  # a slot is a process living as long as its sweep has inputs
        default_slots=None,  # the jobs share the caller's CPUs
        warm_reuse=True,
        debug_forwarding=DebugForwarding.LOCAL_RELAY,
        fuse_mounts=False,  # the job reads a local source in place, a gs:// one through the store's client
        multi_host=True,  # N processes on this machine
        spot=False,
        reservations=False,
        runs_here=True,  # a GPU or TPU this machine lacks: the job runs on its CPU, and says so
        # a job on this machine is priced as the same accelerator in the cloud, its CPU unpriced, unless the pool
        # names its own prices (a budget is enforced the same way on every pool)
        price_source=PriceSource.CLOUD_CATALOG,
    )
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    @staticmethod
    def debug_connector(record: dict[str, Any], variables: Any) -> tuple[Any, str]:
        """``kinetic-prefect jobs debug``: a TCP connection to the job process's debugpy (the job runs on the worker's
        machine, which is this one or one reached the same way)."""
        where = f"{record['host']}:{record['port']} on {record.get('hostname')} (pid {record.get('pid')})"
        return (lambda: socket.create_connection((record["host"], int(record["port"])), timeout=10)), where

    @staticmethod
    def doctor(report: Any, client: Any, pool: Any, accelerators: list[str], **options: Any) -> None:
        """``kinetic-prefect doctor``'s checks of a pool of this type (``workers/local/doctor.py``)."""
        from kinetic_prefect.workers.local import doctor

        doctor.doctor(report, client, pool, accelerators, **options)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launcher = LocalJobLauncher()

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    def owned_by_caller(self, api_env: dict[str, str]) -> None:
        """In-process submission: the job stops (and cancels its run) if this process dies."""
        super().owned_by_caller(api_env)
        self.launcher.owner_pid = os.getpid()
        self.launcher.api_env = api_env

    async def setup(self) -> None:
        await super().setup()
        if self._work_pool is not None:
            assert self._runs_task_group is not None  # set by BaseWorker.setup()
            count = await self.reattach(self._runs_task_group.start_soon)
            if count:
                self._logger.info(f"Reattached to {count} running kinetic job(s)")

    async def kill_infrastructure(self, infrastructure_pid: str, configuration, grace_seconds: int = 30) -> None:
        if self.launcher.read_record(str(infrastructure_pid)) is None:
            raise InfrastructureNotFound(f"no local kinetic job {infrastructure_pid}")
        await self.launcher.cancel(str(infrastructure_pid), configuration, grace_seconds)
