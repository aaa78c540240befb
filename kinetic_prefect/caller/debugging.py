"""Caller side of debug mode (``debug=True``): what a debug call changes in its job, decided before anything is
uploaded. The job side is ``pod/debugger.py``; attaching is ``kinetic-prefect jobs debug`` (``debug_session.py``).

* The job's environment gets debugpy: added to the requirements when there are any, and on a pool that builds
  container images (an image is built from the requirements). A call without requirements on kinetic-local runs
  on the worker's interpreter, which must have debugpy itself. Non-debug calls keep their environment hash.
* The job waits for a client (``KINETIC_DEBUG_WAIT_SECONDS``, read from the caller's environment) on a fixed port
  in a pod (``DEBUG_PORT``), on a free one on kinetic-local (two debug jobs on one machine do not collide).
* It runs cold: a warm runner is one process for many calls, and debugpy listens once per process.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from kinetic_prefect.contract import DEBUG_PORT, DEBUGPY_REQUIREMENT, Env, settings
from kinetic_prefect.shared.image import ImageSpec


def _builds_images(pool_variables: set[str]) -> bool:
    return "image" in pool_variables  # kinetic-gke's template has it; kinetic-local's has none


def job_image_spec(options: Any, pool_variables: set[str]) -> ImageSpec:
    """The environment the call's job runs in: ``options.image_spec``, plus debugpy for a debug call that gets a
    built environment."""
    spec: ImageSpec = options.image_spec
    if not options.debug or options.image:
        return spec
    if "debugpy" in {Requirement(r).name for r in spec.requirements} or (
        spec.uses_caller_interpreter and not _builds_images(pool_variables)
    ):
        return spec
    requirements = [*spec.requirements, DEBUGPY_REQUIREMENT]
    return ImageSpec.create(requirements, family=spec.family, base_image=spec.base_image, python=spec.python)


def check(options: Any, pool_name: str, pool_variables: set[str]) -> None:
    """Before anything is uploaded: a debug call that will run on this interpreter (kinetic-local, no requirements)
    needs debugpy here, and the wait must be a number of seconds."""
    if not options.debug:
        return
    settings.DEBUG_WAIT_SECONDS.value()  # a bad value fails here, naming the variable
    spec = job_image_spec(options, pool_variables)
    if spec.uses_caller_interpreter and not _builds_images(pool_variables) and not _has_debugpy():
        raise ValueError(
            f"debug=True on pool {pool_name!r}: the job runs on this Python interpreter (no requirements=) and "
            f"debugpy is not installed in it. Install it into this interpreter (uv pip install "
            f"'{DEBUGPY_REQUIREMENT}' --python {sys.executable}; in a checkout: uv sync --inexact --extra dev), or "
            "pass requirements=[...] (debugpy is then added to the job's environment)"
        )


def _has_debugpy() -> bool:
    return importlib.util.find_spec("debugpy") is not None


# An environment variable holds at most 128 KiB (Linux's MAX_ARG_STRLEN); the map stays well under it.
SOURCES_MAX_BYTES = 32 * 1024


def project_sources(project_dir: Path) -> dict[str, str]:
    """The project's own loaded modules (those a call pickles by value, ``__main__`` first): name -> file relative
    to the project root. cloudpickle drops a by-value function's file name; the job puts it back from this.
    Installed packages inside the project folder (a ``.venv``) are not the project's; past SOURCES_MAX_BYTES the
    rest is left out (their functions keep cloudpickle's ``<dynamic-code>``, where no breakpoint can be set)."""
    root = Path(project_dir).resolve()
    sources: dict[str, str] = {}
    size = 0
    # a copy (one step under the GIL): other threads import while a fan-out's payloads are built
    for name, module in sorted(sys.modules.copy().items(), key=lambda item: item[0] != "__main__"):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        try:
            relative = Path(file).resolve().relative_to(root)
        except ValueError:
            continue
        if {"site-packages", "dist-packages"} & set(relative.parts):
            continue
        size += len(name) + len(relative.as_posix()) + 8
        if size > SOURCES_MAX_BYTES:
            break
        sources[name] = relative.as_posix()
    return sources


def job_variables(options: Any, project_dir: Path | None, pool_variables: set[str]) -> dict[str, Any]:
    """The job variables a debug call adds (none for other calls): its env, and no warm runner."""
    if not options.debug:
        return {}
    env = {Env.DEBUG: "1"}
    if project_dir is not None:
        env[Env.DEBUG_CALLER_ROOT] = str(project_dir)
        env[Env.DEBUG_SOURCES] = json.dumps(project_sources(project_dir), sort_keys=True)
    wait = settings.DEBUG_WAIT_SECONDS.raw()
    if wait:  # the caller's value, as given, travels to the job (which reads it through the same setting)
        env[Env.DEBUG_WAIT_SECONDS] = wait
    if _builds_images(pool_variables):
        env[Env.DEBUG_PORT] = str(DEBUG_PORT)
    variables: dict[str, Any] = {"env": env}
    for name in ("keep_warm_seconds", "min_warm"):
        if name in pool_variables:
            variables[name] = 0
    return variables
