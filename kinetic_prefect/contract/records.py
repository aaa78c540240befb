"""The records a job and its worker write for the caller: the outcome (written last) and the capacity record
(stdlib only; ships to the pod)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

COMPLETED, FAILED = "completed", "failed"

# The error type an outcome names when the store had no room (ENOSPC, EDQUOT) for what the job wrote: the
# caller raises errors.StoreFull, which is not retried (a retry would meet the same full store).
STORE_FULL_ERROR = "kinetic_prefect.errors.StoreFull"

# The version of the pickled call (payload.py writes it, the runner refuses any other).
PAYLOAD_FORMAT = 1

# The runner's exception for a job stopped by a signal (cancelled, its pod deleted); an outcome whose
# error type ends with it was stopped, not failed.
JOB_TERMINATED_TYPE = "JobTerminated"


@dataclass
class Outcome:
    """What the job reports. ``user_error``: the failure is the function's (or its value's), not
    the infrastructure's; ``exit_code`` is set when the function raised SystemExit."""

    status: str
    phase: str | None = None
    error_type: str | None = None
    message: str = ""
    traceback: str = ""
    user_error: bool = False
    exit_code: int | None = None
    outputs: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    pid: int | None = None
    hostname: str | None = None
    checkpoint_files_restored: int | None = None
    host_index: int = 0
    num_hosts: int = 1

    @property
    def completed(self) -> bool:
        return self.status == COMPLETED

    @property
    def terminated(self) -> bool:
        """The job was stopped by a signal (the runner's module is ``__main__`` or its import name)."""
        return (self.error_type or "").rsplit(".", 1)[-1] == JOB_TERMINATED_TYPE

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, blob: bytes | str) -> Outcome:
        raw: dict[str, Any] = json.loads(blob)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def summary(self) -> str:
        if self.completed:
            return f"Job finished in {self.duration_s:.2f}s"
        return f"Failed while {self.phase}: {self.error_type}: {self.message[:500]}"


@dataclass
class CapacityRecord:
    """Which accelerator ran a call and what it took (written by the worker at ``RunLayout.capacity``)."""

    accelerator: str
    chips: int = 0
    summary: str = ""
    preemptions: int = 0
    resumed_from: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, blob: bytes | str) -> CapacityRecord:
        raw: dict[str, Any] = json.loads(blob)
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
