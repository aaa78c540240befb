"""What a launcher can do: one record per worker type, declared once on its worker class (``abilities``).

The caller asks for it through one door (``caller.pools.abilities_of``) and decides by it: whether a call's
``image=`` can run, whether a fan-out shares slot jobs and how many, how a debugger is forwarded, whether FUSE
volumes mount, whether a group of hosts, warm jobs, spot capacity or a reservation can be had, which price table a
job is metered and budgeted at. A call that needs an ability its pool's launcher lacks is refused before anything is
uploaded, naming the pool and the ability (``refusal``). No module outside ``workers/`` switches on a worker-type
name: it reads this record instead. Plain data (the standard library only), so the contract stays importable
everywhere.
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
    """The built-in price table a job is metered and budgeted at (``shared.cost.price_for``), under the pool's own
    ``prices``."""

    CLOUD_CATALOG = "cloud-catalog"  # Compute Engine list prices of the accelerator (node, VM or TPU chip)
    VERTEX_CATALOG = "vertex-catalog"  # Vertex AI custom training's own rates (shared.prices.VERTEX_PRICES)


@dataclass(frozen=True)
class LauncherAbilities:
    """What the launcher of a worker type can do; a new launcher states each field. Before a call is uploaded the
    caller decides by ``runs_images``, ``sweep_slots``, ``default_slots``, ``debug_forwarding``, ``fuse_mounts``,
    ``multi_host``, ``warm_reuse``, ``spot``, ``reservations`` and ``price_source`` (its budget); the worker side by
    ``runs_here`` (the CPU stand-in) and ``price_source`` (the job's cost)."""

    runs_images: bool  # image= and requirements= built into a container image the job runs in
    sweep_slots: SweepSlots  # when a fan-out's calls share slot jobs
    # Slot jobs per sweep when KINETIC_SWEEP_SLOTS is unset: None, twice the caller's CPUs (at least 4: the jobs run
    # on the caller's machine); a number, the pool's concurrency limit or else this (a slot holds an accelerator).
    default_slots: int | None
    warm_reuse: bool  # keep_warm_seconds, min_warm: a job's process (or pod) takes the next call of its environment
    debug_forwarding: DebugForwarding  # debug=True and `kinetic-prefect jobs debug`
    fuse_mounts: bool  # Data(..., fuse=True) mounted as Cloud Storage FUSE volumes (gcs_fuse_mounts)
    multi_host: bool  # hosts > 1: a group of hosts (one job, one process or pod per host)
    spot: bool  # spot capacity: an accelerator 'NAME:spot', spot=True, spot_fallback
    reservations: bool  # a reservation the pool names, or capacity queued for (flex_start, queued_provisioning)
    # Jobs run on the worker's own machine: an accelerator it lacks is a wish, the job runs on the CPU and says so
    # (its attempts, cost and usage hint name the CPU it ran on and the accelerator asked for).
    runs_here: bool
    price_source: PriceSource
    # The package extras its worker class needs: the same tuple as its workers.LAUNCHERS line, which is what a missing
    # extra's install command (workers.UNAVAILABLE) reads, since a class whose extras are absent cannot be imported to
    # be asked; registering a class whose two declarations differ fails (workers._register).
    extras: tuple[str, ...] = ()


def refusal(pool_name: str, pool_type: str, ability: str, fix: str) -> str:
    """The message of a call refused for an ability its pool's launcher lacks: the pool, its type, the ability."""
    return f"pool {pool_name!r} (type {pool_type!r}) cannot {ability}: its launcher does not. {fix}"
