"""The ``kinetic-prefect`` command, one module per command group: ``app`` (the root: it builds the app from the
groups, and ``main``), ``catalog`` (``catalog``, ``accelerators``), ``checks`` (``doctor``, ``pool-set``; the checks
are ``doctor``'s), ``gke_worker`` (``gke-worker-image``, ``gke-worker-manifests``), ``cleanup``, ``cost``, ``jobs``,
``warm``, ``provision`` (``up``/``down``/``pool``); ``console`` is what they share. The console script is
``kinetic_prefect.cli:main``."""

from kinetic_prefect.cli.app import app, main

__all__ = ["app", "main"]
