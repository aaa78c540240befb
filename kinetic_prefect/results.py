"""Caller side: where Prefect persists task results when the artifact store is in the cloud.

Prefect's own result machinery does the work (result records, cache lookups by cache key);
we only point it at ``<store>/results``. We use Prefect's fsspec-backed ``RemoteFileSystem``
with gcsfs rather than prefect-gcp's ``GcsBucket`` block: it needs no credentials block (gcsfs
uses Application Default Credentials on GCP, anonymous access against an emulator), and adds
one small dependency instead of prefect-gcp and its tree. Anyone who shares the bucket shares
the cache: a cache hit on another machine reads the record written here.
"""

from __future__ import annotations

import os

from prefect.filesystems import RemoteFileSystem

from kinetic_prefect import config


def result_storage(store_url: str | None = None) -> RemoteFileSystem | None:
    """Result storage under ``<store>/results`` for a ``gs://`` store; None (Prefect's default) for a local one."""
    url = store_url or config.default_store_url()
    if not url.startswith("gs://"):
        return None
    # gcsfs hangs 40-70 s per call against emulators with this experimental flag on (its 2026 default).
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    settings = {"token": "anon", "project": "test"} if os.environ.get("STORAGE_EMULATOR_HOST") else {}
    return RemoteFileSystem(basepath=f"{url.rstrip('/')}/results", settings=settings)
