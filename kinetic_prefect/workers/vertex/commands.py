"""kinetic-vertex's side of the ``kinetic-prefect`` command: its platform for ``up`` / ``down --platform vertex``.
Light, like every launcher's commands module (the CLI imports it for ``--help``): the provisioning and its Google
clients are imported when a command runs."""

from __future__ import annotations

from typing import Any

PLATFORM = "vertex"


def provisioning() -> Any:
    """APIs, registry, bucket, the jobs' service account and its grants, the signing key and the pool; no cluster
    (``workers/vertex/provision.py``)."""
    from kinetic_prefect.workers.vertex.provision import VertexPlatform

    return VertexPlatform()
