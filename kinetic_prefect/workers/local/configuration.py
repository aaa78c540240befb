"""A kinetic-local job's configuration: the kinetic fields, and the choice of a local accelerator."""

from __future__ import annotations

from pydantic import Field

from kinetic_prefect import accelerators
from kinetic_prefect.contract import Env
from kinetic_prefect.workers.base import KineticJobConfiguration


class KineticLocalJobConfiguration(KineticJobConfiguration):
    working_dir: str | None = Field(default=None)
    stream_output: bool = Field(default=True)
    poll_seconds: float = Field(default=0.25)
    log_lines_per_second: int = Field(default=2000)
    inherit_env: list[str] = Field(default_factory=list)
    hosts: int | None = Field(default=None)  # a group of N job processes; a multi-host accelerator sets its own
    keep_warm_seconds: float = Field(default=0)  # > 0: warm runners (workers/warm.py); single-host jobs only
    min_warm: int = Field(default=0)
    warm_floor_idle_seconds: float | None = Field(default=None)  # a min_warm runner's idle limit; None: none

    @property
    def host_count(self) -> int:
        """Job processes in the group: the slice's hosts for a multi-host accelerator (on the CPU here when the
        machine lacks it, like any absent accelerator), else ``hosts`` (1 by default)."""
        return accelerators.host_count(self.asked_spec, self.hosts)

    @property
    def accelerator_spec(self) -> accelerators.AcceleratorSpec:
        """What the job runs on, so what it is billed as (workers.metering.job_spec) and said to have run on
        (workers.attempts.plan_for): the CPU where this machine lacks the accelerator asked for (issue 48, 10)."""
        if self.cpu_instead_of is not None:
            return accelerators.resolve("cpu")
        return self.asked_spec


def choose_local_accelerator(configuration: KineticLocalJobConfiguration) -> None:
    """A fallback list on this machine: the first accelerator it has; none: the first, on the CPU (warned)."""
    from kinetic_prefect.shared import capacity

    if len(configuration.accelerator_choices) < 2 or configuration.accelerator != configuration.accelerator_choices[0]:
        return
    for name, spec in zip(configuration.accelerator_choices, configuration.accelerator_specs):
        if accelerators.local_platform_available(spec.jax_platform):
            configuration.accelerator = name
            configuration.env.update(
                {
                    Env.ACCELERATOR: spec.name,
                    Env.ACCELERATOR_CHIPS: str(capacity.chip_count(spec)),
                    "JAX_PLATFORMS": spec.jax_platform,
                }
            )
            return
