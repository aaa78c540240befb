"""Prefect's ``prefect.collections`` entry point: importing it registers every installed kinetic worker type, so
``prefect worker start --type kinetic-gke`` and Prefect's other lookups by type find it. Only Prefect imports this
module; kinetic-prefect's own code asks ``workers.worker_class`` for the one type it uses."""

from kinetic_prefect import workers

REGISTERED = workers.installed()
