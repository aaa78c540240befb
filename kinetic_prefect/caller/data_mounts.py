"""Caller side of ``Data(..., fuse=True)``: the Cloud Storage FUSE volumes a call needs, planned for its pool before
anything is uploaded.

The payload is the same for every pool: a FUSE Data travels as a ``DataRef`` carrying its mount id. A pool whose
launcher mounts volumes (its abilities' ``fuse_mounts``: kinetic-gke) is sent ``{mount id: gs://bucket/dir}`` in
its template's ``gcs_fuse_mounts`` variable, for a gs:// source its own bucket and prefix, for a local source the
store's copy, which is uploaded once per content like any local Data. A pool whose launcher does not
(kinetic-local) is sent nothing: its job reads a local source in place and fetches a gs:// one through the store's
client.
"""

from __future__ import annotations

import posixpath
from typing import Any

from kinetic_prefect.contract import data_key
from kinetic_prefect.pod import data
from kinetic_prefect.pod.data_sources import DataError, parse_gs_url

FUSE_VARIABLE = "gcs_fuse_mounts"  # the variable of a pool that mounts volumes (workers/gke/variables.py)


def fuse_data(args: tuple, kwargs: dict[str, Any]) -> list[data.Data]:
    """The distinct ``Data(..., fuse=True)`` of a call (volumes= included: they are its first argument)."""
    found: dict[str, data.Data] = {}
    for item in data.find((args, kwargs), data.Data):
        if item.fuse:
            found.setdefault(data.fuse_mount_id(item), item)
    return list(found.values())


def _mounted_directory(item: data.Data, store_url: str, manifests: list[Any]) -> str:
    """``gs://bucket/dir`` a volume mounts for ``item``: a file's parent (the job opens ``<mount>/<name>``)."""
    if item.is_remote:
        bucket, path = parse_gs_url(item.source)
        directory = path.rstrip("/") if not path or path.endswith("/") else posixpath.dirname(path)
    else:
        if not store_url.startswith("gs://"):
            raise DataError(
                f"{item!r}: a FUSE volume mounts Cloud Storage, and this pool's store {store_url} is not gs://; "
                "set the pool's store to gs://BUCKET/PREFIX or drop fuse=True"
            )
        manifest = data.hash_local(item)
        manifests.append(manifest)
        bucket, prefix = parse_gs_url(store_url)
        directory = posixpath.join(prefix.strip("/"), data_key(manifest.sha256), "files")
    return f"gs://{bucket}/{directory}" if directory else f"gs://{bucket}"


def plan(call: Any, pool: Any, pool_variables: set[str], store_url: str) -> dict[str, str]:
    """The ``gcs_fuse_mounts`` of ``call`` on ``pool`` (empty: nothing to mount there); the manifests of local FUSE
    data a mounting pool needs in the store join ``call.data``, uploaded with the others."""
    if not call.fuse:
        return {}
    from kinetic_prefect.caller.pools import abilities_of

    if FUSE_VARIABLE not in pool_variables:
        if abilities_of(pool.type).fuse_mounts:
            raise ValueError(
                f"{call.fuse[0]!r}: pool {pool.name!r} cannot mount Cloud Storage FUSE volumes: its base job "
                f"template has no `{FUSE_VARIABLE}` variable (made before FUSE data). Update it: `prefect work-pool "
                f"update {pool.name} --base-job-template work_pools/{pool.type}.json`"
            )
        return {}
    manifests: list[Any] = []
    mounts = {data.fuse_mount_id(item): _mounted_directory(item, store_url, manifests) for item in call.fuse}
    known = {manifest.sha256 for manifest in call.data}
    call.data.extend(manifest for manifest in manifests if manifest.sha256 not in known)
    return mounts
