"""Provisioning: ``kinetic-prefect up`` / ``down`` / ``pool`` create and remove what the ``kinetic-gke`` pool runs on.

``plan`` turns the command's settings into names and Google API requests (pure logic, checked before any request),
``steps`` looks each resource up and creates or deletes it, ``cluster_access`` reaches the new cluster's
Kubernetes API (the in-cluster worker, node counts). Tooling that knows GKE: it uses the worker side (the pool
template, the worker's manifests), never the caller.
"""
