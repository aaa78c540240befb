"""Caller side: the work-pool registry: read (or on first use create) a pool and find its kinetic worker class."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import WorkerStatus, WorkPool
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from kinetic_prefect import config
from kinetic_prefect.contract import WORKER_TYPES
from kinetic_prefect.contract.job_variables import pool_default
from kinetic_prefect.contract.launchers import LauncherAbilities

__all__ = [
    "WorkPoolError",
    "abilities_of",
    "ensure_work_pool",
    "has_online_worker",
    "pool_default",
    "types_able",
    "worker_class_for",
]

# Pools are read once per call site burst, not per call: a short TTL keeps edits in the UI effective.
_POOL_TTL_SECONDS = 30.0
_pool_cache: dict[tuple[str, str], tuple[float, WorkPool]] = {}


class WorkPoolError(LookupError):
    pass


def worker_class_for(pool_type: str) -> Any:  # a BaseWorker subclass mixing in lifecycle.KineticWorker
    """The caller's one door to the worker side: the kinetic worker class of ``pool_type``, importing that launcher
    alone (a call on kinetic-local loads no cloud client)."""
    from kinetic_prefect import workers

    try:
        cls = workers.worker_class(pool_type)
    except workers.LauncherUnavailable as missing:  # its module needs an extra this install lacks
        raise WorkPoolError(f"work pool type {pool_type!r} {missing}") from None
    except KeyError:
        cls = None
    if cls is None or not isinstance(getattr(cls, "abilities", None), LauncherAbilities):
        raise WorkPoolError(
            f"work pool type {pool_type!r} is not a kinetic worker type; use a pool of type "
            + " or ".join(repr(name) for name in WORKER_TYPES)
            + f" (uv run prefect work-pool create NAME --type {WORKER_TYPES[0]})."
        )
    return cls


def abilities_of(pool_type: str) -> LauncherAbilities:
    """What the launcher of ``pool_type`` can do (``contract.launchers``), declared once on its worker class."""
    abilities: LauncherAbilities = worker_class_for(pool_type).abilities
    return abilities


def types_able(ability: Callable[[LauncherAbilities], bool]) -> list[str]:
    """The installed worker types whose launcher has ``ability`` (for a refusal to name where a call can run)."""
    able = []
    for pool_type in WORKER_TYPES:
        try:
            if ability(abilities_of(pool_type)):
                able.append(pool_type)
        except WorkPoolError:  # not installed here
            continue
    return able


async def ensure_work_pool(client: PrefectClient, name: str, fresh: bool = False) -> WorkPool:
    """Read the pool; the default local pool is created on first use, other names must exist. ``fresh``: not
    from the cache (before refusing a call for what the pool lacks: the fix named may just have been made)."""
    key = (str(client.api_url), name)
    if fresh:
        _pool_cache.pop(key, None)
    cached = _pool_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _POOL_TTL_SECONDS:
        return cached[1]
    async with _pool_read_lock(key):  # a .map()'s calls arrive together: one reads, the others take its answer
        cached = _pool_cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < _POOL_TTL_SECONDS:
            return cached[1]
        return await _read_or_create_pool(client, name, key)


_pool_read_locks: dict[tuple[int, tuple[str, str]], asyncio.Lock] = {}


def _pool_read_lock(key: tuple[str, str]) -> asyncio.Lock:
    loop_key = (id(asyncio.get_running_loop()), key)
    if loop_key not in _pool_read_locks:
        _pool_read_locks[loop_key] = asyncio.Lock()
    return _pool_read_locks[loop_key]


async def _read_or_create_pool(client: PrefectClient, name: str, key: tuple[str, str]) -> WorkPool:
    try:
        pool = await client.read_work_pool(name)
    except ObjectNotFound:
        if name != config.DEFAULT_WORK_POOL:
            raise WorkPoolError(
                f"work pool {name!r} does not exist on {client.api_url}. Create it first, e.g. "
                f"`prefect work-pool create {name} --type kinetic-gke`, or omit work_pool= to use the local default."
            ) from None
        worker_class = worker_class_for(config.DEFAULT_POOL_TYPE)
        try:
            pool = await client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type=worker_class.type,
                    base_job_template=worker_class.get_default_base_job_template(),
                    description="Created by kinetic-prefect on first use: jobs run as local processes.",
                )
            )
        except ObjectAlreadyExists:  # another caller created it a moment ago
            pool = await client.read_work_pool(name)
    worker_class_for(pool.type)
    _pool_cache[key] = (time.monotonic(), pool)
    return pool


_ONLINE_TTL_SECONDS = 2.0  # a .map()'s calls share one answer; a worker coming or going is seen within this
_online_cache: dict[tuple[str, str], tuple[float, bool]] = {}


async def has_online_worker(client: PrefectClient, pool_name: str) -> bool:
    key = (str(client.api_url), pool_name)
    cached = _online_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _ONLINE_TTL_SECONDS:
        return cached[1]
    try:
        workers = await client.read_workers_for_work_pool(pool_name)
        online = any(w.status == WorkerStatus.ONLINE for w in workers)
    except ObjectNotFound:
        online = False
    _online_cache[key] = (time.monotonic(), online)
    return online
