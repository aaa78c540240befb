"""Caller side: turn one call of a kinetic task into a job and bring its outcome back.

Runs inside the Prefect task run, so caching and retries stay Prefect's: a cache hit never
reaches this module, and whatever it raises (a remote exception, a crashed job) lets Prefect
retry, which calls it again and launches a new job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
from anyio import to_thread
from prefect import get_client
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from kinetic_prefect import accelerators, config, signing
from kinetic_prefect.caller import _prefect, budgets, data_mounts, debugging, slots
from kinetic_prefect.caller.data_repair import heal_before_call, heal_reported
from kinetic_prefect.caller.env_capture import check_entries, forwarded_environment
from kinetic_prefect.caller.payload import build_call_payload
from kinetic_prefect.caller.project_archive import cached_project_archive, find_project_dir, sha256_hex
from kinetic_prefect.caller.remote_errors import raise_remote

# The remote-exception decoding's public names, for callers that import them from here.
from kinetic_prefect.caller.remote_errors import readable_traceback as readable_traceback
from kinetic_prefect.caller.remote_errors import rebuild_exception as rebuild_exception
from kinetic_prefect.contract import PHASE_RESTORE_CODE, Env, Outcome, RunLayout, checkpoints_key
from kinetic_prefect.errors import KineticJobCrashed, PayloadError
from kinetic_prefect.pod import data
from kinetic_prefect.shared import capacity, gcp
from kinetic_prefect.shared.image import ImageSpec
from kinetic_prefect.shared.outages import Outage

SUBMISSION_MODES = ("auto", "in-process", "worker")


@dataclass(frozen=True)
class KineticOptions:
    """Where and how a kinetic task's body runs (everything that is not a Prefect task option)."""

    accelerator: accelerators.AcceleratorSpec
    image_spec: ImageSpec
    image: str | None = None
    work_pool: str | None = None
    env: tuple[str, ...] = ()
    env_missing: str = "error"  # an unset exact name in `env`: "error" fails the call, "warn" leaves it out
    submission: str = "auto"
    project_dir: Path | None = None
    ship_project: bool = True
    job_variables: dict[str, Any] = field(default_factory=dict)
    hosts: int | None = None  # a group of N hosts (one jax.distributed group); None: the accelerator's own
    max_cost_usd: float | None = None  # the worker stops the job when its metered cost reaches it
    fallbacks: tuple[accelerators.AcceleratorSpec, ...] = ()  # tried in order after `accelerator` (capacity.py)
    preemption_retries: int | None = None  # None: the pool's
    spot_fallback: bool | None = None  # None: the pool's
    debug: bool = False  # the job waits for a debugger before the function runs (caller/debugging.py)

    def __post_init__(self) -> None:
        if self.preemption_retries is not None and (
            isinstance(self.preemption_retries, bool)
            or not isinstance(self.preemption_retries, int)
            or self.preemption_retries < 0
        ):
            raise ValueError(
                f"preemption_retries={self.preemption_retries!r}: give a whole number >= 0 (0: a "
                "preemption crashes the run and the task's `retries` decide)"
            )
        check_entries(self.env, self.env_missing)
        if self.submission not in SUBMISSION_MODES:
            raise ValueError(f"submission={self.submission!r} is not one of {', '.join(SUBMISSION_MODES)}")
        if self.project_dir is not None and not Path(self.project_dir).is_dir():
            raise ValueError(f"project_dir={str(self.project_dir)!r} is not a directory")


@dataclass
class PreparedCall:
    """Everything computed before contacting Prefect or storage; failing here stores nothing."""

    layout: RunLayout
    payload: bytes
    payload_sha256: str
    code_archive: Any | None
    env: dict[str, str]
    data: list[Any]  # data.Manifest of each local Data argument, uploaded at submission
    task_run_id: str | None = None
    store: Any = None  # once opened: where a call that ends without an outcome removes its run's objects
    outcome_read: bool = False  # the job's outcome was read: its record stays as the run's receipt
    project_dir: Path | None = None  # the shipped project's root on this machine (a debugger maps it)
    fuse: list[Any] = field(default_factory=list)  # the Data(..., fuse=True) of the call (caller/data_mounts.py)


def _swap_data(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list[Any]]:
    """Hash every Data argument (wherever it is nested) and put a DataRef in its place."""
    manifests: dict[str, Any] = {}

    def to_ref(item: data.Data) -> data.DataRef:
        manifest = None if item.is_remote or item.fuse else data.hash_local(item)
        if manifest is not None:
            manifests[manifest.sha256] = manifest
        return data.to_ref(item, manifest)

    new_args = data.transform(args, to_ref, data.Data)
    new_kwargs = data.transform(kwargs, to_ref, data.Data)
    return new_args, new_kwargs, list(manifests.values())


def prepare(options: KineticOptions, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> PreparedCall:
    project_dir = Path(options.project_dir).resolve() if options.project_dir else find_project_dir(fn)
    data_paths = [d.local_path for d in data.find((args, kwargs), data.Data) if d.local_path is not None]
    fuse = data_mounts.fuse_data(args, kwargs)
    args, kwargs, manifests = _swap_data(args, kwargs)
    payload = build_call_payload(fn, args, kwargs, project_dir)
    # Data passed as Data travels by its own content-addressed route, never inside the code archive.
    archive = cached_project_archive(project_dir, exclude=data_paths) if options.ship_project else None
    env = forwarded_environment(options.env, options.env_missing)
    return PreparedCall(
        layout=RunLayout(str(uuid.uuid4())),
        payload=payload,
        payload_sha256=sha256_hex(payload),
        project_dir=project_dir,
        code_archive=archive,
        env=env,
        data=manifests,
        task_run_id=str(ctx.task_run.id) if (ctx := TaskRunContext.get()) else None,
        fuse=fuse,
    )


# Content-addressed objects this process has checked in each store: checked once, trusted after.
_verified_objects: set[tuple[str, str]] = set()


def _ensure_content_addressed(store: Any, key: str, blob: bytes, sha256: str) -> None:
    """Upload ``blob`` under ``key`` unless the store already has exactly it.

    An object that exists but fails its check (a torn copy, a disk error, someone's edit) is
    replaced, instead of failing every later call on the job side.
    """
    from kinetic_prefect.storage import ObjectNotFound

    marker = (store.url_for(key), key)
    # A local object costs a file read to check, so it is checked on every call; a remote one once
    # per process (and dropped from trust when a job reports it broken, see _forget_broken_code).
    if marker in _verified_objects and store.local_path(key) is None:
        return
    try:
        stored = store.get_bytes(key)
    except ObjectNotFound:
        stored = None
    if stored is None:
        store.put_bytes(key, blob, if_absent=True)
    elif sha256_hex(stored) != sha256:
        store.put_bytes(key, blob)
    _verified_objects.add(marker)


def _forget_broken_code(store: Any, call: PreparedCall, outcome: Outcome) -> None:
    """The job could not verify or unpack the project archive: delete it so the next call (or
    this task's retry) uploads a good copy instead of failing the same way forever."""
    if call.code_archive is None or outcome.user_error or outcome.phase != PHASE_RESTORE_CODE:
        return
    _verified_objects.discard((store.url_for(call.code_archive.key), call.code_archive.key))
    with contextlib.suppress(Exception):
        store.delete(call.code_archive.key)


class UploadProgress:
    """Progress of one Data upload: a bar in the terminal (when stderr is one) and a Prefect progress
    artifact on the task run, updated at most once a second (called from the uploading threads)."""

    def __init__(self, name: str, total_bytes: int, task_run_id: str | None):
        import threading

        self.name, self.total, self.task_run_id = name, max(1, total_bytes), task_run_id
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._artifact_id: Any = None
        self._tty = sys.stderr.isatty()

    def __call__(self, size: int) -> None:
        import time

        with self._lock:
            self.done += size
            now = time.monotonic()
            if now - self._last < 1.0 and self.done < self.total:
                return
            self._last = now
            self.show()

    def show(self) -> None:
        percent = 100.0 * min(self.done, self.total) / self.total
        text = f"Data {self.name}: {self.done / 2**20:.1f} of {self.total / 2**20:.1f} MiB uploaded"
        if self._tty:
            bar = "#" * int(percent / 4)
            print(
                f"\r[{bar:<25}] {percent:5.1f}% {text}",
                end="\n" if self.done >= self.total else "",
                file=sys.stderr,
                flush=True,
            )
        if self.task_run_id is None:
            return
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        try:
            with get_client(sync_client=True) as client:
                if self._artifact_id is None:
                    self._artifact_id = client.create_artifact(
                        ArtifactCreate(
                            type="progress", data=percent, description=text, task_run_id=uuid.UUID(self.task_run_id)
                        )
                    ).id
                else:
                    client.update_artifact(self._artifact_id, ArtifactUpdate(data=percent, description=text))
        except Exception:  # progress never fails an upload
            pass


def _upload_inputs(store: Any, call: PreparedCall, logger: Any, key: bytes | None = None) -> None:
    if call.code_archive is not None:
        _ensure_content_addressed(store, call.code_archive.key, call.code_archive.data, call.code_archive.sha256)
    for manifest in call.data:
        total = sum(size for _rel, size, _sha in manifest.files)
        uploaded = data.upload(
            manifest,
            store,
            key=key,
            heal=heal_before_call,
            on_file=UploadProgress(manifest.root.name, total, call.task_run_id),
        )
        if logger:
            logger.info(
                f"Data {manifest.root.name} ({len(manifest.files)} files, sha256 {manifest.sha256[:12]}): "
                + (f"uploaded {uploaded / 2**20:.1f} MiB" if uploaded else "already in the store")
            )
    signing.put(store, call.layout.payload, call.payload, key)


async def _publish_outputs(store: Any, call: PreparedCall, outcome: Outcome, run_name: str) -> None:
    """A table artifact on the task run listing what the job left in KINETIC_OUTPUT_DIR."""
    if not outcome.outputs or TaskRunContext.get() is None:
        return
    from prefect.artifacts import acreate_table_artifact

    rows = [{"file": rel, "url": store.url_for(call.layout.output(rel))} for rel in outcome.outputs]
    await Outage(f"the caller of {run_name}").call(
        lambda: acreate_table_artifact(rows, description=f"Outputs of kinetic job {run_name} ({outcome.status})"),
        "listing the job's outputs",
    )


def check_hosts(options: KineticOptions, pool_name: str, pool_type: str, pool_variables: set[str]) -> None:
    """Before anything is uploaded: a group of hosts needs a pool whose job template takes ``hosts`` (both
    kinetic pool types ship it; a pool created from an older template lacks it and would run one process)."""
    hosts = options.job_variables.get("hosts", options.hosts)
    count = accelerators.host_count(options.accelerator, hosts)
    if hosts is not None and count > 1 and "hosts" not in pool_variables:
        raise ValueError(
            f"hosts={hosts}: pool {pool_name!r} (type {pool_type!r}) cannot run a group of hosts: its base job "
            f"template has no `hosts` variable (made before multi-host groups). Update the template, e.g. "
            f"`prefect work-pool update {pool_name} --base-job-template work_pools/{pool_type}.json`, "
            "or drop hosts= to run on one host."
        )


def _job_variables(
    options: KineticOptions, call: PreparedCall, store_url: str, pool_variables: set[str]
) -> dict[str, Any]:
    env = {
        Env.RUN_ID: call.layout.run_id,
        Env.RUN_PREFIX: call.layout.prefix,  # the name jobs of kinetic-prefect 0.1 read
        Env.PAYLOAD_SHA256: call.payload_sha256,
        "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "jax"),
        "JAX_PLATFORMS": options.accelerator.jax_platform,
        # Keyed by the task run, not the job: a retry (a new job) resumes from the same checkpoints.
        Env.CHECKPOINT_KEY: checkpoints_key(call.task_run_id or call.layout.run_id),
    }
    if call.code_archive is not None:
        env[Env.CODE_KEY] = call.code_archive.key
        env[Env.CODE_SHA256] = call.code_archive.sha256
    debug = debugging.job_variables(options, call.project_dir, pool_variables)
    env.update(debug.pop("env", {}))
    spec = debugging.job_image_spec(options, pool_variables)
    variables: dict[str, Any] = {
        **options.job_variables,
        "accelerator": capacity.join([options.accelerator, *options.fallbacks]),
        "image_tag": options.image or spec.tag,
        "requirements": list(spec.requirements),
        "python_version": spec.python,
        "base_image": spec.base_image,
        "store": store_url,
        **debug,
    }
    if options.hosts is not None and "hosts" in pool_variables:
        variables["hosts"] = options.hosts
    for name in ("preemption_retries", "spot_fallback"):
        if getattr(options, name) is not None and name in pool_variables:
            variables[name] = getattr(options, name)
    variables["env"] = {**options.job_variables.get("env", {}), **env}
    if options.image and "image" in pool_variables:
        variables["image"] = options.image
    return variables


async def _submit_and_collect(
    options: KineticOptions, call: PreparedCall, task_name: str, fn: Callable[..., Any], detach: Any = None
) -> Any:
    """``_submit_and_wait``, and whatever way it ends without the job's outcome (a timeout or Ctrl-C at any
    point after the upload, a crashed job, an error creating the run), the run's objects are removed."""
    ctx = TaskRunContext.get()
    siblings = (ctx.task_run.flow_run_id if ctx else None, task_name)  # calls of a sweep count each other
    try:
        with slots.calling(siblings):
            return await _submit_and_wait(options, call, task_name, fn, detach)
    except BaseException:
        if call.store is not None and not call.outcome_read:
            await _discard_interrupted_run(call.store, call)
        raise


def check_job_variables(
    pool_name: str, pool_variables: set[str], job_variables: dict[str, Any], variables_model: Any
) -> None:
    """A job variable the pool does not have (a typo, ``keep_warm_secnds``) or a value its type refuses fails here,
    naming it, instead of being ignored by the template or failing in the worker as a raw validation error."""
    import difflib

    from pydantic import TypeAdapter, ValidationError

    fields = getattr(variables_model, "model_fields", {}) or {}
    for name, value in job_variables.items():
        if name not in pool_variables:
            close = difflib.get_close_matches(name, sorted(pool_variables), 1)
            raise ValueError(
                f"job_variables[{name!r}]: pool {pool_name!r} has no variable {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" Its variables: {', '.join(sorted(pool_variables))}."
            )
        field = fields.get(name)
        if field is None or value is None:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(value)
        except ValidationError as exc:
            problem = exc.errors()[0].get("msg", str(exc))
            raise ValueError(
                f"job_variables[{name!r}]={value!r}: {problem}"
                + (f" ({name}: {field.description})" if field.description else "")
            ) from None


async def _check_against_pool(client: Any, options: KineticOptions, pool: Any) -> float | None:
    """The call's settings checked against its pool's, before anything is uploaded; the budget it runs under."""
    worker_class = _prefect.worker_class_for(pool.type)
    pool_variables = set(pool.base_job_template["variables"]["properties"])
    check_job_variables(
        pool.name, pool_variables, options.job_variables, getattr(worker_class, "job_configuration_variables", None)
    )
    worker_class.check_pool_settings(
        pool.name,
        {name: _prefect.pool_default(pool, name) for name in pool_variables},
        {**options.job_variables, **({"image": options.image} if options.image else {})},
    )
    check_hosts(options, pool.name, pool.type, pool_variables)
    debugging.check(options, pool.name, pool_variables)
    budget = await budgets.call_budget(client, options.max_cost_usd, pool, pool_variables)
    budgets.check_priced(
        options.accelerator,
        budget,
        pool.name,
        options.job_variables.get("prices", _prefect.pool_default(pool, "prices")),
        options.fallbacks,
    )
    return budget


async def _submit_and_wait(
    options: KineticOptions, call: PreparedCall, task_name: str, fn: Callable[..., Any], detach: Any = None
) -> Any:
    ctx = TaskRunContext.get()
    task_run = ctx.task_run if ctx else None
    logger = get_run_logger() if ctx else None
    async with _prefect.shared_client() as client:
        pool, budget = await _checked_pool(client, options)
        pool_variables = set(pool.base_job_template["variables"]["properties"])
        store_url = gcp.store_url(pool)
        store = call.store = gcp.open_store(store_url, await gcp.pool_credentials(pool))  # bad gcp_credentials: here
        key = await _prefect.signing_key()
        fuse_mounts = await to_thread.run_sync(data_mounts.plan, call, pool, pool_variables, store_url)
        await to_thread.run_sync(_upload_inputs, store, call, logger, key)

        polling = options.submission == "worker" or (
            options.submission == "auto" and await _prefect.has_online_worker(client, pool.name)
        )
        attempt = task_run.run_count if task_run else 1
        run_name = f"{task_run.name}-job{attempt}" if task_run else f"{task_name}-job"
        job_variables = _job_variables(options, call, store_url, pool_variables)
        if budget is not None:
            job_variables["max_cost_usd"] = budget
        if fuse_mounts:
            job_variables[data_mounts.FUSE_VARIABLE] = fuse_mounts
        if key is not None:  # not the key: only that the job must insist on signatures
            job_variables["env"][signing.REQUIRED_ENV] = "1"
        sweep = _sweep_of(options, call, client, store, pool, polling, job_variables, task_run, task_name, detach, key)
        if sweep is not None:
            return await _wait_in_sweep(sweep, client, call, job_variables, key, run_name, fn, logger, task_run)
        if polling and call.env:
            block = f"kinetic-env-{call.layout.run_id}"
            job_variables["env"][Env.ENV_BLOCK] = await _prefect.store_secret_env(call.env, block)
        flow_run = await _prefect.create_job_flow_run(
            client,
            flow_name=task_name,
            run_name=run_name,
            pool=pool,
            job_variables=job_variables,
            caller=None if detach else task_run,  # a detached job is nobody's subflow: its submitter may end
            tags=[f"accelerator:{options.accelerator.name}", "kinetic", *getattr(detach, "tags", ())],
            for_polling_worker=polling,
        )
        if detach is not None:  # kinetic_prefect.kinetic: hand the job over instead of waiting for it
            return await detach.submitted(pool, flow_run, polling, call)
        if logger:
            logger.info(
                f"Job {run_name} ({flow_run.id}) on pool {pool.name!r} "
                f"[{'polling worker' if polling else 'in-process'}], accelerator "
                f"{capacity.join([options.accelerator, *options.fallbacks])}"
            )
        state = await _wait_for_job(client, pool, flow_run, call, run_name, polling, options, logger)
        if state is not None and state.is_cancelled():
            await to_thread.run_sync(_discard_run, store, call, True)
            return await _cancelled_result(client, task_run, run_name, state)
    return await _collect(store, call, key, state, run_name, fn, logger, task_run)


async def _checked_pool(client: Any, options: KineticOptions) -> tuple[Any, float | None]:
    """The call's pool, checked against the call's options before anything is uploaded, and the call's budget."""
    pool_name = options.work_pool or config.default_work_pool()
    pool = await _prefect.ensure_work_pool(client, pool_name)
    try:
        budget = await _check_against_pool(client, options, pool)
    except (ValueError, LookupError):  # an error that names a pool change is not answered from a stale copy
        pool = await _prefect.ensure_work_pool(client, pool_name, fresh=True)
        budget = await _check_against_pool(client, options, pool)
    if options.image and "image" not in pool.base_job_template["variables"]["properties"]:
        raise ValueError(
            f"image={options.image!r} needs a pool that runs container images (kinetic-gke); "
            f"pool {pool.name!r} is of type {pool.type!r}."
        )
    return pool, budget


async def _wait_for_job(
    client: Any,
    pool: Any,
    flow_run: Any,
    call: PreparedCall,
    run_name: str,
    polling: bool,
    options: KineticOptions,
    logger: Any,
) -> Any:
    """The job run's final state: followed while a polling worker runs it, or run here by the pool's worker.
    A caller that stops waiting (timeout, interrupt, error) stops the job, or cancels its run if it never
    started."""
    slot_taken = False
    try:
        if polling and options.submission == "auto" and await _taken_back_from_a_dead_pool(client, pool, flow_run):
            polling = False  # no worker is left to claim it: this process runs it, as with no worker at all
            if logger:
                logger.warning(
                    f"Job {run_name}: no worker of pool {pool.name!r} is online any more (Prefect shows it "
                    "offline) and none claimed the job, so it runs in this process (submission='auto')"
                )
        if polling:
            return await _prefect.wait_for_final_state(
                client, flow_run.id, on_log=lambda text: _print_job_output(run_name, text)
            )
        async with _prefect.in_process_slots():
            slot_taken = True
            await _prefect.run_in_process(client, pool, flow_run, secret_env=call.env)
        return (
            await Outage(f"the caller of {run_name}").call(
                lambda: _prefect.read_flow_run_batched(client, flow_run.id), "reading the job's final state"
            )
        ).state
    except BaseException:
        if not polling and not slot_taken:  # still queued for a slot: its run is Pending, and nobody's
            await _cancel_queued(client, flow_run.id)
        elif polling:  # the worker stops the job; shielded: this task is being cancelled itself
            await _prefect.cancel_flow_run(
                client,
                flow_run.id,
                "The calling task stopped waiting (timeout, interrupt or error in the caller)",
                wait_seconds=20,
            )
        else:  # stopped before the in-process worker followed the job: its run must not stay Pending
            await _cancel_if_not_final(client, flow_run.id)
        raise


async def _collect(
    store: Any, call: PreparedCall, key: bytes | None, state: Any, run_name: str, fn: Any, logger: Any, task_run: Any
) -> Any:
    """The job's outcome read: its value returned, or its exception raised (a missing outcome: a crash)."""
    from kinetic_prefect.storage import ObjectNotFound

    try:
        outcome = Outcome.from_json(_read_signed(store, call.layout.outcome, key))
        call.outcome_read = True
    except ObjectNotFound:
        message = state.message if state is not None else "no state"
        raise KineticJobCrashed(
            f"job {run_name} ended without an outcome ({state.name if state else '?'}: {message})"
        ) from None
    await _publish_outputs(store, call, outcome, run_name)
    from kinetic_prefect.caller import capacity_report

    record = await capacity_report.publish(store, call.layout, key, run_name, logger, task_run)
    try:
        if outcome.completed:
            return capacity_report.completed(cloudpickle.loads(_read_signed(store, call.layout.result, key)), record)
        try:
            blob = _read_signed(store, call.layout.result, key)
        except ObjectNotFound:
            blob = None
        await to_thread.run_sync(_forget_broken_code, store, call, outcome)
        await to_thread.run_sync(heal_reported, store, call.data, outcome)
        raise_remote(outcome, blob, run_name, fn)
    finally:
        await to_thread.run_sync(_discard_run, store, call)


def _sweep_of(
    options: KineticOptions,
    call: PreparedCall,
    client: Any,
    store: Any,
    pool: Any,
    polling: bool,
    job_variables: dict[str, Any],
    task_run: Any,
    task_name: str,
    detach: Any,
    signing_key: bytes | None,
) -> Any:
    """The sweep this call's input joins (caller/slots.py), or None for a job run of its own: a call with no
    concurrent sibling, or one a slot cannot carry (a group, a fallback list, a budget, debug, FUSE mounts, secret
    env values, another loop than the shared one)."""
    from prefect._internal.concurrency.threads import get_run_sync_loop

    from kinetic_prefect.contract import LOCAL_WORKER_TYPE

    keep_warm = float(job_variables.get("keep_warm_seconds", _prefect.pool_default(pool, "keep_warm_seconds")) or 0)
    carried = (
        detach is None
        and task_run is not None
        and pool.type == LOCAL_WORKER_TYPE
        and keep_warm > 0
        and not options.fallbacks
        and not options.debug
        and not call.env
        and accelerators.host_count(options.accelerator, job_variables.get("hosts", options.hosts)) == 1
        and "max_cost_usd" not in job_variables
        and data_mounts.FUSE_VARIABLE not in job_variables
        and getattr(get_run_sync_loop(), "_loop", None) is asyncio.get_running_loop()
    )
    if not carried or not slots.slot_count() or not slots.has_siblings((task_run.flow_run_id, task_name)):
        return None
    shared, _ = slots.split_variables(job_variables)
    key = (task_run.flow_run_id, task_name, pool.name, polling, json.dumps(shared, sort_keys=True, default=str))
    return slots.sweep_for(
        key,
        lambda: slots.Sweep(
            key, client, store, pool, polling, shared, task_name, idle_seconds=keep_warm, signing_key=signing_key
        ),
    )


async def _wait_in_sweep(
    sweep: Any,
    client: Any,
    call: PreparedCall,
    job_variables: dict[str, Any],
    key: bytes | None,
    run_name: str,
    fn: Any,
    logger: Any,
    task_run: Any,
) -> Any:
    """One input of a sweep: queued, taken by a slot, and its outcome read as a single call's is. Its slot's run
    cancelled: Cancelled (not retried); its slot gone without its outcome (killed, failed): a crash, retried."""
    from prefect.states import Cancelled

    _, per_call = slots.split_variables(job_variables)
    if logger:
        logger.info(f"Input {run_name} queued in sweep {sweep.keys.sweep_id} (slot jobs of {sweep.task_name!r})")
    how, detail = await sweep.run_input(call.layout.run_id, per_call, task_run, run_name)
    slot = detail.get("slot") if isinstance(detail, dict) else None
    if how == "done" and detail.get("refused"):
        from kinetic_prefect.errors import StoreTampered

        raise StoreTampered(f"slot job of input {run_name} refused its queued record: {detail['refused']}")
    if how == "done":
        await sweep.forward_log(call.layout.run_id, logger)
        if not detail.get("stopped"):
            return await _collect(call.store, call, key, None, run_name, fn, logger, task_run)
        state = await sweep.slot_final(slot)
        slot = sweep.every_slot[slot].name if slot in sweep.every_slot else slot
    else:  # withdrawn if no slot took it, else stopped where it runs: never run by a slot and by a retry
        await sweep.stop_input(call.layout.run_id)
        state = Cancelled(message=str(detail)) if how == "cancelled" else detail["state"]
    if state is not None and state.is_cancelled():
        await to_thread.run_sync(_discard_run, call.store, call, True)
        return await _cancelled_result(client, task_run, run_name, state)
    what = f"{state.name}: {state.message}" if state is not None else "no final state"
    raise KineticJobCrashed(f"slot job {slot} ended ({what}) before input {run_name} had an outcome")


# How often a caller whose job run waits for a worker asks whether any worker of the pool is still online. A worker
# killed with SIGKILL reads ONLINE until Prefect's offline horizon (3 heartbeats, 90 s by default) has passed.
UNCLAIMED_CHECK_SECONDS = 2.0


async def _taken_back_from_a_dead_pool(client: Any, pool: Any, flow_run: Any) -> bool:
    """Wait until a worker claims the job run (False), or until the pool has no online worker while the run still
    waits: then take it back for this process by proposing Pending, as a worker would (True). The proposal is
    orchestrated, so a worker that claimed it meanwhile wins and this process goes on waiting for it."""
    from prefect.exceptions import Abort
    from prefect.states import Pending
    from prefect.utilities.engine import propose_state

    outage = Outage("the caller waiting for a worker to claim its job")
    while True:
        current = await outage.call(
            lambda: _prefect.read_flow_run_batched(client, flow_run.id), "reading the job's state"
        )
        if current.state is None or not current.state.is_scheduled():
            return False
        if not await outage.call(
            lambda: _prefect.has_online_worker(client, pool.name),
            "reading the pool's workers",  # one read per 2 s for a whole sweep
        ):
            try:
                await propose_state(client, Pending(message="taken back by its caller"), flow_run_id=flow_run.id)
            except Abort:
                return False
            return True
        await asyncio.sleep(UNCLAIMED_CHECK_SECONDS)


def _read_signed(store: Any, object_key: str, key: bytes | None) -> bytes:
    """Read a store object the job wrote, verified before anything unpickles it."""
    from kinetic_prefect.errors import SigningKeyMismatch, StoreTampered

    try:
        return signing.get(store, object_key, key)
    except signing.KeyMismatch as exc:
        raise SigningKeyMismatch(str(exc)) from None
    except signing.TamperedObject as exc:
        raise StoreTampered(str(exc)) from None


def _print_job_output(run_name: str, text: str) -> None:
    print("\n".join(f"[{run_name}] {line}" for line in text.splitlines()), file=sys.stderr, flush=True)


def _discard_run(store: Any, call: PreparedCall, entirely: bool = False) -> None:
    """Collected: the payload and the pickled result are not needed any more; the small outcome record stays as
    the job's receipt. ``entirely`` (a cancelled, interrupted or crashed call: nothing to collect): the outcome
    goes too, so calls that end badly do not grow the store. Outputs and checkpoints stay."""
    for object_key in (call.layout.payload, call.layout.result):
        signing.delete(store, object_key)  # never raises: cleanup must not turn a result into a failure
    if not entirely:
        return
    with contextlib.suppress(Exception):
        store.delete_prefix(call.layout.prefix + "/")
    # A job stopped while it started may not have removed its checkpoint folder; an empty one is only clutter.
    checkpoint_dir = store.local_path(checkpoints_key(call.task_run_id or call.layout.run_id))
    if checkpoint_dir is not None:
        with contextlib.suppress(OSError):  # only when empty: what a job saved is kept for the retry
            checkpoint_dir.rmdir()


async def _cancel_if_not_final(client: Any, flow_run_id: Any) -> None:
    import anyio
    from prefect.states import Cancelled

    with anyio.CancelScope(shield=True):
        try:
            current = await client.read_flow_run(flow_run_id)
            if current.state is None or not current.state.is_final():
                await client.set_flow_run_state(
                    flow_run_id,
                    Cancelled(message="The calling task stopped waiting (timeout, interrupt or error in the caller)"),
                    force=True,
                )
        except Exception:  # best effort while the caller is already failing
            pass


async def _cancel_queued(client: Any, flow_run_id: Any) -> None:
    """The run of a call stopped while it queued for an in-process slot: Cancelled in one write (no read first; a
    1,000-input sweep stopped by Ctrl-C has nearly all its calls queued, and each cost the server two requests)."""
    import anyio
    from prefect.states import Cancelled

    # best effort while the caller is already failing
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await client.set_flow_run_state(
            flow_run_id,
            Cancelled(message="The calling task stopped waiting before its job started (timeout, interrupt)"),
            force=True,
        )


async def _discard_interrupted_run(store: Any, call: PreparedCall) -> None:
    """The call ends without an outcome: the job is stopped by now (in-process) or was asked to stop and waited
    for (polling worker), or it crashed; its payload and whatever it wrote are removed, shielded from a
    cancellation that is unwinding this call. What a job still writes after that is for `kinetic-prefect cleanup`."""
    import anyio

    with anyio.CancelScope(shield=True):
        await to_thread.run_sync(_discard_run, store, call, True)


async def _cancelled_result(client: Any, task_run: Any, run_name: str, state: Any) -> Any:
    """A cancelled job ends its task run Cancelled (returned as a state: Prefect does not retry it,
    so a cancel is never undone by ``retries=``). Without a task run, it raises."""
    from prefect.states import Cancelled
    from prefect.transactions import get_transaction

    from kinetic_prefect.errors import KineticJobCancelled

    message = f"Job {run_name} was cancelled: {state.message or 'on request'}"
    if task_run is None:
        raise KineticJobCancelled(message)
    transaction = get_transaction()
    if transaction is not None:
        transaction.write_on_commit = False  # a cancelled call must not become a cache hit
    await _prefect.finish_cancelled_parent(client, task_run)
    return Cancelled(message=message, data=KineticJobCancelled(message))  # raised by task_calls, and by .result()


def call_remotely(
    options: KineticOptions,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    task_name: str,
    detach: Any = None,
) -> Any:
    """Package, submit, wait, and return the job's value (or raise its exception). With ``detach`` (see
    kinetic_prefect.kinetic.jobs), return what ``detach.submitted`` makes of the job's run once it exists."""
    call = prepare(options, fn, args, kwargs)  # PayloadError etc. before anything is stored
    return _prefect.run_interruptibly(_submit_and_collect(options, call, task_name, fn, detach))


async def call_remotely_async(
    options: KineticOptions, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], task_name: str
) -> Any:
    """``call_remotely`` for an ``async def`` task: on the caller's event loop, which the wait never blocks
    (packaging runs in a thread, with the task run's context)."""
    import contextvars
    import functools

    packaging = functools.partial(contextvars.copy_context().run, prepare, options, fn, args, kwargs)
    call = await to_thread.run_sync(packaging)
    return await _submit_and_collect(options, call, task_name, fn)


__all__ = ["KineticOptions", "PayloadError", "call_remotely"]
