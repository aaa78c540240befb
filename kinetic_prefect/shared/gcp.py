"""Caller and worker side: the GCP access a work pool configures, through prefect-gcp's blocks.

A pool's ``gcp_credentials`` variable names a saved ``GcpCredentials`` block (edit it in the UI, share it
with every pool and flow). It is what the pool's ``gs://`` store client, the results block and the Cloud
Build / Artifact Registry clients authenticate with; unset, they use Application Default Credentials
(anonymous against an emulator, ``STORAGE_EMULATOR_HOST``, for the store). The job itself never sees the
block: it runs with its own environment's credentials (Workload Identity on GKE) and imports no Prefect.

prefect-gcp is imported inside the functions: only pools that use GCP pay for it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kinetic_prefect import config
from kinetic_prefect.errors import KineticError

POOL_VARIABLE = "gcp_credentials"
BLOCK_TYPE_SLUG = "gcp-credentials"
_TTL_SECONDS = 30.0  # like the pool cache: an edit in the UI is seen within this long

_credentials_cache: dict[tuple[str, str], tuple[float, Any]] = {}
_clients: dict[tuple[int, int], Any] = {}
_clients_lock = threading.Lock()


class GcpSettingError(KineticError, ValueError):
    """A work pool's GCP setting cannot work; the message names the setting and its fix."""


def api_url() -> str:
    """The Prefect API this process talks to (a key of the per-API caches)."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def store_url(pool: Any) -> str:
    """The pool's ``store`` variable, else ``KINETIC_STORE``, else the local default."""
    from kinetic_prefect.contract.job_variables import pool_default

    return pool_default(pool, "store") or config.default_store_url()


def block_name(pool_name: str, value: Any) -> str | None:
    """The block a ``gcp_credentials`` value names: ``NAME`` or ``gcp-credentials/NAME``; None when unset."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise GcpSettingError(_fix(pool_name, value, "is not a block name"))
    slug, _, name = value.rpartition("/")
    if slug not in ("", BLOCK_TYPE_SLUG) or not name:
        raise GcpSettingError(_fix(pool_name, value, f"names no {BLOCK_TYPE_SLUG} block"))
    return name


def _fix(pool_name: str, value: Any, problem: str) -> str:
    return (
        f"work pool {pool_name!r}: {POOL_VARIABLE}={value!r} {problem}. Save a GcpCredentials block "
        f"(`prefect block create {BLOCK_TYPE_SLUG}` or, in Python, "
        "`GcpCredentials(service_account_info=...).save('NAME')`) and name it: "
        f"`kinetic-prefect pool-set {pool_name} {POOL_VARIABLE}=NAME`, or clear the setting to use Application "
        f"Default Credentials: `kinetic-prefect pool-set {pool_name} {POOL_VARIABLE}=`"
    )


async def pool_credentials(pool: Any) -> Any:
    """The ``GcpCredentials`` block the pool names (loaded, cached for a short while), or None; called before
    anything is uploaded or built."""
    from kinetic_prefect.contract.job_variables import pool_default

    return await credentials_block(pool.name, pool_default(pool, POOL_VARIABLE))


async def credentials_block(pool_name: str, value: Any) -> Any:
    """The ``GcpCredentials`` block a ``gcp_credentials`` value names (loaded, cached for a short while), or None.
    The one way both sides load it: the caller for its pool, a worker for a job's configuration.

    Raises :class:`GcpSettingError` when the name is malformed, no such block exists, or the block's
    credentials do not load.
    """
    name = block_name(pool_name, value)
    if name is None:
        return None
    key = (api_url(), name)
    cached = _credentials_cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < _TTL_SECONDS:
        return cached[1]
    from prefect.exceptions import ObjectNotFound
    from prefect_gcp import GcpCredentials

    try:
        block = await GcpCredentials.aload(name)
    except (ValueError, ObjectNotFound) as exc:  # Prefect raises ValueError for a missing block document
        raise GcpSettingError(_fix(pool_name, value, f"cannot be loaded ({exc})")) from None
    except Exception as exc:  # the block exists but its credentials do not load (a bad key, no ADC)
        raise GcpSettingError(
            _fix(pool_name, value, f"does not give credentials ({type(exc).__name__}: {exc})")
        ) from None
    _credentials_cache[key] = (time.monotonic(), block)
    return block


def storage_client(credentials: Any) -> Any:
    """A ``google.cloud.storage.Client`` for a ``GcpCredentials`` block, one per process and block content;
    None for no block (the store then uses its default client)."""
    if credentials is None:
        return None
    key = (os.getpid(), hash(credentials))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = credentials.get_cloud_storage_client()
        return client


def open_store(url: str, credentials: Any = None) -> Any:
    """The artifact store at ``url``, authenticated with ``credentials`` (a ``GcpCredentials`` block) if given."""
    from kinetic_prefect import storage

    client = storage_client(credentials) if url.startswith("gs://") else None
    return storage.open_store(url, gcs_client=client)


def google_credentials(credentials: Any) -> Any:
    """The ``google.auth`` credentials of a block (for Cloud Build and Artifact Registry clients); None: ADC."""
    return None if credentials is None else credentials.get_credentials_from_service_account()


__all__ = [
    "GcpSettingError",
    "POOL_VARIABLE",
    "block_name",
    "google_credentials",
    "open_store",
    "pool_credentials",
    "storage_client",
    "store_url",
]
