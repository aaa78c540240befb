"""The contract between the caller, the worker and the job, in one place (stdlib only).

It ships with the job runner (``image.RUNNER_MODULES``), so the three sides cannot disagree on
where a run's objects live, what the outcome record holds, which ``KINETIC_*`` variables carry
what, or how the runner is started. Nothing here talks to Prefect or to a store.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# --------------------------------------------------------------------------- the runner command

RUNNER_MODULE = "kinetic_prefect.runner"
RUNNER_ARGV = ("python", "-u", "-m", RUNNER_MODULE)
RUNNER_COMMAND = " ".join(RUNNER_ARGV)

# Exit statuses of the runner. Anything but EXIT_OUTCOME_RECORDED means "no outcome": the job crashed.
EXIT_OUTCOME_RECORDED = 0
EXIT_NO_OUTCOME = 3
# A host of a multi-host group (not the coordinator) whose function failed: the group fails with it.
EXIT_HOST_FAILED = 4


# The worker's last log line for a job, before it sets the final state: a caller that follows the
# job through Prefect's logs reads on until it sees it, so no line is lost to the race between a
# log batch and the state change.
LOG_END_MARKER = "[kinetic] end of job output"

# A job reports progress by printing one line with this prefix and a JSON object
# ({"done": 7, "total": 20, "message": "epoch 7/20"}); the worker turns the latest one into a
# Prefect progress artifact on the job's run (the job itself cannot import Prefect).
PROGRESS_PREFIX = "[kinetic:progress] "

# A job's flow run hangs under a tracking task run in the caller's flow run (Prefect's shape for a
# subflow called inside a task); its task key starts with this, so tools can tell it from user tasks.
TRACKING_TASK_KEY_PREFIX = "kinetic-job-"

# --------------------------------------------------------------------------- environment variables


class Env:
    """Names of the variables a worker sets for the job (and the job sets for the function)."""

    STORE = "KINETIC_STORE"                      # store URL: a local directory or gs://bucket/prefix
    RUN_ID = "KINETIC_RUN_ID"                    # the run's id in the store (RunLayout)
    FLOW_RUN_ID = "KINETIC_FLOW_RUN_ID"          # the job's Prefect flow run
    PAYLOAD_SHA256 = "KINETIC_PAYLOAD_SHA256"
    CODE_KEY = "KINETIC_CODE_KEY"
    CODE_SHA256 = "KINETIC_CODE_SHA256"
    CHECKPOINT_KEY = "KINETIC_CHECKPOINT_KEY"
    ACCELERATOR = "KINETIC_ACCELERATOR"
    # Set for the function by the runner:
    OUTPUT_DIR = "KINETIC_OUTPUT_DIR"
    CHECKPOINT_DIR = "KINETIC_CHECKPOINT_DIR"
    CHECKPOINT_SYNC_SECONDS = "KINETIC_CHECKPOINT_SYNC_SECONDS"
    NODE_CACHE = "KINETIC_NODE_CACHE"
    # Only for a job whose owner is the calling process (in-process submission on kinetic-local):
    # when that process dies nobody can collect the result, so the job stops and cancels its run.
    OWNER_PID = "KINETIC_OWNER_PID"
    PREFECT_API_URL = "KINETIC_PREFECT_API_URL"
    PREFECT_API_KEY = "KINETIC_PREFECT_API_KEY"
    # Forwarded env= values for a polling worker travel in a Secret block it reads once and deletes.
    ENV_BLOCK = "KINETIC_ENV_BLOCK"
    # A multi-host group (a TPU slice of several hosts, or hosts=N on kinetic-local): one job process per host,
    # the same function on each; host 0 is the coordinator, whose return value is the result.
    NUM_HOSTS = "KINETIC_NUM_HOSTS"
    HOST_INDEX = "KINETIC_HOST_INDEX"            # on GKE an Indexed Job's JOB_COMPLETION_INDEX stands in
    COORDINATOR_ADDRESS = "KINETIC_COORDINATOR_ADDRESS"  # host:port of host 0 (jax.distributed's coordinator)
    # A warm runner (kinetic-local) leaves once the process that started it (worker or caller) is gone.
    WARM_LAUNCHER_PID = "KINETIC_WARM_LAUNCHER_PID"


# --------------------------------------------------------------------------- warm runners (kinetic-local)

WARM_RUNNER_MODULE = "kinetic_prefect.warm_runner"


class WarmRunnerFiles:
    """The hand-over between a launcher and a warm runner (see warm_runner.py): files in the runner's control
    folder, except EXIT_STATUS, which the runner writes into the call's own job folder."""

    IDLE = "idle"              # the runner waits for a call; the launcher claims it by renaming this to CLAIMED
    CLAIMED = "claimed"
    LEAVING = "leaving"        # the runner's keep-warm time is over (renamed from IDLE, so no claim can race it)
    CALL = "call.json"         # {"job_dir", "log", "env", "keep_warm_seconds"}
    EXIT_STATUS = "exit_status"  # the call's runner exit status (EXIT_OUTCOME_RECORDED, EXIT_NO_OUTCOME...)

    # Variables that differ from call to call of one environment; every other one must match for a runner to
    # take a call (a variable read at import time, such as XLA_FLAGS, could not change in a running process).
    PER_CALL_ENV = (Env.RUN_ID, "KINETIC_RUN_PREFIX", Env.PAYLOAD_SHA256, Env.CODE_KEY, Env.CODE_SHA256,
                    Env.CHECKPOINT_KEY, Env.FLOW_RUN_ID, Env.ENV_BLOCK)
    PER_CALL_ENV_PREFIXES = ("PREFECT__",)  # Prefect's own per-run variables (PREFECT__FLOW_RUN_ID...)


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
    def from_env(cls, environ: "dict[str, str] | None" = None) -> "Group":
        import os

        env = os.environ if environ is None else environ
        size = int(env.get(Env.NUM_HOSTS) or 1)
        index = int(env.get(Env.HOST_INDEX) or env.get("JOB_COMPLETION_INDEX") or 0)
        if not 0 <= index < size:
            raise ValueError(f"host index {index} outside a group of {size}")
        return cls(index=index, size=size, coordinator=env.get(Env.COORDINATOR_ADDRESS) or None)


# --------------------------------------------------------------------------- store layout


@dataclass(frozen=True)
class RunLayout:
    """Where one job's objects live in the store."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"runs/{self.run_id}"

    @property
    def payload(self) -> str:
        return f"{self.prefix}/payload.pkl"

    @property
    def result(self) -> str:
        return f"{self.prefix}/result.pkl"

    @property
    def outcome(self) -> str:
        """Written last: its presence means the result is complete."""
        return f"{self.prefix}/outcome.json"

    @property
    def outputs(self) -> str:
        return f"outputs/{self.run_id}"

    def output(self, relative: str) -> str:
        return f"{self.outputs}/{relative}"

    def host_outputs(self, index: int) -> str:
        """A non-coordinator host's outputs; the coordinator's are ``outputs`` itself."""
        return f"{self.outputs}/hosts/{index}" if index else self.outputs

    def host_outcome(self, index: int) -> str:
        """A non-coordinator host's own outcome record (for the failure report); host 0 writes ``outcome``."""
        return f"{self.prefix}/hosts/{index}/outcome.json" if index else self.outcome


def checkpoints_key(task_run_or_run_id: str) -> str:
    """Keyed by the *task run*: a retry (a new job) resumes from what the killed one saved."""
    return f"checkpoints/{task_run_or_run_id}"


def code_key(sha256: str) -> str:
    return f"code/{sha256}.tar.gz"


# --------------------------------------------------------------------------- the outcome record

COMPLETED, FAILED = "completed", "failed"

# Phases of the runner; the outcome names the one that failed.
PHASE_FUNCTION = "running the function"
PHASE_PICKLE_RESULT = "pickling the result"


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, blob: bytes | str) -> "Outcome":
        raw: dict[str, Any] = json.loads(blob)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def summary(self) -> str:
        if self.completed:
            return f"Job finished in {self.duration_s:.2f}s"
        return f"Failed while {self.phase}: {self.error_type}: {self.message[:500]}"
