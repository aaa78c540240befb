"""The ``kinetic-prefect`` command, one module per command group: ``app`` (the top-level commands and ``main``),
``jobs``, ``warm``, ``provision`` (``up``/``down``/``pool``), and the work behind ``doctor``, ``cleanup`` and
``cost``. The console script is ``kinetic_prefect.cli:main``."""

from kinetic_prefect.cli.app import app, main

__all__ = ["app", "main"]
