"""The ``kinetic-vertex`` worker type: a kinetic job as a Vertex AI custom job, on the shared lifecycle.

It stands on prefect-gcp's Vertex AI worker as kinetic-gke stands on prefect-kubernetes: its variables and job
configuration are subclasses of prefect-gcp's (``variables``, ``configuration``), its jobs are created with
google-cloud-aiplatform's ``JobServiceClient`` and request types (``custom_job``, ``service``), and the lifecycle
follows them through ``VertexJobLauncher``.
"""

from __future__ import annotations

from typing import Any

from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseWorker

from kinetic_prefect.contract import VERTEX_WORKER_TYPE
from kinetic_prefect.contract.launchers import DebugForwarding, LauncherAbilities, PriceSource, SweepSlots
from kinetic_prefect.workers.base import load_template
from kinetic_prefect.workers.lifecycle import KineticWorker
from kinetic_prefect.workers.overrides import PinnedPoolVariables
from kinetic_prefect.workers.vertex import machines
from kinetic_prefect.workers.vertex.configuration import KineticVertexJobConfiguration
from kinetic_prefect.workers.vertex.launcher import VertexJobLauncher
from kinetic_prefect.workers.vertex.variables import KineticVertexVariables


# PinnedPoolVariables first: a run whose job variables widen what the pool pins is refused before the lifecycle.
# (mypy is told to ignore the class line: run() returns a BaseWorkerResult subclass)
class KineticVertexWorker(PinnedPoolVariables, KineticWorker, BaseWorker):  # type: ignore[misc]
    type = VERTEX_WORKER_TYPE
    job_configuration = KineticVertexJobConfiguration
    launcher: VertexJobLauncher
    job_configuration_variables = KineticVertexVariables
    abilities = LauncherAbilities(
        runs_images=True,
        sweep_slots=SweepSlots.NEVER,  # no warm jobs on Vertex: each call is a custom job
        default_slots=8,
        warm_reuse=False,  # a custom job runs one container to its end; nothing to hand the next call to
        debug_forwarding=DebugForwarding.NONE,  # no port of a custom job is reachable from the caller
        fuse_mounts=False,
        multi_host=True,  # hosts=N: a second replica pool joining host 0's group (custom_job.worker_pools)
        spot=True,
        reservations=True,
        runs_here=False,
        price_source=PriceSource.VERTEX_CATALOG,  # Vertex training's rates, not Compute Engine's
        extras=("gcp",),
    )
    _description = "Runs @kinetic_task jobs as Vertex AI custom jobs (GPUs and TPUs, no cluster to keep)."
    _display_name = "Kinetic on Vertex AI"
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launcher = VertexJobLauncher()

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    @classmethod
    def check_pool_settings(cls, pool_name: str, defaults: dict[str, Any], job_variables: dict[str, Any]) -> None:
        """Refused before anything is uploaded: an accelerator Vertex cannot run (with the nearest one it can),
        and a pool that can neither take an image nor build one."""
        settings = {**defaults, **{k: v for k, v in job_variables.items() if v is not None}}
        from kinetic_prefect.shared import capacity

        for spec in capacity.choices(settings.get("accelerator") or "cpu", settings.get("hosts")):
            try:
                machines.machine_for(spec)
            except machines.NotOnVertex as refused:
                raise ValueError(f"work pool {pool_name!r} (kinetic-vertex): {refused}") from None
        if settings.get("image"):
            return
        builder = settings.get("image_builder") or "none"
        if builder == "none" or not settings.get("image_repository"):
            raise ValueError(
                f"work pool {pool_name!r} (kinetic-vertex) has no image and cannot build one: pass image= to "
                f"@kinetic_task, or `kinetic-prefect pool-set {pool_name} image_builder=cloud-build "
                "image_repository=us-docker.pkg.dev/PROJECT/REPO build_staging_bucket=BUCKET`"
            )

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: KineticVertexJobConfiguration, grace_seconds: int = 30
    ) -> None:
        if "/customJobs/" not in str(infrastructure_pid):
            raise InfrastructureNotFound(f"not a Vertex AI custom job: {infrastructure_pid!r}")
        await self.launcher.cancel(str(infrastructure_pid), configuration, grace_seconds)

    async def setup(self) -> None:
        await super().setup()
        if self._work_pool is not None:
            try:
                assert self._runs_task_group is not None  # set by BaseWorker.setup()
                count = await self.reattach(self._runs_task_group.start_soon)
                if count:
                    self._logger.info(f"Reattached to {count} Vertex AI custom job(s)")
            except Exception as exc:  # an API hiccup must not stop the worker from polling
                self._logger.warning(f"Could not look for running custom jobs to reattach: {exc!r}")
