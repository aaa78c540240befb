"""The pod side: what runs inside a job (the runner and what the user's function imports there).

Everything here ships into job environments and images (``shared.image.RUNNER_MODULES``) beside the
contract and the leaves (``storage``, ``signing``, ``errors``, ``accelerators``, ``config``), and
imports nothing else of the package: no Prefect, no caller, no worker.
"""
