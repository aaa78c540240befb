"""Caller side: turn one call of a kinetic task into a job and bring its outcome back.

Runs inside the Prefect task run, so caching and retries stay Prefect's: a cache hit never
reaches this module, and whatever it raises (a remote exception, a crashed job) lets Prefect
retry, which calls it again and launches a new job.
"""

from __future__ import annotations

import fnmatch
import json
import linecache
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from anyio import to_thread
import cloudpickle
from prefect import get_client
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger

from kinetic_prefect import _prefect, accelerators, config, data
from kinetic_prefect.errors import KineticJobCrashed, KineticJobSetupError, PayloadError, RemoteError, RemoteTraceback
from kinetic_prefect.image import ImageSpec
from kinetic_prefect.workers.base import ENV_BLOCK_VARIABLE
from kinetic_prefect.payload import archive_project, build_call_payload, find_project_dir, sha256_hex

SUBMISSION_MODES = ("auto", "in-process", "worker")


@dataclass(frozen=True)
class KineticOptions:
    """Where and how a kinetic task's body runs (everything that is not a Prefect task option)."""

    accelerator: accelerators.AcceleratorSpec
    image_spec: ImageSpec
    image: str | None = None
    work_pool: str | None = None
    env: tuple[str, ...] = ()
    submission: str = "auto"
    project_dir: Path | None = None
    ship_project: bool = True
    job_variables: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.submission not in SUBMISSION_MODES:
            raise ValueError(f"submission={self.submission!r} is not one of {', '.join(SUBMISSION_MODES)}")
        if self.project_dir is not None and not Path(self.project_dir).is_dir():
            raise ValueError(f"project_dir={str(self.project_dir)!r} is not a directory")


def forwarded_environment(patterns: tuple[str, ...]) -> dict[str, str]:
    """Values of the caller's environment variables named by ``env=`` (exact names must exist)."""
    values: dict[str, str] = {}
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            values.update({k: v for k, v in os.environ.items() if fnmatch.fnmatchcase(k, pattern)})
        elif pattern in os.environ:
            values[pattern] = os.environ[pattern]
        else:
            raise ValueError(
                f"env={list(patterns)!r}: environment variable {pattern!r} is not set in the calling process; "
                "set it, or use a glob pattern (e.g. 'WANDB_*') for optional variables."
            )
    return values


@dataclass
class PreparedCall:
    """Everything computed before contacting Prefect or storage; failing here stores nothing."""

    run_prefix: str
    payload: bytes
    payload_sha256: str
    code_archive: Any | None
    env: dict[str, str]
    data: list[Any]  # data.Manifest of each local Data argument, uploaded at submission
    task_run_id: str | None = None


def _swap_data(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list[Any]]:
    """Hash every Data argument (wherever it is nested) and put a DataRef in its place."""
    manifests: dict[str, Any] = {}

    def to_ref(item: data.Data) -> data.DataRef:
        manifest = None if item.is_remote else data.hash_local(item)
        if manifest is not None:
            manifests[manifest.sha256] = manifest
        return data.to_ref(item, manifest)

    new_args = data.transform(args, to_ref, data.Data)
    new_kwargs = data.transform(kwargs, to_ref, data.Data)
    return new_args, new_kwargs, list(manifests.values())


def prepare(options: KineticOptions, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> PreparedCall:
    project_dir = Path(options.project_dir).resolve() if options.project_dir else find_project_dir(fn)
    data_paths = [d.local_path for d in data.find((args, kwargs), data.Data) if d.local_path is not None]
    args, kwargs, manifests = _swap_data(args, kwargs)
    payload = build_call_payload(fn, args, kwargs, project_dir)
    # Data passed as Data travels by its own content-addressed route, never inside the code archive.
    archive = archive_project(project_dir, exclude=data_paths) if options.ship_project else None
    env = forwarded_environment(options.env)
    return PreparedCall(
        run_prefix=f"runs/{uuid.uuid4()}", payload=payload, payload_sha256=sha256_hex(payload),
        code_archive=archive, env=env, data=manifests,
        task_run_id=str(ctx.task_run.id) if (ctx := TaskRunContext.get()) else None,
    )


def _upload_inputs(store: Any, call: PreparedCall, logger: Any) -> None:
    if call.code_archive is not None and not store.exists(call.code_archive.key):
        store.put_bytes(call.code_archive.key, call.code_archive.data, if_absent=True)
    for manifest in call.data:
        uploaded = data.upload(manifest, store)
        if logger:
            logger.info(f"Data {manifest.root.name} ({len(manifest.files)} files, sha256 {manifest.sha256[:12]}): "
                        + (f"uploaded {uploaded / 2**20:.1f} MiB" if uploaded else "already in the store"))
    store.put_bytes(f"{call.run_prefix}/payload.pkl", call.payload)


async def _publish_outputs(store: Any, call: PreparedCall, outcome: dict[str, Any], run_name: str) -> None:
    """A table artifact on the task run listing what the job left in KINETIC_OUTPUT_DIR."""
    outputs = outcome.get("outputs") or []
    if not outputs or TaskRunContext.get() is None:
        return
    from prefect.artifacts import acreate_table_artifact

    run_id = call.run_prefix.rsplit("/", 1)[-1]
    rows = [{"file": rel, "url": store.url_for(f"outputs/{run_id}/{rel}")} for rel in outputs]
    await acreate_table_artifact(rows, description=f"Outputs of kinetic job {run_name} ({outcome.get('status')})")


def _job_variables(options: KineticOptions, call: PreparedCall, store_url: str, pool_variables: set[str]) -> dict[str, Any]:
    env = {
        "KINETIC_RUN_PREFIX": call.run_prefix,
        "KINETIC_PAYLOAD_SHA256": call.payload_sha256,
        "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "jax"),
        "JAX_PLATFORMS": options.accelerator.jax_platform,
        # Keyed by the task run, not the job: a retry (a new job) resumes from the same checkpoints.
        "KINETIC_CHECKPOINT_KEY": f"checkpoints/{call.task_run_id or call.run_prefix.rsplit('/', 1)[-1]}",
    }
    if call.code_archive is not None:
        env["KINETIC_CODE_KEY"] = call.code_archive.key
        env["KINETIC_CODE_SHA256"] = call.code_archive.sha256
    variables: dict[str, Any] = {
        **options.job_variables,
        "accelerator": options.accelerator.name + (":spot" if options.accelerator.spot else ""),
        "image_tag": options.image or options.image_spec.tag,
        "requirements": list(options.image_spec.requirements),
        "python_version": options.image_spec.python,
        "base_image": options.image_spec.base_image,
        "store": store_url,
    }
    variables["env"] = {**options.job_variables.get("env", {}), **env}
    if options.image and "image" in pool_variables:
        variables["image"] = options.image
    return variables


_DYNAMIC_FRAME = re.compile(r'File "<dynamic-code>", line (\d+), in (\S+)\n')


def readable_traceback(traceback_text: str, fn: Callable[..., Any]) -> str:
    """Put file names and source lines back into frames of functions that were pickled by value.

    cloudpickle blanks ``co_filename`` to ``<dynamic-code>``; line numbers survive, and the
    caller still has the code, so frames of the task function and its module's functions can
    be mapped back to the caller's files.
    """
    candidates = [fn] + [getattr(v, "user_fn", v) for v in getattr(fn, "__globals__", {}).values()]
    codes = {}
    for candidate in candidates:
        code = getattr(candidate, "__code__", None)
        if code is not None:
            codes.setdefault(code.co_name, []).append(code)

    def replace(match: re.Match) -> str:
        line, name = int(match.group(1)), match.group(2)
        for code in codes.get(name, []):
            last = max((ln for _, _, ln in code.co_lines() if ln), default=code.co_firstlineno)
            if code.co_firstlineno <= line <= last:
                source = linecache.getline(code.co_filename, line).strip()
                return f'File "{code.co_filename}", line {line}, in {name}\n' + (f"    {source}\n" if source else "")
        return match.group(0)

    return _DYNAMIC_FRAME.sub(replace, traceback_text)


def _raise_remote(outcome: dict[str, Any], result_blob: bytes | None, run_name: str, fn: Callable[..., Any]) -> None:
    traceback_text = readable_traceback(outcome.get("traceback", ""), fn)
    if not outcome.get("user_error"):
        raise KineticJobSetupError(outcome.get("phase", "?"), f"{outcome.get('error_type')}: {outcome.get('message')}") \
            from RemoteTraceback(traceback_text)
    exc: BaseException | None = None
    if result_blob is not None:
        try:
            _tag, exc_type, exc_args, exc_state = cloudpickle.loads(result_blob)
            exc = exc_type.__new__(exc_type)  # not __init__: see runner._pickle_exception
            exc.args = exc_args
            exc.__dict__.update(exc_state)
        except Exception:  # the type exists remotely only (e.g. a module the caller lacks)
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(outcome.get("error_type", "Exception"), outcome.get("message", ""))
    exc.add_note(f"(raised in kinetic job {run_name}; the remote traceback is shown above)")
    exc.remote_traceback = traceback_text  # type: ignore[attr-defined]
    raise exc.with_traceback(None) from RemoteTraceback(traceback_text)


async def _submit_and_collect(options: KineticOptions, call: PreparedCall, task_name: str,
                              fn: Callable[..., Any]) -> Any:
    from kinetic_prefect.storage import ObjectNotFound, open_store

    ctx = TaskRunContext.get()
    task_run = ctx.task_run if ctx else None
    logger = get_run_logger() if ctx else None
    async with get_client() as client:
        pool = await _prefect.ensure_work_pool(client, options.work_pool or config.default_work_pool())
        _prefect.worker_class_for(pool.type).check_accelerator(options.accelerator)
        pool_variables = set(pool.base_job_template["variables"]["properties"])
        if options.image and "image" not in pool_variables:
            raise ValueError(f"image={options.image!r} needs a pool that runs container images (kinetic-gke); "
                             f"pool {pool.name!r} is of type {pool.type!r}.")
        store_url = _prefect.pool_default(pool, "store") or config.default_store_url()
        store = open_store(store_url)
        await to_thread.run_sync(_upload_inputs, store, call, logger)

        polling = options.submission == "worker" or (
            options.submission == "auto" and await _prefect.has_online_worker(client, pool.name)
        )
        attempt = task_run.run_count if task_run else 1
        run_name = f"{task_run.name}-job{attempt}" if task_run else f"{task_name}-job"
        job_variables = _job_variables(options, call, store_url, pool_variables)
        if polling and call.env:
            block = f"kinetic-env-{call.run_prefix.rsplit('/', 1)[-1]}"
            job_variables["env"][ENV_BLOCK_VARIABLE] = await _prefect.store_secret_env(call.env, block)
        flow_run = await _prefect.create_job_flow_run(
            client, flow_name=task_name, run_name=run_name, pool=pool,
            job_variables=job_variables,
            parent_task_run_id=task_run.id if task_run else None,
            tags=[f"accelerator:{options.accelerator.name}", "kinetic"], for_polling_worker=polling,
        )
        if logger:
            logger.info(f"Job {run_name} ({flow_run.id}) on pool {pool.name!r} "
                        f"[{'polling worker' if polling else 'in-process'}], accelerator {options.accelerator.name}")
        try:
            if polling:
                state = await _prefect.wait_for_final_state(
                    client, flow_run.id, on_log=lambda line: print(f"[{run_name}] {line}", file=sys.stderr, flush=True)
                )
            else:
                await _prefect.run_in_process(client, pool, flow_run, secret_env=call.env)
                state = (await client.read_flow_run(flow_run.id)).state
        except BaseException:
            if polling:
                await _prefect.cancel_flow_run(client, flow_run.id)
            raise

    try:
        outcome = json.loads(store.get_bytes(f"{call.run_prefix}/outcome.json"))
    except ObjectNotFound:
        message = state.message if state is not None else "no state"
        raise KineticJobCrashed(f"job {run_name} ended without an outcome ({state.name if state else '?'}: {message})") from None
    await _publish_outputs(store, call, outcome, run_name)
    if outcome.get("status") == "completed":
        value = cloudpickle.loads(store.get_bytes(f"{call.run_prefix}/result.pkl"))
        store.delete(f"{call.run_prefix}/payload.pkl")  # collected: the payload is no longer needed
        return value
    try:
        blob = store.get_bytes(f"{call.run_prefix}/result.pkl")
    except ObjectNotFound:
        blob = None
    _raise_remote(outcome, blob, run_name, fn)


def call_remotely(options: KineticOptions, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                  task_name: str) -> Any:
    """Package, submit, wait, and return the job's value (or raise its exception)."""
    call = prepare(options, fn, args, kwargs)  # PayloadError etc. before anything is stored
    return _prefect.run_interruptibly(_submit_and_collect(options, call, task_name, fn))


__all__ = ["KineticOptions", "PayloadError", "call_remotely"]
