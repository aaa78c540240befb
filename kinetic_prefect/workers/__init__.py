"""Worker types, registered with Prefect through the ``prefect.collections`` entry point.

Importing a BaseWorker subclass registers it by its ``type``; Prefect imports this module
when it loads collections, so ``prefect worker start --type kinetic-local`` finds it.
``kinetic-gke`` is built on prefect-kubernetes, which only the ``k8s`` extra installs: without it
the type is not registered, and a kinetic-gke pool is refused with the install command
(``UNAVAILABLE``: worker type -> what is missing and the install command).
"""

from kinetic_prefect.contract import GKE_WORKER_TYPE, VERTEX_WORKER_TYPE
from kinetic_prefect.workers.local.worker import KineticLocalWorker

UNAVAILABLE: dict[str, str] = {}
GKE_UNAVAILABLE: str | None
try:
    from kinetic_prefect.workers.gke.worker import KineticGKEWorker
except ModuleNotFoundError as missing:  # no prefect-kubernetes / kubernetes: a local-only install
    KineticGKEWorker = None  # type: ignore[assignment,misc]
    GKE_UNAVAILABLE = f"{missing.name} is not installed"
    UNAVAILABLE[GKE_WORKER_TYPE] = (
        f"needs the k8s and gcp extras ({GKE_UNAVAILABLE}): "
        "pip install 'kinetic-prefect[gcp,k8s]' (or uv sync --extra gcp --extra k8s)"
    )
else:
    GKE_UNAVAILABLE = None

VERTEX_UNAVAILABLE: str | None
try:
    from kinetic_prefect.workers.vertex.worker import KineticVertexWorker
except ModuleNotFoundError as missing:  # no prefect-gcp / google-cloud-aiplatform: the gcp extra is not installed
    KineticVertexWorker = None  # type: ignore[assignment,misc]
    VERTEX_UNAVAILABLE = f"{missing.name} is not installed"
    UNAVAILABLE[VERTEX_WORKER_TYPE] = (
        f"needs the gcp extra ({VERTEX_UNAVAILABLE}): pip install 'kinetic-prefect[gcp]' (or uv sync --extra gcp)"
    )
else:
    VERTEX_UNAVAILABLE = None

__all__ = [
    "GKE_UNAVAILABLE",
    "UNAVAILABLE",
    "VERTEX_UNAVAILABLE",
    "KineticGKEWorker",
    "KineticLocalWorker",
    "KineticVertexWorker",
]
