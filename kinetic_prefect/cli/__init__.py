"""The ``kinetic-prefect`` command, one module per command group: ``app`` (the root: it builds the app from the
groups, and ``main``), ``catalog`` (``catalog``, ``accelerators``), ``checks`` (``doctor``, ``pool-set``; the checks
are ``doctor``'s), ``cleanup``, ``cost``, ``jobs``, ``warm``, ``provision`` (``up``/``down``/``pool``); ``console`` is
what they share. A launcher's own commands (kinetic-gke's ``gke-worker-image``, ``gke-worker-manifests``) come from
its registration line in ``workers.LAUNCHERS``. The console script is
``kinetic_prefect.cli:main``."""

from kinetic_prefect.cli.app import app, main

__all__ = ["app", "main"]
