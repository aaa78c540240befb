"""Worker types, registered with Prefect through the ``prefect.collections`` entry point.

Importing a BaseWorker subclass registers it by its ``type``; Prefect imports this module
when it loads collections, so ``prefect worker start --type kinetic-local`` finds it.
"""

from kinetic_prefect.workers.gke import KineticGKEWorker
from kinetic_prefect.workers.local import KineticLocalWorker

__all__ = ["KineticGKEWorker", "KineticLocalWorker"]
