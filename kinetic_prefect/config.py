"""Where things live by default. Everything here can be overridden by environment variables or a work pool."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kinetic_prefect.contract import LOCAL_WORKER_TYPE, settings

DEFAULT_POOL_TYPE = LOCAL_WORKER_TYPE  # the type of the pool a call uses when none is named (made on first use)
DEFAULT_WORK_POOL = DEFAULT_POOL_TYPE  # the embedded default pool is named after its type


def cache_dir() -> Path:
    """The user's cache directory for kinetic-prefect (``$KINETIC_CACHE_DIR`` or ``~/.cache/kinetic-prefect``)."""
    explicit = settings.CACHE_DIR.value()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kinetic-prefect"


def default_store_url() -> str:
    """The artifact store used when the work pool names none: ``$KINETIC_STORE`` or a local directory."""
    return settings.STORE.value() or str(cache_dir() / "store")


def default_work_pool() -> str:
    return settings.WORK_POOL.value() or DEFAULT_WORK_POOL


def package_dir() -> Path:
    """Where the installed ``kinetic_prefect`` package is (its parent is the checkout, when installed from one)."""
    return Path(__file__).resolve().parent


def work_pools_dir() -> Path:
    """The job templates shipped as data (``work_pools/`` in the repo, ``_work_pools`` in a wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_work_pools", here.parent / "work_pools"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("kinetic-prefect's work_pools/ templates are missing from this installation")


def pool_template(worker_type: str) -> dict[str, Any]:
    """The base job template shipped as data in ``work_pools/<type>.json`` (read without Prefect: ``up`` plans a
    pool before it talks to the API)."""
    return dict(json.loads((work_pools_dir() / f"{worker_type}.json").read_text()))
