"""Worker types: each launcher is one line of ``LAUNCHERS``, and nothing of a launcher is imported before it is used.

A line names the launcher's worker type, the module of its worker class (``workers/<launcher>/worker.py``), the
package extras that module needs and, where it has any, its side of the ``kinetic-prefect`` command (``commands``:
its own commands and its platform for ``up``/``down``; light, a command imports the launcher's code when it runs).
``worker_class(type)`` imports that one launcher: a call on kinetic-local never loads kinetic-vertex's aiplatform or
kinetic-gke's Kubernetes clients.

Prefect finds a worker type among the BaseWorker subclasses imported so far, and imports the ``prefect.collections``
entry point (``kinetic_prefect.workers.collection``) to let packages register theirs, so ``prefect worker start
--type kinetic-gke`` loads every installed launcher there, where Prefect loads every installed collection anyway.

A launcher whose extras are not installed (``kinetic-gke`` without prefect-kubernetes, ``kinetic-vertex`` without
google-cloud-aiplatform) is refused with the install command (``LauncherUnavailable``; ``UNAVAILABLE`` keeps the
types found missing so far).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

from kinetic_prefect.contract.names import GKE_WORKER_TYPE, LOCAL_WORKER_TYPE, VERTEX_WORKER_TYPE


class Launcher(NamedTuple):
    worker: str  # "module:WorkerClass"
    extras: tuple[str, ...]  # the extras its worker module needs
    # Its side of the CLI, a light module: register(app) adds its own commands; PLATFORM and provisioning() are its
    # platform for `up`/`down --platform PLATFORM`.
    commands: str | None = None


LAUNCHERS: dict[str, Launcher] = {
    LOCAL_WORKER_TYPE: Launcher("kinetic_prefect.workers.local.worker:KineticLocalWorker", ()),
    GKE_WORKER_TYPE: Launcher(
        "kinetic_prefect.workers.gke.worker:KineticGKEWorker",
        ("k8s", "gcp"),
        "kinetic_prefect.workers.gke.commands",
    ),
    VERTEX_WORKER_TYPE: Launcher(
        "kinetic_prefect.workers.vertex.worker:KineticVertexWorker", ("gcp",), "kinetic_prefect.workers.vertex.commands"
    ),
}

# worker type -> why it cannot be used here and the install command, for the types tried so far
UNAVAILABLE: dict[str, str] = {}
_loaded: dict[str, Any] = {}


class LauncherUnavailable(LookupError):
    """The worker type's launcher needs extras this install lacks; the message is the install command."""


def install_hint(extras: tuple[str, ...], missing: str) -> str:
    wanted = sorted(extras)
    return (
        f"needs the {' and '.join(extras)} extra{'s' if len(extras) > 1 else ''} ({missing} is not installed): "
        f"uv sync --inexact {' '.join(f'--extra {e}' for e in wanted)} in the checkout "
        f"(or pip install -e '.[{','.join(wanted)}]' from it)"
    )


def _register(worker_type: str, where: str, extras: tuple[str, ...]) -> Any:
    """Import the worker class (which registers it with Prefect), or record why its extras are missing (None)."""
    module, _, name = where.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as missing:
        if not extras or (missing.name or "").startswith("kinetic_prefect"):
            raise  # a module of the package itself: a bug, not an extra to install
        UNAVAILABLE[worker_type] = install_hint(extras, missing.name or "a module")
        return None
    # this line's extras are the ones a missing import is answered with: the class may not state others
    if set(cls.abilities.extras) != set(extras):
        raise TypeError(f"{name}.abilities.extras {cls.abilities.extras} differs from workers.LAUNCHERS' {extras}")
    return cls


def worker_class(worker_type: str) -> Any:
    """The worker class of ``worker_type``, importing its launcher alone; ``LauncherUnavailable`` names the install
    command when its extras are missing, ``KeyError`` for a type that is no kinetic launcher."""
    if worker_type not in _loaded:
        line = LAUNCHERS[worker_type]
        cls = _register(worker_type, line.worker, line.extras)
        if cls is None:
            raise LauncherUnavailable(UNAVAILABLE[worker_type])
        _loaded[worker_type] = cls
    return _loaded[worker_type]


def find(worker_type: str | None) -> Any:
    """The worker class of ``worker_type``, or None where it is no kinetic type or not installed here."""
    try:
        return worker_class(worker_type) if worker_type else None
    except (KeyError, LauncherUnavailable):
        return None


def commands_modules() -> list[Any]:
    """Each launcher's side of the CLI (its ``commands`` module), imported: light by rule, ``--help`` reads them."""
    return [importlib.import_module(line.commands) for line in LAUNCHERS.values() if line.commands]


def installed() -> dict[str, Any]:
    """Every launcher whose extras are installed, imported (``prefect.collections``; listings of every type)."""
    found = {}
    for worker_type in LAUNCHERS:
        try:
            found[worker_type] = worker_class(worker_type)
        except LauncherUnavailable:
            continue
    return found


def __getattr__(name: str) -> Any:
    """``workers.KineticLocalWorker`` and the like: the class, imported on first use (None if not installed)."""
    for worker_type, line in LAUNCHERS.items():
        if line.worker.partition(":")[2] == name:
            try:
                return worker_class(worker_type)
            except LauncherUnavailable:
                return None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LAUNCHERS",
    "UNAVAILABLE",
    "Launcher",
    "LauncherUnavailable",
    "commands_modules",
    "find",
    "installed",
    "worker_class",
]
