"""The runner's phases, in order: the outcome names the one that failed (stdlib only; ships to the pod)."""

from __future__ import annotations

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

# A job's start-up as the worker times it (workers/startup.py: its logs, its artifact, `jobs status`), in order.
STARTUP_SUBMITTED = "submitted"
STARTUP_IMAGE_READY = "image ready"
STARTUP_SCALE_UP_ASKED = "scale-up asked"
STARTUP_NODE_READY = "node ready"
STARTUP_IMAGE_PULLED = "image pulled"
STARTUP_CONTAINER_STARTED = "container started"
STARTUP_FIRST_LINE = "first line"
STARTUP_FINISHED = "finished"
STARTUP_STEPS = (
    STARTUP_SUBMITTED,
    STARTUP_IMAGE_READY,
    STARTUP_SCALE_UP_ASKED,
    STARTUP_NODE_READY,
    STARTUP_IMAGE_PULLED,
    STARTUP_CONTAINER_STARTED,
    STARTUP_FIRST_LINE,
    STARTUP_FINISHED,
)
