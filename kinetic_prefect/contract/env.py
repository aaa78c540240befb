"""The environment variables of this project: every ``KINETIC_*`` name a worker sets for a job, a job for its
function, or a caller or worker reads (stdlib only; ships to the pod). The tunable ones are also a ``Setting``
(``contract.settings``)."""

from __future__ import annotations

# Every variable of this project starts so (Env below); a caller's env= pattern never forwards one.
ENV_NAME_PREFIX = "KINETIC_"


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
    # The same for a job on another machine (kinetic-vertex, kinetic-gke): the calling process rewrites the run's
    # heartbeat record in the store (RunLayout.owner_heartbeat); a record left unchanged this many seconds means
    # the caller is gone, and the job stops.
    OWNER_HEARTBEAT = "KINETIC_OWNER_HEARTBEAT"
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
    # kinetic-gke, install_requirements_at_start: the job's requirements (JSON list), pip-installed as the pod starts
    INSTALL_REQUIREMENTS = "KINETIC_INSTALL_REQUIREMENTS"
    POD_NAME = "KINETIC_POD_NAME"  # kinetic-gke, debug mode: the pod's own name (downward API), for the record
    POD_NAMESPACE = "KINETIC_POD_NAMESPACE"


# How long the caller (waiting for a job) and the worker (following it) keep going while the Prefect API
# cannot be reached (a server restart, a network cut), in seconds. Past it the caller gives up and asks
# for the job to be stopped; before it, no job is stopped or failed only because the API was away.
API_OUTAGE_SECONDS_VAR = "KINETIC_API_OUTAGE_SECONDS"
DEFAULT_API_OUTAGE_SECONDS = 900.0
