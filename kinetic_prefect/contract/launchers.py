"""What a launcher can do: one record per worker type, declared once on its worker class (``abilities``).

The caller asks for it through one door (``caller.pools.abilities_of``) and decides by it: whether a call's
``image=`` can run, whether a fan-out shares slot jobs and how many, how a debugger is forwarded, whether FUSE
volumes mount, whether a group of hosts can run. A call that needs an ability its pool's launcher lacks is refused
before anything is uploaded, naming the pool and the ability (``refusal``). No module outside ``workers/``
switches on a worker-type name: it reads this record instead. Plain data (the standard library only), so the
contract stays importable everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DebugForwarding", "LauncherAbilities", "PriceSource", "SweepSlots", "refusal"]


class SweepSlots(StrEnum):
    """When a fan-out's calls share a few slot jobs (caller/slots.py) instead of a job run each."""

    ALWAYS = "always"  # a slot is a process that lives as long as its sweep has inputs
    WITH_WARM = "with-warm"  # a slot is a warm job: only with keep_warm_seconds > 0
    NEVER = "never"


class DebugForwarding(StrEnum):
    """How ``kinetic-prefect jobs debug`` reaches a debug job's debugpy (the worker class's ``debug_connector``)."""

    LOCAL_RELAY = "local-relay"  # a TCP relay to the job process's port (the job runs on this machine)
    PORT_FORWARD = "port-forward"  # the Kubernetes API server's port-forward to the pod's fixed DEBUG_PORT
    NONE = "none"  # nothing reaches the job: debug=True is refused


class PriceSource(StrEnum):
    """Where a job's price per hour comes from (shared/prices.py, shared/cost.py)."""

    OWN_MACHINE = "own-machine"  # the machine is the user's: priced only when the pool says so
    CLOUD_CATALOG = "cloud-catalog"  # the accelerator's list price (node, VM or TPU chip)
    VERTEX_CATALOG = "vertex-catalog"  # Vertex AI custom training's own rates (shared.prices.VERTEX_PRICES)


@dataclass(frozen=True)
class LauncherAbilities:
    """What the launcher of a worker type can do. A new launcher states each field (only ``extras`` and
    ``provisions`` default: no extra, no provisioning). The caller decides by ``runs_images``, ``sweep_slots``,
    ``default_slots``, ``debug_forwarding``, ``fuse_mounts`` and ``multi_host`` before a call is uploaded;
    ``warm_reuse``, ``spot``, ``reservations``, ``runs_here``, ``price_source``, ``extras`` and ``provisions``
    describe the launcher to its readers and decide nothing yet."""

    runs_images: bool  # image= and requirements= built into a container image the job runs in
    sweep_slots: SweepSlots  # when a fan-out's calls share slot jobs
    # Slot jobs per sweep when KINETIC_SWEEP_SLOTS is unset: None, twice the caller's CPUs (at least 4: the jobs run
    # on the caller's machine); a number, the pool's concurrency limit or else this (a slot holds an accelerator).
    default_slots: int | None
    warm_reuse: bool  # keep_warm_seconds: a job's process (or pod) takes the next call of the same environment
    debug_forwarding: DebugForwarding  # debug=True and `kinetic-prefect jobs debug`
    fuse_mounts: bool  # Data(..., fuse=True) mounted as Cloud Storage FUSE volumes (gcs_fuse_mounts)
    multi_host: bool  # hosts > 1: a group of hosts (one job, one process or pod per host)
    spot: bool  # spot capacity (spot=, spot_fallback)
    reservations: bool  # a reservation the pool names (or queued provisioning)
    runs_here: bool  # jobs run on the worker's own machine: an accelerator is a wish, the CPU the fallback
    price_source: PriceSource
    extras: tuple[str, ...] = ()  # the package extras the launcher needs (pip install 'kinetic-prefect[...]')
    provisions: bool = False  # `kinetic-prefect up/down/pool` make its infrastructure (the worker's provisioning)

    @property
    def install_hint(self) -> str:
        """The install command for the launcher's extras ('' when it needs none)."""
        if not self.extras:
            return ""
        return f"pip install 'kinetic-prefect[{','.join(self.extras)}]'"


def refusal(pool_name: str, pool_type: str, ability: str, fix: str) -> str:
    """The message of a call refused for an ability its pool's launcher lacks: the pool, its type, the ability."""
    return f"pool {pool_name!r} (type {pool_type!r}) cannot {ability}: its launcher does not. {fix}"
