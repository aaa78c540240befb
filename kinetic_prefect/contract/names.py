"""Names the caller, the worker and the job spell alike: the runner's modules and command, the worker types,
log and logger names, exit statuses, line prefixes and markers, artifact keys, events, tags and labels, debug mode's
port and wait (stdlib only; ships to the pod)."""

from __future__ import annotations

# --------------------------------------------------------------------------- the runner command

RUNNER_MODULE = "kinetic_prefect.pod.runner"
RUNNER_ARGV = ("python", "-u", "-m", RUNNER_MODULE)
RUNNER_COMMAND = " ".join(RUNNER_ARGV)

# The work-pool worker types (each a Prefect worker's ``type``, and the ``type`` of the pools it serves).
LOCAL_WORKER_TYPE = "kinetic-local"
GKE_WORKER_TYPE = "kinetic-gke"
VERTEX_WORKER_TYPE = "kinetic-vertex"
WORKER_TYPES = (LOCAL_WORKER_TYPE, GKE_WORKER_TYPE, VERTEX_WORKER_TYPE)
# What the lifecycle says of a job its pool has no capacity for (no node pool, full, a stockout or quota: its run ends
# Crashed before the job ran): the caller tries the next pool of a fallback list on it (caller/submission.py).
JOB_CANNOT_START = "cannot start (no capacity):"

# The name of the Failed state a worker gives a run it refuses because the caller signed it with another key than the
# worker's (after reading its key again): the caller raises SigningKeyMismatch, which no retry can fix.
KEY_MISMATCH_STATE = "SigningKeyMismatch"

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
# The other artifacts of a call, keyed so that the UI titles them (its artifact card shows the key, nothing without
# one): the job's progress and usage plot on its run, the list of its outputs on the calling task run.
PROGRESS_ARTIFACT_KEY = "kinetic-job-progress"
USAGE_PLOT_ARTIFACT_KEY = "kinetic-job-usage-plot"
OUTPUTS_ARTIFACT_KEY = "kinetic-job-outputs"
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
# kinetic-gke: a placeholder Job asks for a call's node while its image builds (workers/gke/placeholder.py); its
# label holds the call's flow run id, and it runs at this PriorityClass.
PLACEHOLDER_LABEL = "kinetic.prefect.io/placeholder-for"
PLACEHOLDER_PRIORITY_CLASS = "kinetic-placeholder"
# A job's start-up timeline (workers/startup.py), a table artifact on its run.
STARTUP_ARTIFACT_KEY = "kinetic-job-startup"
GROUP_TAG_PREFIX = "kinetic-group:"
GROUP_INDEX_TAG_PREFIX = "kinetic-group-index:"
# A batch that rides in slots (kinetic_prefect.kinetic.batch_inputs): its flow run ("kinetic-batch") and each input's
# task run carry BATCH_TAG and the pool's name; an input's objects lie under batch_input_run_id(task run, attempt).
BATCH_TAG = "kinetic-batch"
BATCH_POOL_TAG_PREFIX = "kinetic-batch-pool:"


def batch_input_run_id(task_run_id: object, run_count: int) -> str:
    """The store's run id (``RunLayout``) of one attempt of a batch input's task run, found again from the task run."""
    return f"{task_run_id}-{run_count}"


# Long-lived runners: a warm runner takes several calls (kinetic-local), a slot job a sweep's inputs.
WARM_RUNNER_MODULE = "kinetic_prefect.pod.warm_runner"
SLOT_RUNNER_MODULE = "kinetic_prefect.pod.slot_runner"

# A warm pod's log holds many calls; each call's lines are those between its two markers (+ the call's run id).
CALL_BEGIN_MARKER = "[kinetic:call] begin "
CALL_END_MARKER = "[kinetic:call] end "

# Events the worker emits on the job's run as it looks for capacity (kinetic.job.<phase>).
EVENT_FALLBACK = "fallback"
EVENT_PREEMPTED = "preempted"

# --------------------------------------------------------------------------- debug mode

DEBUG_PORT = 5678  # debugpy's default, and what VS Code fills in for an attach: the port in a pod and on the caller
DEFAULT_DEBUG_WAIT_SECONDS = 600.0  # how long a debug job waits for a client before it fails (Env.DEBUG_WAIT_SECONDS)
DEBUGPY_REQUIREMENT = "debugpy>=1.8"  # added to a debug job's requirements (only a debug call's env hash changes)
# The outcome's error type when nobody attached within the wait (the job never ran the function).
DEBUGGER_NOT_ATTACHED_TYPE = "DebuggerNotAttached"
