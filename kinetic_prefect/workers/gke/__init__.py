"""The ``kinetic-gke`` worker (``worker``): Kubernetes Jobs on GKE, built on prefect-kubernetes (the ``k8s``
extra), with its variables, capacity fallback, deployment of the worker and the worker's image. Nothing is
imported here: ``kinetic_prefect.workers`` guards the import of the worker for a local-only install."""
