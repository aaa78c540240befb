"""The ``kinetic-gke`` worker type: Kubernetes Jobs on GKE nodes with the accelerator, built on prefect-kubernetes.

The pieces, one module each: ``configuration`` (the job configuration and the Job manifest), ``launcher`` (creating,
following and stopping Jobs), ``follower`` (one Job's pods and logs), ``kube`` (the API client and retries),
``variables`` (the pool's form), ``capacity`` (fallback lists and spot). This module is the Prefect worker class
that ties them to the shared lifecycle, and the pool settings it refuses before anything is uploaded.
"""

from __future__ import annotations

from typing import Any

from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseWorker

from kinetic_prefect.contract import GKE_WORKER_TYPE
from kinetic_prefect.contract.launchers import DebugForwarding, LauncherAbilities, PriceSource, SweepSlots
from kinetic_prefect.workers.base import load_template
from kinetic_prefect.workers.gke import capacity as gke_capacity
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.launcher import GKEJobLauncher
from kinetic_prefect.workers.gke.variables import KineticGKEVariables
from kinetic_prefect.workers.lifecycle import KineticWorker
from kinetic_prefect.workers.overrides import PinnedPoolVariables


# PinnedPoolVariables first: a run whose job variables widen what the pool pins is refused before the lifecycle.
# (mypy is told to ignore the class line: run() returns a BaseWorkerResult subclass)
class KineticGKEWorker(PinnedPoolVariables, KineticWorker, BaseWorker):  # type: ignore[misc]
    type = GKE_WORKER_TYPE
    job_configuration = KineticGKEJobConfiguration
    launcher: GKEJobLauncher
    job_configuration_variables = KineticGKEVariables
    _description = "Runs @kinetic_task jobs as Kubernetes Jobs on GKE GPU/TPU node pools."
    abilities = LauncherAbilities(
        runs_images=True,
        sweep_slots=SweepSlots.WITH_WARM,  # a slot is a warm pod taking the sweep's inputs one after another
        default_slots=8,  # a slot pod holds an accelerator: the caller's CPUs say nothing about it
        warm_reuse=True,
        debug_forwarding=DebugForwarding.PORT_FORWARD,
        fuse_mounts=True,
        multi_host=True,  # an Indexed Job with a headless Service
        spot=True,
        reservations=True,
        runs_here=False,
        price_source=PriceSource.CLOUD_CATALOG,
        extras=("k8s", "gcp"),
    )
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    @staticmethod
    def doctor(report: Any, client: Any, pool: Any, accelerators: list[str], **options: Any) -> None:
        """``kinetic-prefect doctor``'s checks of a pool of this type (``workers/gke/doctor.py``)."""
        from kinetic_prefect.workers.gke import doctor

        doctor.doctor(report, client, pool, accelerators, **options)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launcher = GKEJobLauncher()

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    @staticmethod
    def debug_connector(record: dict[str, Any], variables: Any) -> tuple[Any, str]:
        """``kinetic-prefect jobs debug``: a port-forward through the API server to the pod (workers/gke/debug.py);
        ``variables()`` gives the job's variables (its cluster)."""
        from kinetic_prefect.workers.gke import debug

        return debug.debug_connector(record, variables)

    @staticmethod
    def job_manifest_template() -> dict[str, Any]:
        """The Job manifest of the pool template's job configuration (workers/templates.py)."""
        from kinetic_prefect.workers.gke.variables import job_manifest_template

        return job_manifest_template()

    @staticmethod
    def floor_pods(work_pool: Any) -> list[tuple[Any, Any]]:
        """``kinetic-prefect warm``: the pool's floor pods (``min_warm``) in its cluster, each with what ends it."""
        from kinetic_prefect.workers.gke import warm

        return warm.pool_floor_pods(work_pool)

    @classmethod
    def check_pool_settings(cls, pool_name: str, defaults: dict[str, Any], job_variables: dict[str, Any]) -> None:
        """Image settings must be complete before a payload is uploaded: an unset project used to build
        ``projects/None/locations/None``, an unset bucket failed with an AttributeError mid-build."""
        settings = {**defaults, **{k: v for k, v in job_variables.items() if v is not None}}
        gke_capacity.check_settings(pool_name, settings)
        if settings.get("image"):
            return
        builder = settings.get("image_builder") or "none"
        needed = {
            "cloud-build": ("image_repository", "gcp_project", "gcp_region", "build_staging_bucket"),
            "docker": ("image_repository",),
        }.get(builder)
        if needed is None:
            raise ValueError(
                f"work pool {pool_name!r} (kinetic-gke) has no image and image_builder={builder!r}: pass image= to "
                f"@kinetic_task, or set the pool's builder, e.g. `kinetic-prefect pool-set {pool_name} "
                "image_builder=cloud-build image_repository=us-docker.pkg.dev/PROJECT/REPO gcp_project=PROJECT "
                "gcp_region=REGION build_staging_bucket=BUCKET`"
            )
        missing = [name for name in needed if not settings.get(name)]
        if missing:
            raise ValueError(
                f"work pool {pool_name!r} builds images with {builder} but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: `kinetic-prefect pool-set {pool_name} "
                + " ".join(f"{name}=..." for name in missing)
                + "` (or pass image= to @kinetic_task)"
            )

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: KineticGKEJobConfiguration, grace_seconds: int = 30
    ) -> None:
        namespace, _, job_name = infrastructure_pid.partition(":")
        if not job_name:
            raise InfrastructureNotFound(f"not a kinetic-gke job id: {infrastructure_pid!r}")
        await self.launcher.cancel(infrastructure_pid, configuration, grace_seconds)

    async def setup(self) -> None:
        await super().setup()
        if self._work_pool is not None:
            try:
                assert self._runs_task_group is not None  # set by BaseWorker.setup()
                count = await self.reattach(self._runs_task_group.start_soon)
                if count:
                    self._logger.info(f"Reattached to {count} running kinetic Job(s)")
            except Exception as exc:  # a cluster hiccup must not stop the worker from polling
                self._logger.warning(f"Could not look for running Jobs to reattach: {exc!r}")
