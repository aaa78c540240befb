"""Worker side: the job configuration every kinetic launcher shares (the lifecycle is in
``lifecycle.py``)."""

from __future__ import annotations

from typing import Any

from prefect.workers.base import BaseJobConfiguration
from pydantic import Field, PrivateAttr

from kinetic_prefect import accelerators, config, signing
from kinetic_prefect.contract import (
    RUNNER_COMMAND,
    RUNNER_MODULE,
    SLOT_RUNNER_MODULE,
    WORKER_TYPES,
    Env,
    RunLayout,
    SweepKeys,
)
from kinetic_prefect.shared.image import ImageSpec

ENV_BLOCK_VARIABLE = Env.ENV_BLOCK


def slot_argv(argv: list[str]) -> list[str]:
    """A slot job's command (a sweep's inputs one after another, on kinetic-local and kinetic-gke alike): the slot
    runner's module in the runner's place."""
    if RUNNER_MODULE not in argv:
        raise ValueError(f"sweeps in slots need the standard runner command; this pool runs {' '.join(argv)!r}")
    return [SLOT_RUNNER_MODULE if part == RUNNER_MODULE else part for part in argv]


def kinetic_worker_class(worker_type: str) -> Any:
    """The worker class of ``worker_type`` (``workers.worker_class``: that launcher alone is imported). What a type
    has is read from its class, never decided by its name."""
    from kinetic_prefect import workers

    try:
        cls = workers.worker_class(worker_type)
    except KeyError:
        cls = None
    if cls is None or getattr(cls, "abilities", None) is None:
        raise ValueError(f"no kinetic worker type {worker_type!r} installed here; one of {', '.join(WORKER_TYPES)}")
    return cls


load_template = config.pool_template  # the base job template shipped as data in work_pools/<type>.json


class KineticJobConfiguration(BaseJobConfiguration):
    """Fields every kinetic job has; launchers add their own."""

    accelerator: str = Field(default="cpu")
    image_tag: str | None = Field(default=None)
    requirements: list[str] = Field(default_factory=list)
    python_version: str | None = Field(default=None)
    base_image: str | None = Field(default=None)
    store: str | None = Field(default=None)
    gcp_credentials: str | None = Field(default=None)  # a saved prefect-gcp GcpCredentials block's name
    max_cost_usd: float | None = Field(default=None)  # the worker stops the job when its metered cost reaches it
    prices: dict[str, Any] | str | None = Field(default=None)  # overrides: shared.cost.load_prices
    # Capacity (kinetic_prefect.shared.capacity): `accelerator` may be a fallback list ("a100x4,l4x4"), tried in order.
    # Resolved once per run from the job variable (prepare_for_flow_run): the list's specs, and their labels.
    _accelerator_specs: list[accelerators.AcceleratorSpec] = PrivateAttr(default_factory=list)
    _accelerator_choices: list[str] = PrivateAttr(default_factory=list)
    preemption_retries: int | None = Field(default=None)
    spot_fallback: bool = Field(default=False)
    capacity_wait_seconds: float | None = Field(default=None)

    # Forwarded environment values (env= of @kinetic_task). Kept out of job variables and manifests:
    # in-process they are handed over in memory; through a polling worker they travel in a Prefect
    # Secret block that the worker reads once and deletes (ENV_BLOCK_VARIABLE names it).
    _secret_env: dict[str, str] = PrivateAttr(default_factory=dict)

    # The worker's master keyring (callers' and workers' only): the job gets derived keys of its own scopes.
    _signing_keys: signing.Keyring | None = PrivateAttr(default=None)
    _job_scopes: list[str] = PrivateAttr(default_factory=list)
    _pool_base_image: str | None = PrivateAttr(default=None)  # the pool's base_image: the only one a run may ask for

    @property
    def signing_keys(self) -> signing.Keyring | None:
        return self._signing_keys

    def hand_over_signing_keys(self, keys: signing.Keyring, *extra_scopes: str) -> None:
        """The job's keyring into its secret environment: the derived keys of its run, its outputs, its task
        run's checkpoints, its sweep (a slot) and ``extra_scopes`` (a warm pod's control prefix); never the
        master key, so code in the job can sign only what this job may write."""
        self._signing_keys = keys
        if not self._job_scopes:
            self._job_scopes = signing.run_scopes(str(self.env[Env.RUN_ID]), self.env.get(Env.CHECKPOINT_KEY))
            if self.env.get(Env.SWEEP_ID):
                self._job_scopes.append(signing.scope_of_prefix(SweepKeys(str(self.env[Env.SWEEP_ID])).prefix))
        self._job_scopes.extend(s for s in extra_scopes if s not in self._job_scopes)
        self._secret_env[signing.KEY_ENV] = keys.for_job(*self._job_scopes).to_env()

    @property
    def accelerator_choices(self) -> list[str]:
        """The fallback list ``accelerator`` named, in order (empty before ``prepare_for_flow_run``)."""
        return self._accelerator_choices

    @property
    def accelerator_specs(self) -> list[accelerators.AcceleratorSpec]:
        """The fallback list's specs, in order: resolved once, in ``prepare_for_flow_run``."""
        return self._accelerator_specs

    @property
    def asked_spec(self) -> accelerators.AcceleratorSpec:
        """The spec of ``accelerator``, the choice this attempt asks for (a launcher adjusts it: kinetic-gke's
        ``spot``, kinetic-local's CPU stand-in). Found in the resolved list; resolved only for a name outside it (a
        relaunch on on-demand capacity after a spot list) or before ``prepare_for_flow_run``."""

        for choice, spec in zip(self._accelerator_choices, self._accelerator_specs):
            if choice == self.accelerator:
                return spec
        return accelerators.resolve(self.accelerator)

    @property
    def cpu_instead_of(self) -> str | None:
        """The accelerator asked for, when this machine lacks it (None when it has it): what a launcher that runs
        jobs here (``abilities.runs_here``) runs on the CPU instead, and says so."""
        from kinetic_prefect.shared import capacity

        spec = self.asked_spec
        return None if accelerators.local_platform_available(spec.jax_platform) else capacity.label(spec)

    @property
    def secret_env(self) -> dict[str, str]:
        return self._secret_env

    def set_secret_env(self, values: dict[str, str]) -> None:
        self._secret_env = dict(values)

    def add_secret_env(self, values: dict[str, str]) -> None:
        """More secret values for the job, beside the forwarded ones (never a launcher's view of ``secret_env``, which
        may fold in values it moved out of the job's env for one attempt)."""
        self._secret_env = {**self._secret_env, **values}

    def prepare_for_flow_run(
        self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None
    ):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        if self.command == self._base_flow_run_command():
            self.command = RUNNER_COMMAND
        self.env[Env.STORE] = self.store or config.default_store_url()
        self.env.setdefault(Env.RUN_ID, str(flow_run.id))
        self.env.setdefault(Env.RUN_PREFIX, RunLayout(str(self.env[Env.RUN_ID])).prefix)  # older jobs' name for it
        self.env[Env.FLOW_RUN_ID] = str(flow_run.id)
        if work_pool is not None:
            pinned = work_pool.base_job_template.get("variables", {}).get("properties", {}).get("base_image") or {}
            self._pool_base_image = pinned.get("default") or None
        from kinetic_prefect.shared import capacity

        self._accelerator_specs = capacity.choices(self.accelerator)  # the job variable, resolved once
        self._accelerator_choices = [capacity.label(s) for s in self._accelerator_specs]
        self.accelerator = self._accelerator_choices[0]  # the first choice; the lifecycle moves on when it must
        spec = self._accelerator_specs[0]
        self.env.setdefault(Env.ACCELERATOR, spec.name)
        self.env.setdefault(Env.ACCELERATOR_CHIPS, str(capacity.chip_count(spec)))
        self.env.setdefault(Env.PREEMPTIONS, "0")
        self.labels["kinetic.accelerator"] = spec.name

    def check_build_variables(self) -> None:
        """The job variables an image is built from, held to what a caller can send before anything is built (a
        flow run created over the API skips the caller): ``requirements`` PEP 508 lines only (no pip option, URL
        line or shell text), ``python_version`` a minor version, ``base_image`` one image reference, and the
        pool's own ``base_image`` when the pool sets one. ValueError naming the variable."""
        from kinetic_prefect.shared import builders
        from kinetic_prefect.shared.image import RequirementsError, check_requirements

        try:
            self.requirements = list(check_requirements(self.requirements, "job variable requirements"))
        except RequirementsError as exc:
            raise ValueError(f"{exc}; refusing to build an image from it") from None
        if self.python_version is not None:
            builders.check_python_version(self.python_version, "job variable python_version")
        if self.base_image:
            builders.check_base_image(self.base_image, "job variable base_image")
            if self._pool_base_image and self.base_image != self._pool_base_image:
                raise ValueError(
                    f"job variable base_image={self.base_image!r}: this pool builds only from its own base image "
                    f"{self._pool_base_image!r}; refusing to build from another"
                )

    @property
    def image_spec(self) -> ImageSpec:
        kwargs = {"python": self.python_version} if self.python_version else {}
        return ImageSpec(
            requirements=tuple(self.requirements),
            family=self.asked_spec.family,
            base_image=self.base_image,
            **kwargs,
        )


async def open_job_store(configuration: Any) -> Any:
    """The job's store, read with the pool's ``gcp_credentials`` block when it names one (else the default
    client: Application Default Credentials, Workload Identity for an in-cluster worker)."""
    from kinetic_prefect.shared import gcp
    from kinetic_prefect.storage import open_store

    url = configuration.env[Env.STORE]
    name = getattr(configuration, "gcp_credentials", None)
    if not (url.startswith("gs://") and name):
        return open_store(url)
    return gcp.open_store(url, await gcp.credentials_block("worker", name))
