"""The caller's Prefect plumbing in one import; each job lives in its own module:

``prefect_runs`` (a job's flow run: create, follow, cancel, wait), ``pools`` (the work-pool registry),
``in_process`` (in-process submission), ``embedded_server`` (the local server bootstrap) and
``key_blocks`` (the signing key and forwarded env values kept in Prefect). Worker-side code imports
those modules directly: this one reaches the pool registry, which imports the workers.
"""

from __future__ import annotations

from kinetic_prefect.caller.embedded_server import EPHEMERAL_STARTUP_SECONDS, prepare_embedded_server
from kinetic_prefect.caller.in_process import in_process_slots, run_in_process
from kinetic_prefect.caller.pools import (
    WorkPoolError,
    abilities_of,
    ensure_work_pool,
    has_online_worker,
    pool_default,
    worker_class_for,
)
from kinetic_prefect.shared.key_blocks import (
    _signing_key_cache,
    forget_signing_key,
    signing_key,
    store_secret_env,
    unsigned_refusal,
)
from kinetic_prefect.shared.outages import is_transient
from kinetic_prefect.shared.prefect_runs import (
    LOG_PAGE,
    calling_task_run_id,
    cancel_flow_run,
    cancel_unstarted_run,
    create_job_flow_run,
    finish_cancelled_parent,
    read_flow_run_batched,
    read_task_run_or_none,
    run_interruptibly,
    shared_client,
    wait_for_final_state,
    with_retries,
)

__all__ = [
    "EPHEMERAL_STARTUP_SECONDS",
    "LOG_PAGE",
    "WorkPoolError",
    "_signing_key_cache",
    "calling_task_run_id",
    "cancel_flow_run",
    "cancel_unstarted_run",
    "create_job_flow_run",
    "ensure_work_pool",
    "finish_cancelled_parent",
    "forget_signing_key",
    "has_online_worker",
    "in_process_slots",
    "is_transient",
    "pool_default",
    "read_flow_run_batched",
    "read_task_run_or_none",
    "run_in_process",
    "run_interruptibly",
    "shared_client",
    "signing_key",
    "prepare_embedded_server",
    "store_secret_env",
    "unsigned_refusal",
    "wait_for_final_state",
    "with_retries",
    "worker_class_for",
    "abilities_of",
]
