"""Helpers both the caller and the worker use: Prefect run plumbing, environments and images, capacity,
cost. They never import a side (docs/ARCHITECTURE.md, "Who imports whom")."""
