"""Keras Kinetic's public API on Prefect: port a Kinetic script by changing its import line to
``from kinetic_prefect import kinetic``.

``kinetic.run`` (blocking calls, ``run_async``, ``run_async_map``), ``JobHandle``, ``BatchHandle``, ``BatchError``,
``attach``, ``attach_batch``, ``list_jobs``, ``Data`` and ``JobStatus``, built on ``@kinetic_task``, the work pools
and the store. See docs/coming-from-kinetic.md. Names resolve lazily: the decorator imports ``.names`` cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "run": "kinetic_prefect.kinetic.remote",
    "RemoteCallable": "kinetic_prefect.kinetic.remote",
    "JobHandle": "kinetic_prefect.kinetic.jobs",
    "JobStatus": "kinetic_prefect.kinetic.jobs",
    "ResultAlreadyCollected": "kinetic_prefect.kinetic.jobs",
    "attach": "kinetic_prefect.kinetic.job_lookup",
    "list_jobs": "kinetic_prefect.kinetic.job_lookup",
    "BatchHandle": "kinetic_prefect.kinetic.batch",
    "BatchError": "kinetic_prefect.kinetic.batch",
    "attach_batch": "kinetic_prefect.kinetic.batch",
    "Data": "kinetic_prefect.pod.data",
}

if TYPE_CHECKING:  # pragma: no cover
    from kinetic_prefect.kinetic.batch import BatchError as BatchError
    from kinetic_prefect.kinetic.batch import BatchHandle as BatchHandle
    from kinetic_prefect.kinetic.batch import attach_batch as attach_batch
    from kinetic_prefect.kinetic.job_lookup import attach as attach
    from kinetic_prefect.kinetic.job_lookup import list_jobs as list_jobs
    from kinetic_prefect.kinetic.jobs import JobHandle as JobHandle
    from kinetic_prefect.kinetic.jobs import JobStatus as JobStatus
    from kinetic_prefect.kinetic.jobs import ResultAlreadyCollected as ResultAlreadyCollected
    from kinetic_prefect.kinetic.remote import RemoteCallable as RemoteCallable
    from kinetic_prefect.kinetic.remote import run as run
    from kinetic_prefect.pod.data import Data as Data

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kinetic_prefect.kinetic' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
