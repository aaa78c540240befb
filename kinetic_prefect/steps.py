"""Prefect deployment steps (``prefect.yaml``) for kinetic pipelines.

``set_project_directory`` is a ``pull`` step: the flow run starts in this machine's checkout of the
project, named by ``KINETIC_PROJECT_DIR`` on the worker's machine (so one deployment serves workers
whose checkouts live in different places). Prefect's own ``set_working_directory`` does the same
``chdir``, but with the variable unset it fails with ``No such file or directory: ''``; this one says
what to set.
"""

from __future__ import annotations

import os
from pathlib import Path

from kinetic_prefect.contract import Env, settings

PROJECT_DIR_VARIABLE = Env.PROJECT_DIR


def set_project_directory(directory: str | None = None, must_contain: str | None = None) -> dict[str, str]:
    """Change into the project checkout: ``directory`` (a path, ``~`` allowed) or ``$KINETIC_PROJECT_DIR``.

    ``must_contain``: a file that must exist in it (e.g. ``prefect.yaml``), so a wrong
    directory fails here, naming both, rather than later as an import error.
    """
    raw = (directory or "").strip() or (settings.PROJECT_DIR.value() or "")
    if not raw or "{{" in raw:
        raise ValueError(
            f"{PROJECT_DIR_VARIABLE} is not set on this worker's machine: set it to this machine's checkout of "
            f"the project before `prefect worker start` (export {PROJECT_DIR_VARIABLE}=/path/to/kinetic-prefect), "
            "or deploy with the git_clone pull step (see prefect.yaml) so the worker clones the repository itself."
        )
    path = Path(raw).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"{PROJECT_DIR_VARIABLE}={raw!r} is not a directory on this machine: point it at a checkout of the project."
        )
    if must_contain and not (path / must_contain).is_file():
        raise FileNotFoundError(
            f"{path} has no {must_contain}: {PROJECT_DIR_VARIABLE} must name a checkout of the project "
            "(the directory that holds prefect.yaml)."
        )
    os.chdir(path)
    return {"directory": str(path)}
