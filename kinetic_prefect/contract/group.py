"""Where a job process stands in its group of hosts (stdlib only; ships to the pod)."""

from __future__ import annotations

from dataclasses import dataclass

from kinetic_prefect.contract.env import Env

JAX_COORDINATOR_PORT = 8476  # the port GKE's TPU tooling and jax.distributed use by default


@dataclass(frozen=True)
class Group:
    """Where this job process stands in its group (a group of one for a single-host job)."""

    index: int = 0
    size: int = 1
    coordinator: str | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.index == 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Group:
        import os

        env = os.environ if environ is None else environ
        size = int(env.get(Env.NUM_HOSTS) or 1)
        index = int(env.get(Env.HOST_INDEX) or env.get("JOB_COMPLETION_INDEX") or 0)
        if not 0 <= index < size:
            raise ValueError(f"host index {index} outside a group of {size}")
        return cls(index=index, size=size, coordinator=env.get(Env.COORDINATOR_ADDRESS) or None)
