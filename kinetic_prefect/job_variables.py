"""The pool templates' variables: what a caller may set per call and a worker reads (both sides use these names)."""

from __future__ import annotations

from typing import Any


def pool_default(pool: Any, variable: str) -> Any:
    """The default of ``variable`` in a work pool's base job template (None when the template has none)."""
    return pool.base_job_template.get("variables", {}).get("properties", {}).get(variable, {}).get("default")
