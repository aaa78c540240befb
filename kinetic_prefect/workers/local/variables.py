"""The ``kinetic-local`` pool's variables: the form of ``work_pools/kinetic-local.json`` (generated from this model by
``python -m kinetic_prefect.workers.templates``): the shared ``PoolVariables`` and ``WarmVariables``, plus what a
job on this machine takes (its working directory, the machine's variables it inherits)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from kinetic_prefect.contract import Env
from kinetic_prefect.contract.job_variables import CALLER_VARIABLES, PoolVariables, WarmVariables


class KineticLocalVariables(PoolVariables, WarmVariables):
    """``kinetic-local``: jobs as processes on the worker's machine."""

    # What a call may set on this pool; the pool pins the rest (command, inherit_env, working_dir, gcp_credentials...)
    caller_variables: ClassVar[frozenset[str]] = CALLER_VARIABLES

    accelerator: str = Field(
        default="cpu",
        title="Accelerator",
        description="Accelerator name from the kinetic catalog (`cpu`, `l4`, `tpu-v6e-8`, ...). Local jobs run on "
        "this machine's CPU whatever is named; the name is recorded on the run. A comma-separated list "
        "(`tpu-v6e-8,a100x4,l4x4`) is a fallback list, tried in order (kinetic-local: the first this "
        "machine has, else the CPU).",
    )
    store: str | None = Field(
        default=None,
        title="Artifact store",
        description="Where payloads, results and outputs live: a local directory or gs://bucket/prefix. Empty: "
        f"${Env.STORE} or ~/.cache/kinetic-prefect/store.",
    )
    hosts: int | None = Field(
        default=None,
        title="Hosts",
        ge=1,
        description="Job processes per call, forming one jax.distributed group on this machine (CPU collectives "
        "through gloo); host 0 is the coordinator and its return value is the result. Empty: the "
        "accelerator's own hosts (a multi-host TPU slice), else 1. Set per task with "
        "@kinetic_task(hosts=N).",
    )
    working_dir: str | None = Field(
        default=None,
        title="Working directory",
        description="Directory the job process starts in (the runner then moves into the shipped project).",
    )
    poll_seconds: float = Field(
        default=0.25,
        title="Poll interval (s)",
        description="How often the worker checks the job, its run and its parent runs.",
    )
    log_lines_per_second: int = Field(
        default=2000,
        title="Log lines per second",
        description="Job output forwarded to Prefect past a 5-second burst; lines over it are replaced by a note, "
        "and the whole log is kept with the job's outputs as job.log.",
    )
    inherit_env: list[str] = Field(
        default=[],
        title="Inherited machine variables",
        description="Glob patterns of this machine's environment variables a job also sees, beyond the built-in set "
        "(PATH, HOME, locale, temp dirs, proxies, device settings, cloud credentials). The caller's other "
        "variables never reach a job: forward them with env= on @kinetic_task.",
    )
