"""Caller side: where Prefect persists a kinetic task's results when its pool's store is in the cloud.

Prefect's own result machinery does the work (result records, cache lookups by cache key); we only
point it at ``<store>/results`` through a *saved* prefect-gcp ``GcsBucket`` block, so every result
record names its storage block (``storage_block_id``) and anyone can read it back from the UI's block
or from another machine. The block is derived from the store: its name is ``kinetic-results-`` and a
hash of the bucket and prefix, it is created on first use and reused after, and it references the
pool's ``GcpCredentials`` block when the pool names one (else default credentials, i.e. Application
Default Credentials). Anyone who shares the bucket shares the cache.

The store is the one the task's pool uses (its ``store`` variable, else ``KINETIC_STORE``), resolved
when the task is called, before Prefect looks up its cache (see ``KineticTask``). A local store keeps
Prefect's default result storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import urllib.parse
from typing import Any

from kinetic_prefect.contract import results_prefix
from kinetic_prefect.shared import gcp

BLOCK_PREFIX = "kinetic-results-"
_TTL_SECONDS = 30.0
_blocks: dict[tuple[str, str, Any], tuple[float, Any]] = {}


def block_name(store_url: str) -> str:
    """``kinetic-results-<12 hex>``: the same on every machine for one ``gs://bucket/prefix``."""
    return BLOCK_PREFIX + hashlib.sha256(store_url.rstrip("/").encode()).hexdigest()[:12]


def _bucket_and_folder(store_url: str) -> tuple[str, str]:
    parsed = urllib.parse.urlsplit(store_url)
    prefix = parsed.path.strip("/")
    return parsed.netloc, results_prefix(prefix)


def _same(block: Any, bucket: str, folder: str, credentials: Any) -> bool:
    nested = block.gcp_credentials
    wanted_id = getattr(credentials, "_block_document_id", None)
    return (
        block.bucket == bucket
        and block.bucket_folder.rstrip("/") == folder
        and getattr(nested, "_block_document_id", None) == wanted_id
        and (wanted_id is not None or nested.service_account_info is None and nested.service_account_file is None)
    )


async def result_storage(store_url: str, credentials: Any = None, pool_name: str = "?") -> Any:
    """The saved ``GcsBucket`` block for ``<store_url>/results`` (created or updated if need be), or None
    for a local store. ``credentials``: the pool's ``GcpCredentials`` block, or None for default ones."""
    if not store_url.startswith("gs://"):
        return None
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect_gcp import GcpCredentials, GcsBucket

    key = (gcp.api_url(), store_url.rstrip("/"), getattr(credentials, "_block_document_id", None))
    cached = _blocks.get(key)
    if cached is not None and time.monotonic() - cached[0] < _TTL_SECONDS:
        return cached[1]
    bucket, folder = _bucket_and_folder(store_url)
    name = block_name(store_url)
    try:
        if credentials is None:
            credentials = GcpCredentials()  # Application Default Credentials, looked up here
        try:
            block = await GcsBucket.aload(name)
        except (ValueError, ObjectNotFound):
            block = None
        if block is None or not _same(block, bucket, folder, credentials):
            fresh = GcsBucket(bucket=bucket, bucket_folder=folder, gcp_credentials=credentials)
            with contextlib.suppress(ObjectAlreadyExists):  # another caller created it a moment ago
                await fresh.asave(name, overwrite=block is not None)
            block = await GcsBucket.aload(name)
    except gcp.GcpSettingError:
        raise
    except Exception as exc:  # google.auth's DefaultCredentialsError and friends
        raise gcp.GcpSettingError(
            f"results of work pool {pool_name!r} live in {store_url}/results, but no GCP credentials were found "
            f"({type(exc).__name__}: {exc}). Name a GcpCredentials block: `kinetic-prefect pool-set {pool_name} "
            f"{gcp.POOL_VARIABLE}=NAME`, or set up Application Default Credentials (`gcloud auth "
            "application-default login`, GOOGLE_APPLICATION_CREDENTIALS, Workload Identity)"
        ) from exc
    _blocks[key] = (time.monotonic(), block)
    return block


async def for_pool(pool_name: str) -> Any:
    """The result storage of a kinetic task that runs on ``pool_name`` (None: Prefect's default)."""
    from kinetic_prefect.caller.pools import ensure_work_pool
    from kinetic_prefect.shared.prefect_runs import shared_client

    async with shared_client() as client:
        pool = await ensure_work_pool(client, pool_name)
    url = gcp.store_url(pool)
    if not url.startswith("gs://"):
        return None
    return await result_storage(url, await gcp.pool_credentials(pool), pool.name)


__all__ = ["BLOCK_PREFIX", "block_name", "for_pool", "result_storage"]
