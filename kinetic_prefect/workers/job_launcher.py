"""What a launcher is to the lifecycle: :class:`JobLauncher`, the interface each infrastructure implements
(``local/launcher.py``, ``gke/launcher.py``), and :class:`JobStatus`, what it sees of one job. The lifecycle
and the attempts (fallbacks, preemption retries) both use them, so they live apart from either."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators


@dataclass
class JobStatus:
    """What a launcher sees of one job."""

    phase: str  # "pending" | "running" | "exited" | "gone"
    exit_code: int | None = None
    detail: str = ""  # where it runs; why it is pending; how it ended
    fatal: bool = False  # pending for a reason that will not fix itself (bad image, no node pool...)
    # Why a pod is stuck, in prefect-kubernetes' diagnosis vocabulary (category such as
    # "Unschedulable.NodeAffinity", summary, detail, resolution): emitted as an event automations match on.
    diagnosis: dict[str, str] | None = None
    # A multi-host group ended because this host (not the coordinator) exited non-zero: the group's failure is its.
    failed_host: int | None = None
    # Pending: why the cluster cannot place it (capacity.NO_NODE_POOL / INSUFFICIENT_CAPACITY / ...), for fallbacks.
    capacity: str | None = None
    # Pending: how long of it a node was on its way (the autoscaler scaling up for it), which capacity waits skip.
    scaling_up_seconds: float = 0.0
    # Exited: the infrastructure took the job away (spot preemption, node lost), said for a person; not a failure.
    preempted: str | None = None


class JobLauncher(abc.ABC):
    """How one kind of infrastructure runs a kinetic job. Blocking work belongs in threads."""

    job_kind = "job"  # what one of its jobs is called where a person reads what was stopped

    @abc.abstractmethod
    async def submit(self, flow_run: FlowRun, configuration: Any, log: Callable[[str], None]) -> str:
        """Start the job; return its identifier."""

    @abc.abstractmethod
    async def find(self, flow_run: FlowRun, configuration: Any) -> str | None:
        """The identifier of a job already started for this run (a restarted worker), else None."""

    @abc.abstractmethod
    async def status(self, identifier: str, configuration: Any) -> JobStatus: ...

    @abc.abstractmethod
    async def forward_logs(
        self, identifier: str, configuration: Any, emit: Callable[[str], None], final: bool = False
    ) -> None:
        """Hand new output to ``emit`` (batched); ``final``: the job has ended, drain everything."""

    @abc.abstractmethod
    async def cancel(self, identifier: str, configuration: Any, grace_seconds: float) -> None:
        """Stop the job and return once it is gone."""

    async def forwarded(self, identifier: str) -> None:  # noqa: B027 - optional, not abstract
        """Everything handed to ``emit`` so far is stored in Prefect: a restarted worker resumes after it."""

    async def cleanup(self, identifier: str, configuration: Any) -> None:  # noqa: B027 - optional, not abstract
        """Remove what the launcher keeps for a job whose run is final."""

    # Launchers that implement ``relaunch`` say so: their jobs get fallbacks and preemption retries.
    can_relaunch: bool = False

    async def relaunch(
        self,
        flow_run: FlowRun,
        configuration: Any,
        identifier: str,
        spec: accelerators.AcceleratorSpec,
        attempt: int,
        log: Callable[[str], None],
    ) -> str:
        """Replace the job ``identifier`` (pending or ended) by a new attempt on ``spec``; return its identifier.
        Launchers that cannot do this leave it out: their jobs get no fallbacks and no preemption retries."""
        raise NotImplementedError

    async def unfinished_jobs(self, work_pool: Any) -> list[tuple[str, str]]:
        """``(flow_run_id, identifier)`` of the jobs ``work_pool`` started that may still run."""
        return []

    async def startup_timeline(self, identifier: str, configuration: Any) -> Any:
        """The job's start-up (``workers.startup.Timeline``) once it is over, or None where the launcher keeps none;
        the lifecycle publishes it when the run is final."""
        return None

    async def host_spans(self, identifier: str, configuration: Any) -> list[Any]:
        """When each host of the job started and ended (``cost.HostSpan``), for metering; [] if unknown."""
        return []
