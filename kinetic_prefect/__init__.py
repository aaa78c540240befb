"""kinetic-prefect: run a Prefect task's body on an accelerator, through a Prefect work pool.

The package root stays import-light on purpose: the job runner imports
``kinetic_prefect.pod.runner`` in a fresh interpreter and must not pay for Prefect.
Public names are resolved lazily on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kinetic_prefect.version import __version__

_LAZY = {
    "kinetic_task": "kinetic_prefect.caller.decorator",
    "KineticTask": "kinetic_prefect.caller.decorator",
    "RemoteTraceback": "kinetic_prefect.errors",
    "KineticJobCrashed": "kinetic_prefect.errors",
    "ImageSpec": "kinetic_prefect.shared.image",
    "Data": "kinetic_prefect.pod.data",
    "JobOutputs": "kinetic_prefect.pod.outputs",
    "attach": "kinetic_prefect.kinetic.job_lookup",
    "fail_fast": "kinetic_prefect.shared.sweeps",
}

if TYPE_CHECKING:  # pragma: no cover
    from kinetic_prefect.caller.decorator import KineticTask as KineticTask
    from kinetic_prefect.caller.decorator import kinetic_task as kinetic_task
    from kinetic_prefect.errors import KineticJobCrashed as KineticJobCrashed
    from kinetic_prefect.errors import RemoteTraceback as RemoteTraceback
    from kinetic_prefect.kinetic.job_lookup import attach as attach
    from kinetic_prefect.pod.data import Data as Data
    from kinetic_prefect.pod.outputs import JobOutputs as JobOutputs
    from kinetic_prefect.shared.image import ImageSpec as ImageSpec
    from kinetic_prefect.shared.sweeps import fail_fast as fail_fast

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kinetic_prefect' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
