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

RUNNER_MODULE = "kinetic_prefect.pod.runner"
RUNNER_ARGV = ("python", "-u", "-m", RUNNER_MODULE)
RUNNER_COMMAND = " ".join(RUNNER_ARGV)

# The work-pool worker types (each a Prefect worker's ``type``, and the ``type`` of the pools it serves).
LOCAL_WORKER_TYPE = "kinetic-local"
GKE_WORKER_TYPE = "kinetic-gke"
WORKER_TYPES = (LOCAL_WORKER_TYPE, GKE_WORKER_TYPE)

# A kinetic-local job's log files, in its job folder and among its outputs: host 0's, then host i's.
JOB_LOG_NAME = "job.log"


def host_log_name(index: int) -> str:
    return JOB_LOG_NAME if index == 0 else f"host-{index}.log"


# Exit statuses of the runner. Anything but EXIT_OUTCOME_RECORDED means "no outcome": the job crashed.
EXIT_OUTCOME_RECORDED = 0
EXIT_NO_OUTCOME = 3
# A host of a multi-host group (not the coordinator) whose function failed: the group fails with it.
EXIT_HOST_FAILED = 4


# The worker's last log line for a job, before it sets the final state: a caller that follows the
# job through Prefect's logs reads on until it sees it, so no line is lost to the race between a
# log batch and the state change.
LOG_END_MARKER = "[kinetic] end of job output"

# The logger name of the job's output lines in its run's Prefect logs (the worker stores them, in order, one
# request after another). A caller following the job keeps its place by these records alone: the worker's own
# notices go through Prefect's background log sender, which can store a record minutes after it was stamped
# (an API outage), so a place kept by them could pass output lines that were not stored yet.
JOB_OUTPUT_LOGGER = "kinetic_prefect.job_output"

# Every variable of this project starts so (Env below); a caller's env= pattern never forwards one.
ENV_NAME_PREFIX = "KINETIC_"

# A job reports progress by printing one line with this prefix and a JSON object
# ({"done": 7, "total": 20, "message": "epoch 7/20"}); the worker turns the latest one into a
# Prefect progress artifact on the job's run (the job itself cannot import Prefect).
PROGRESS_PREFIX = "[kinetic:progress] "

# The job's usage sampler (kinetic_prefect.pod.utilization) prints one line with this prefix and a JSON sample
# (host CPU and memory, NVML GPU figures, JAX device memory); the worker turns them into usage artifacts.
USAGE_PREFIX = "[kinetic:usage] "

# Cost records in Prefect: every job's cost table artifact carries JOB_COST_ARTIFACT_KEY (one key, a version
# per job), the calling flow run's running total FLOW_COST_ARTIFACT_KEY; the events automations match on.
JOB_COST_ARTIFACT_KEY = "kinetic-job-cost"
FLOW_COST_ARTIFACT_KEY = "kinetic-flow-cost"
USAGE_ARTIFACT_KEY = "kinetic-job-usage"
# A slot job's run of a sweep carries a table of the inputs it served (caller/slots.py publishes it).
SLOT_INPUTS_ARTIFACT_KEY = "kinetic-slot-inputs"
# Prefect events: a job's are JOB_EVENT_PREFIX + its phase (pending, running, cancelled, crashed: the launcher's
# JobStatus phases; and the EVENT_* below) on the job's run; automations match on these names.
JOB_EVENT_PREFIX = "kinetic.job."
EVENT_COST = "cost"
EVENT_DIAGNOSIS = "diagnosis"  # why a pod is stuck, in prefect-kubernetes' diagnosis vocabulary
EVENT_UNSCHEDULABLE = "unschedulable"
EVENT_EXITED = "exited"
JOB_COST_EVENT = JOB_EVENT_PREFIX + EVENT_COST
FLOW_COST_EVENT = "kinetic.flow-run.cost"
WARM_IDLE_EVENT = "kinetic.work-pool.warm-idle"  # a floor warm runner's idle time, the pool's cost
# A flow run tagged ``kinetic-max-cost-usd:25`` stops starting kinetic calls once its calls cost $25 and gives
# each call what is left of it as its budget.
FLOW_BUDGET_TAG_PREFIX = "kinetic-max-cost-usd:"
# The outcome's error_type when the worker stopped the job at its budget (the caller raises BudgetExceeded).
BUDGET_ERROR_TYPE = "kinetic_prefect.errors.BudgetExceeded"

# A job's flow run hangs under a tracking task run in the caller's flow run (Prefect's shape for a
# subflow called inside a task); its task key starts with this, so tools can tell it from user tasks.
TRACKING_TASK_KEY_PREFIX = "kinetic-job-"

# Tags of jobs submitted through the ``kinetic`` API (kinetic_prefect.kinetic): a detached job (nobody's subflow,
# collected later by whoever attaches to it), and a child of a ``run_async_map`` batch ("<prefix><group id>",
# "<prefix><index>/<inputs>"), so that a batch is found again from Prefect's records alone.
DETACHED_TAG = "kinetic-detached"
# A sweep's slot job run (caller/slots.py), and the sweep it serves.
SLOT_TAG = "kinetic-slot"
SWEEP_TAG_PREFIX = "kinetic-sweep:"
# Prefect labels on an in-process job's flow run: the calling process that will run it (a run it left Pending when
# it was killed before the job started is nobody's, and `jobs cancel` ends it).
OWNER_HOST_LABEL = "kinetic.owner.host"
OWNER_PID_LABEL = "kinetic.owner.pid"
OWNER_START_LABEL = "kinetic.owner.start-ticks"
GROUP_TAG_PREFIX = "kinetic-group:"
GROUP_INDEX_TAG_PREFIX = "kinetic-group-index:"
# A batch that rides in slots (kinetic_prefect.kinetic.batch_inputs): its flow run ("kinetic-batch") and each input's
# task run carry BATCH_TAG and the pool's name; an input's objects lie under batch_input_run_id(task run, attempt).
BATCH_TAG = "kinetic-batch"
BATCH_POOL_TAG_PREFIX = "kinetic-batch-pool:"


def batch_input_run_id(task_run_id: object, run_count: int) -> str:
    """The store's run id (``RunLayout``) of one attempt of a batch input's task run, found again from the task run."""
    return f"{task_run_id}-{run_count}"


# --------------------------------------------------------------------------- environment variables


class Env:
    """Names of the variables a worker sets for the job (and the job sets for the function)."""

    STORE = "KINETIC_STORE"  # store URL: a local directory or gs://bucket/prefix
    RUN_ID = "KINETIC_RUN_ID"  # the run's id in the store (RunLayout)
    FLOW_RUN_ID = "KINETIC_FLOW_RUN_ID"  # the job's Prefect flow run
    PAYLOAD_SHA256 = "KINETIC_PAYLOAD_SHA256"
    CODE_KEY = "KINETIC_CODE_KEY"
    CODE_SHA256 = "KINETIC_CODE_SHA256"
    CHECKPOINT_KEY = "KINETIC_CHECKPOINT_KEY"
    ACCELERATOR = "KINETIC_ACCELERATOR"  # the accelerator this attempt runs on (a fallback list's choice)
    ACCELERATOR_CHIPS = "KINETIC_ACCELERATOR_CHIPS"  # chips one host sees (0 on the CPU): size the batch by it
    PREEMPTIONS = "KINETIC_PREEMPTIONS"  # how often this call was preempted before this attempt (0 first)
    # Set for the function by the runner:
    OUTPUT_DIR = "KINETIC_OUTPUT_DIR"
    CHECKPOINT_DIR = "KINETIC_CHECKPOINT_DIR"
    CHECKPOINT_SYNC_SECONDS = "KINETIC_CHECKPOINT_SYNC_SECONDS"
    NODE_CACHE = "KINETIC_NODE_CACHE"
    # Only for a job whose owner is the calling process (in-process submission on kinetic-local):
    # when that process dies nobody can collect the result, so the job stops and cancels its run.
    OWNER_PID = "KINETIC_OWNER_PID"
    # The launcher's own folder for this job (kinetic-local: jobs/<run>), removed by the worker once the run is
    # final. The runner keeps its private working copy and temporary folders in it, so a job killed with SIGKILL
    # leaves nothing in TMPDIR; a job whose owner died removes it itself (no worker is left to). Unset: TMPDIR.
    JOB_DIR = "KINETIC_JOB_DIR"
    PREFECT_API_URL = "KINETIC_PREFECT_API_URL"
    PREFECT_API_KEY = "KINETIC_PREFECT_API_KEY"
    # Forwarded env= values for a polling worker travel in a Secret block it reads once and deletes.
    ENV_BLOCK = "KINETIC_ENV_BLOCK"
    # A multi-host group (a TPU slice of several hosts, or hosts=N on kinetic-local): one job process per host,
    # the same function on each; host 0 is the coordinator, whose return value is the result.
    NUM_HOSTS = "KINETIC_NUM_HOSTS"
    HOST_INDEX = "KINETIC_HOST_INDEX"  # on GKE an Indexed Job's JOB_COMPLETION_INDEX stands in
    # Set by kinetic-gke when the pod has Cloud Storage FUSE volumes: the directory under which each
    # Data(..., fuse=True) is mounted (FUSE_MOUNT_ROOT/<mount id>). Unset: the job reads FUSE data its own way.
    FUSE_ROOT = "KINETIC_FUSE_ROOT"
    COORDINATOR_ADDRESS = "KINETIC_COORDINATOR_ADDRESS"  # host:port of host 0 (jax.distributed's coordinator)
    # The run's prefix in the store (``runs/<id>``): the name jobs of kinetic-prefect 0.1 read instead of RUN_ID.
    RUN_PREFIX = "KINETIC_RUN_PREFIX"
    # Store signing (signing.py): the key, and the flag that tells a job its caller signed (so it insists).
    SIGNING_KEY = "KINETIC_SIGNING_KEY"
    SIGNING_KEY_PREVIOUS = "KINETIC_SIGNING_KEY_PREVIOUS"  # earlier master keys that still verify (rotation)
    SIGNED = "KINETIC_SIGNED"
    # The caller's signature over the job run's job variables (signing.sign_job_variables): the worker launches
    # nothing and hands out no key for a run whose variables a key holder did not sign.
    JOB_SIGNATURE = "KINETIC_JOB_SIGNATURE"
    UNSIGNED_SHARED_STORE = "KINETIC_UNSIGNED_SHARED_STORE"  # the explicit opt-out: unsigned on a gs:// store
    # Read on the caller's machine:
    UNSIGNED_OK = "KINETIC_UNSIGNED_OK"  # no warning about an unsigned store
    WORK_POOL = "KINETIC_WORK_POOL"  # the default work pool
    CACHE_DIR = "KINETIC_CACHE_DIR"  # kinetic-prefect's cache (environments, the local store)
    IN_PROCESS_CONCURRENCY = "KINETIC_IN_PROCESS_CONCURRENCY"
    EPHEMERAL_STARTUP_SECONDS = "KINETIC_EPHEMERAL_STARTUP_SECONDS"
    PAYLOAD_CACHE = "KINETIC_PAYLOAD_CACHE"  # 0 turns the payload cache off
    PAYLOAD_WARN_BYTES = "KINETIC_PAYLOAD_WARN_BYTES"
    # On the worker's machine: the project checkout a deployment's pull step changes into (steps.py).
    PROJECT_DIR = "KINETIC_PROJECT_DIR"
    # On a kinetic-local machine: the devices a job may use (e.g. ``cuda``), instead of the detected ones.
    LOCAL_DEVICES = "KINETIC_LOCAL_DEVICES"
    USAGE_SAMPLE_SECONDS = "KINETIC_USAGE_SAMPLE_SECONDS"  # the usage sampler's interval (default 2; 0: off)
    # A warm runner (kinetic-local) leaves once the process that started it (worker or caller) is gone.
    WARM_LAUNCHER_PID = "KINETIC_WARM_LAUNCHER_PID"
    # A warm pod (kinetic-gke): its control prefix in the store (WarmPodKeys), and how long it waits idle.
    WARM_CONTROL = "KINETIC_WARM_CONTROL"
    WARM_KEEP_SECONDS = "KINETIC_WARM_KEEP_SECONDS"
    # A floor pod (min_warm): what it bills its idle time as when it leaves by its idle limit (WarmPodKeys.left),
    # a JSON object {"pool", "accelerator", "runner"}.
    WARM_FLOOR = "KINETIC_WARM_FLOOR"
    # A slot job of a sweep (SweepKeys): the sweep's id in the store; its runner takes the sweep's inputs one
    # after another, and waits this long for another once the queue is empty.
    SWEEP_ID = "KINETIC_SWEEP_ID"
    SLOT_IDLE_SECONDS = "KINETIC_SLOT_IDLE_SECONDS"
    SWEEP_SLOTS = "KINETIC_SWEEP_SLOTS"  # the most slot jobs one sweep runs (settings.SWEEP_SLOTS)
    # Debug mode (debug=True): the runner starts debugpy and waits for a client before it calls the function.
    DEBUG = "KINETIC_DEBUG"  # "1": wait for a debugger
    DEBUG_PORT = "KINETIC_DEBUG_PORT"  # the port debugpy listens on in the job (unset: a free one, kinetic-local)
    DEBUG_WAIT_SECONDS = "KINETIC_DEBUG_WAIT_SECONDS"  # how long it waits for a client (DEFAULT_DEBUG_WAIT_SECONDS)
    DEBUG_CALLER_ROOT = "KINETIC_DEBUG_CALLER_ROOT"  # the caller's project root: the editor's side of pathMappings
    DEBUG_SOURCES = "KINETIC_DEBUG_SOURCES"  # JSON {module: file under the project root} of by-value modules
    # The caller's port a blocking kinetic.run(debug=True) call forwards to its job's debugger (unset: DEBUG_PORT).
    DEBUG_LOCAL_PORT = "KINETIC_DEBUG_LOCAL_PORT"
    POD_NAME = "KINETIC_POD_NAME"  # kinetic-gke, debug mode: the pod's own name (downward API), for the record
    POD_NAMESPACE = "KINETIC_POD_NAMESPACE"


# --------------------------------------------------------------------------- warm runners and warm pods

WARM_RUNNER_MODULE = "kinetic_prefect.pod.warm_runner"


class WarmRunnerFiles:
    """The hand-over between a launcher and a warm runner (see warm_runner.py): files in the runner's control
    folder, except EXIT_STATUS, which the runner writes into the call's own job folder."""

    IDLE = "idle"  # the runner waits for a call; the launcher claims it by renaming this to CLAIMED
    CLAIMED = "claimed"
    LEAVING = "leaving"  # the runner's keep-warm time is over (renamed from IDLE, so no claim can race it)
    CALL = "call.json"  # {"job_dir", "log", "env", "keep_warm_seconds"}
    EXIT_STATUS = "exit_status"  # the call's runner exit status (EXIT_OUTCOME_RECORDED, EXIT_NO_OUTCOME...)
    # The runner left by itself, idle: {"idle_since", "left_at" (epoch seconds), "calls", "why": LEFT_IDLE_LIMIT or
    # LEFT_LAUNCHER_GONE}, written before it exits; its launcher bills a floor runner's idle time to the pool from it.
    LEFT = "left.json"
    LEFT_IDLE_LIMIT = "idle limit"
    LEFT_LAUNCHER_GONE = "launcher gone"

    @staticmethod
    def exit_status_name(host_index: int) -> str:
        """The exit record a runner writes into its job folder as it ends (a cold job's too): its contents are
        the exit status, its modification time is when the host's work ended, which metering bills up to."""
        return WarmRunnerFiles.EXIT_STATUS if host_index == 0 else f"{WarmRunnerFiles.EXIT_STATUS}-{host_index}"

    # Variables that differ from call to call of one environment; every other one must match for a runner to
    # take a call (a variable read at import time, such as XLA_FLAGS, could not change in a running process).
    PER_CALL_ENV = (
        Env.RUN_ID,
        Env.RUN_PREFIX,
        Env.PAYLOAD_SHA256,
        Env.CODE_KEY,
        Env.CODE_SHA256,
        Env.CHECKPOINT_KEY,
        Env.FLOW_RUN_ID,
        Env.ENV_BLOCK,
        Env.JOB_DIR,  # the call's own folder (its working copy of the project, its log)
        Env.JOB_SIGNATURE,  # the caller's signature over this call's job variables (checked by the worker)
    )
    PER_CALL_ENV_PREFIXES = ("PREFECT__",)  # Prefect's own per-run variables (PREFECT__FLOW_RUN_ID...)

    @classmethod
    def is_per_call(cls, name: str) -> bool:
        return name in cls.PER_CALL_ENV or name.startswith(cls.PER_CALL_ENV_PREFIXES)


class WarmPodKeys:
    """The hand-over between the kinetic-gke launcher and its warm pods, through the store (a pod and the worker
    share no folder; the store's create-if-absent stands in for the local runner's rename). Under one pod's
    control prefix ``warm/<environment key>/<job name>/``:

    * the pod writes ``ready-<n>`` once it has served n calls and waits for call n (its content: ``idle_since``,
      the time it began to wait);
    * whoever creates ``claim-<n>`` first owns call n: a launcher handing over a call, or the pod itself leaving
      (its keep-warm time is over), so a claim and a departure cannot both win;
    * the winning launcher writes ``call-<n>.json`` (the call's per-call variables); the pod takes it, runs it
      between the CALL_BEGIN and CALL_END lines of its log, and writes the call's ``RunLayout.warm_exit``.
    """

    ROOT = "warm"

    @staticmethod
    def control(environment_key: str, job_name: str) -> str:
        return f"warm/{environment_key}/{job_name}"

    @staticmethod
    def ready(n: int) -> str:
        return f"ready-{n}"

    @staticmethod
    def claim(n: int) -> str:
        return f"claim-{n}"

    @staticmethod
    def call(n: int) -> str:
        return f"call-{n}.json"

    RUNS = "warm/runs/"  # the prefix of every ``run`` record: a restarted worker lists it

    @staticmethod
    def run(flow_run_id: str) -> str:
        """Which pod serves a flow run (``namespace:job@flow_run_id``): a restarted worker finds its calls again."""
        return f"{WarmPodKeys.RUNS}{flow_run_id}"

    LEAVING = b"leaving"  # the content of a claim the pod made to leave

    # A floor pod that left by its idle limit: its idle time, for whoever reaches Prefect to bill to its pool
    # (``Env.WARM_FLOOR`` and {"idle_since", "left_at", "calls"}), outside its control prefix (deleted as it leaves).
    # The one that creates ``billed(job)`` first publishes it, then deletes both.
    LEFT = "warm/left/"

    @staticmethod
    def left(job_name: str) -> str:
        return f"{WarmPodKeys.LEFT}{job_name}.json"

    @staticmethod
    def billed(job_name: str) -> str:
        return f"{WarmPodKeys.LEFT}{job_name}.billed"


# --------------------------------------------------------------------------- sweeps in slots

SLOT_RUNNER_MODULE = "kinetic_prefect.pod.slot_runner"


@dataclass(frozen=True)
class SweepKeys:
    """The hand-over between a sweep's caller and its slot jobs, through the store (``sweeps/<sweep id>/``).

    * the caller writes ``queue/<seq>-<run id>.json`` per input (its per-call variables, the input's task run),
      signed as a payload is when the store is signed;
    * a slot takes an input by creating ``claims/<run id>`` (create-if-absent: a rename-free create on a local
      store, ``ifGenerationMatch=0`` on GCS), so no input runs twice; a caller that stops waiting before any slot
      took its input withdraws it the same way (content WITHDRAWN);
    * the slot runs the input with the input's own ``RunLayout`` (payload, result, outcome); while it runs, the
      input's output goes to ``logs/<run id>/<n>`` in chunks of whole lines (n = 0, 1, ...: the caller forwards
      each new chunk to the input's task run as it appears), and ``done/<run id>`` ({"exit_code", "slot",
      "stopped", "status", "error_type", "seconds"}) is written last, after the last chunk;
    * ``stop/<run id>``: the caller stopped waiting for that input (timeout, interrupt, fail_fast): its slot
      stops it; ``closed``: no input is left to come, idle slots leave.
    """

    sweep_id: str

    ROOT = "sweeps"
    WITHDRAWN = b"withdrawn"
    QUEUED_SUFFIX = ".json"

    @property
    def prefix(self) -> str:
        return f"{self.ROOT}/{self.sweep_id}"

    @property
    def queue(self) -> str:
        return f"{self.prefix}/queue/"

    def queued(self, seq: int, run_id: str) -> str:
        return f"{self.queue}{seq:06d}-{run_id}{self.QUEUED_SUFFIX}"

    @classmethod
    def run_id_of(cls, queued_key: str) -> str:
        return queued_key.rsplit("/", 1)[-1].split("-", 1)[1].removesuffix(cls.QUEUED_SUFFIX)

    @property
    def claims(self) -> str:
        return f"{self.prefix}/claims/"

    def claim(self, run_id: str) -> str:
        return f"{self.claims}{run_id}"

    @property
    def done_prefix(self) -> str:
        return f"{self.prefix}/done/"

    def done(self, run_id: str) -> str:
        return f"{self.done_prefix}{run_id}"

    def stop(self, run_id: str) -> str:
        return f"{self.prefix}/stop/{run_id}"

    @property
    def logs(self) -> str:
        return f"{self.prefix}/logs/"

    def log_prefix(self, run_id: str) -> str:
        return f"{self.logs}{run_id}/"

    def log_chunk(self, run_id: str, n: int) -> str:
        return f"{self.log_prefix(run_id)}{n:06d}"

    @staticmethod
    def log_chunk_of(chunk_key: str) -> tuple[str, int]:
        """(run id, n) of a ``log_chunk`` key."""
        run_id, n = chunk_key.rstrip("/").rsplit("/", 2)[-2:]
        return run_id, int(n)

    @property
    def closed(self) -> str:
        return f"{self.prefix}/closed"


# A warm pod's log holds many calls; each call's lines are those between its two markers (+ the call's run id).
CALL_BEGIN_MARKER = "[kinetic:call] begin "
CALL_END_MARKER = "[kinetic:call] end "


JAX_COORDINATOR_PORT = 8476  # the port GKE's TPU tooling and jax.distributed use by default

# --------------------------------------------------------------------------- debug mode

DEBUG_PORT = 5678  # debugpy's default, and what VS Code fills in for an attach: the port in a pod and on the caller
DEFAULT_DEBUG_WAIT_SECONDS = 600.0  # how long a debug job waits for a client before it fails (Env.DEBUG_WAIT_SECONDS)
DEBUGPY_REQUIREMENT = "debugpy>=1.8"  # added to a debug job's requirements (only a debug call's env hash changes)
# The outcome's error type when nobody attached within the wait (the job never ran the function).
DEBUGGER_NOT_ATTACHED_TYPE = "DebuggerNotAttached"


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


# --------------------------------------------------------------------------- store layout


@dataclass(frozen=True)
class RunLayout:
    """Where one job's objects live in the store."""

    run_id: str

    ROOT = "runs"

    @property
    def prefix(self) -> str:
        return f"{self.ROOT}/{self.run_id}"

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

    @property
    def warm_exit(self) -> str:
        """A warm pod's record of one call it ran: {"exit_code", "started", "ended"} (epoch seconds)."""
        return f"{self.prefix}/warm_exit.json"

    @property
    def capacity(self) -> str:
        """The worker's record of the attempts (fallbacks, preemptions) and the accelerator that ran."""
        return f"{self.prefix}/capacity.json"

    @property
    def debugger(self) -> str:
        """A debug job's record of where its debugpy listens: {"host", "port", "pod", "namespace", "pid",
        "remote_root", "caller_root"}; written by the runner once it listens, before it waits for a client."""
        return f"{self.prefix}/debugger.json"

    def host_outputs(self, index: int) -> str:
        """A non-coordinator host's outputs; the coordinator's are ``outputs`` itself."""
        return f"{self.outputs}/hosts/{index}" if index else self.outputs

    def host_outcome(self, index: int) -> str:
        """A non-coordinator host's own outcome record (for the failure report); host 0 writes ``outcome``."""
        return f"{self.prefix}/hosts/{index}/outcome.json" if index else self.outcome

    def host_outputs_manifest(self, index: int) -> str:
        """The signed list of one host's outputs (``files_manifest_key`` of ``host_outputs(index)``)."""
        return files_manifest_key(self.host_outputs(index))


def job_variables_name(run_id: str) -> str:
    """What a job run's variables are signed as: no object is stored under it, and it is in the store's own
    scope, which no job holds a key for."""
    return f"job-variables/{run_id}"


def checkpoints_key(task_run_or_run_id: str) -> str:
    """Keyed by the *task run*: a retry (a new job) resumes from what the killed one saved."""
    return f"checkpoints/{task_run_or_run_id}"


# The signed list of the files under a checkpoint folder or a host's outputs: {relative path: [[size, sha256], ...]}
# (every version the store may hold; one, once a save is complete). Written last, so it also marks them complete;
# a reader with the key uses only the files it lists, each checked against its sha256.
FILES_MANIFEST_NAME = ".kinetic-manifest.json"


def files_manifest_key(prefix: str) -> str:
    """The manifest of the files under ``prefix`` (a ``checkpoints_key`` or a ``RunLayout.host_outputs``)."""
    return f"{prefix.rstrip('/')}/{FILES_MANIFEST_NAME}"


def code_key(sha256: str) -> str:
    """The project archive, stored once per content hash and shared by every run that ships it."""
    return f"code/{sha256}.tar.gz"


# Where kinetic-gke mounts the Cloud Storage FUSE volumes of Data(..., fuse=True), one directory per mount id;
# Kinetic reserves the same prefix, so a volumes= mount path below it is refused.
FUSE_MOUNT_ROOT = "/_kinetic/fuse-data"


def data_key(sha256: str) -> str:
    """An uploaded ``Data`` argument (a file or folder), stored once per content hash."""
    return f"data/{sha256}"


def data_files_key(key: str) -> str:
    """Under a ``data_key``: the files themselves, as the caller's tree had them."""
    return f"{key}/files"


def data_manifest_key(key: str) -> str:
    """Under a ``data_key``: the manifest, written last (first writer wins), so its presence means complete."""
    return f"{key}/manifest.json"


def lock_key(name: str) -> str:
    """A cache-isolation lock (locks.py); ``name`` is already safe as a key."""
    return f"locks/{name}.json"


def results_prefix(store_prefix: str) -> str:
    """Where Prefect's result storage keeps task results, under the store's own prefix."""
    return f"{store_prefix}/results" if store_prefix else "results"


# --------------------------------------------------------------------------- the capacity record

# Events the worker emits on the job's run as it looks for capacity (kinetic.job.<phase>).
EVENT_FALLBACK = "fallback"
EVENT_PREEMPTED = "preempted"


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


# --------------------------------------------------------------------------- the outcome record

COMPLETED, FAILED = "completed", "failed"

# Phases of the runner, in order; the outcome names the one that failed.
PHASE_READ_ENV = "reading the job environment"
PHASE_OPEN_STORE = "opening the store"
PHASE_FETCH_PAYLOAD = "fetching the payload"
PHASE_VERIFY_PAYLOAD = "verifying the payload"
PHASE_RESTORE_CODE = "restoring the project code"
PHASE_UNPICKLE_CALL = "unpickling the call"
PHASE_FETCH_DATA = "fetching the data"
PHASE_RESTORE_CHECKPOINTS = "restoring checkpoints"
PHASE_JOIN_GROUP = "joining the group of {size} hosts as host {index}"  # str.format(size=..., index=...)
PHASE_WAIT_DEBUGGER = "waiting for a debugger to attach"
PHASE_FUNCTION = "running the function"
PHASE_SAVE_CHECKPOINTS = "saving checkpoints"
PHASE_UPLOAD_OUTPUTS = "uploading outputs"
PHASE_PICKLE_RESULT = "pickling the result"
PHASE_WRITE_RESULT = "writing the result"
PHASE_WORKING_COPY = "copying the project into the job's own working directory"
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


# --------------------------------------------------------------------------- Prefect API outages

# How long the caller (waiting for a job) and the worker (following it) keep going while the Prefect API
# cannot be reached (a server restart, a network cut), in seconds. Past it the caller gives up and asks
# for the job to be stopped; before it, no job is stopped or failed only because the API was away.
API_OUTAGE_SECONDS_VAR = "KINETIC_API_OUTAGE_SECONDS"
DEFAULT_API_OUTAGE_SECONDS = 900.0
