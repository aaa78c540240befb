"""Caller side, a call made ready: what is computed before Prefect or the store is contacted (``prepare``: the
pickled payload, the project archive, the forwarded environment, each Data argument hashed and put by reference).
Failing here stores nothing. A task's options are ``caller.options``' (``KineticOptions`` is re-exported here).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext

from kinetic_prefect.caller import data_mounts
from kinetic_prefect.caller.env_capture import forwarded_environment
from kinetic_prefect.caller.options import KineticOptions
from kinetic_prefect.caller.payload import build_call_payload
from kinetic_prefect.caller.project_archive import cached_project_archive, find_project_dir, sha256_hex
from kinetic_prefect.contract import BATCH_TAG, RunLayout, batch_input_run_id
from kinetic_prefect.pod import data


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
    # An input of a run_async_map batch in slots: its result stays in the store for its BatchHandle to collect.
    kept_for_batch: bool = False


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
    task_run = ctx.task_run if (ctx := TaskRunContext.get()) else None
    # a batch input's objects are found again from its task run (kinetic_prefect.kinetic.batch_inputs)
    in_batch = task_run is not None and BATCH_TAG in (task_run.tags or ())
    run_id = batch_input_run_id(task_run.id, task_run.run_count) if task_run is not None and in_batch else None
    return PreparedCall(
        layout=RunLayout(run_id or str(uuid.uuid4())),
        payload=payload,
        payload_sha256=sha256_hex(payload),
        project_dir=project_dir,
        code_archive=archive,
        env=env,
        data=manifests,
        task_run_id=str(task_run.id) if task_run is not None else None,
        fuse=fuse,
        kept_for_batch=in_batch,
    )
