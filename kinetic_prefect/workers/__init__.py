"""Worker types, registered with Prefect through the ``prefect.collections`` entry point.

Importing a BaseWorker subclass registers it by its ``type``; Prefect imports this module when it loads collections,
so ``prefect worker start --type kinetic-local`` finds it. Each launcher is one line of ``LAUNCHERS``: its worker
type, the module of its worker class (``workers/<launcher>/worker.py``) and the package extras that module needs. A
launcher whose extras are not installed (``kinetic-gke`` without prefect-kubernetes, ``kinetic-vertex`` without
google-cloud-aiplatform) is not registered, and a pool of its type is refused with the install command
(``UNAVAILABLE``: worker type -> what is missing and that command).
"""

from __future__ import annotations

import importlib
from typing import Any

from kinetic_prefect.contract import GKE_WORKER_TYPE, LOCAL_WORKER_TYPE, VERTEX_WORKER_TYPE

# worker type -> ("module:WorkerClass", the extras its module needs)
LAUNCHERS: dict[str, tuple[str, tuple[str, ...]]] = {
    LOCAL_WORKER_TYPE: ("kinetic_prefect.workers.local.worker:KineticLocalWorker", ()),
    GKE_WORKER_TYPE: ("kinetic_prefect.workers.gke.worker:KineticGKEWorker", ("k8s", "gcp")),
    VERTEX_WORKER_TYPE: ("kinetic_prefect.workers.vertex.worker:KineticVertexWorker", ("gcp",)),
}

UNAVAILABLE: dict[str, str] = {}


def _install_hint(extras: tuple[str, ...], missing: str) -> str:
    wanted = sorted(extras)
    return (
        f"needs the {' and '.join(extras)} extra{'s' if len(extras) > 1 else ''} ({missing} is not installed): "
        f"pip install 'kinetic-prefect[{','.join(wanted)}]' (or uv sync {' '.join(f'--extra {e}' for e in wanted)})"
    )


def _register(worker_type: str, where: str, extras: tuple[str, ...]) -> Any:
    """Import the worker class (which registers it), or record why its extras are missing."""
    module, _, name = where.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as missing:
        if not extras or (missing.name or "").startswith("kinetic_prefect"):
            raise  # a module of the package itself: a bug, not an extra to install
        UNAVAILABLE[worker_type] = _install_hint(extras, missing.name or "a module")
        return None
    # this line's extras are the ones a missing import is answered with: the class may not state others
    if set(cls.abilities.extras) != set(extras):
        raise TypeError(f"{name}.abilities.extras {cls.abilities.extras} differs from workers.LAUNCHERS' {extras}")
    return cls


for _type, (_where, _extras) in LAUNCHERS.items():
    globals()[_where.partition(":")[2]] = _register(_type, _where, _extras)

__all__ = ["LAUNCHERS", "UNAVAILABLE", *(where.partition(":")[2] for where, _ in LAUNCHERS.values())]
