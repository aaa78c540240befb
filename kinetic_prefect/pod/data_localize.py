"""Job side of data: a local path for each ``DataRef`` of a call, downloaded at most once per node.

Uploaded data (its store layout: :mod:`kinetic_prefect.pod.data_upload`) is read in place from a store on this
machine, else downloaded into the node cache and checked against its content hash; gs:// data is downloaded
from its URL (a URL that names one object gives that file), hf:// data through ``huggingface_hub``
(:mod:`kinetic_prefect.pod.data_hf`). ``Data(..., fuse=True)`` is read where it is: at its Cloud Storage FUSE
mount on kinetic-gke (``KINETIC_FUSE_ROOT``), in place for a local path on kinetic-local, and fetched through the
store's client like any gs:// data there.

Node cache layout (``<id>`` is the content hash, or sha256 of the URL for gs:// data)::

    <node_cache>/data/<id>/files/...     what localize() returns (the directory, or files/<name> for a file)
    <node_cache>/data/<id>/complete.json the marker; the whole <id> directory appears by one atomic rename

The job runner imports this module, so only the stdlib and the storage leaf are imported here at module level.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kinetic_prefect import signing
from kinetic_prefect.contract import Env, data_files_key, data_key, data_manifest_key
from kinetic_prefect.pod.data_hf import download_hf
from kinetic_prefect.pod.data_manifest import Manifest, build_manifest
from kinetic_prefect.pod.data_ref import DataRef
from kinetic_prefect.pod.data_sources import DataError, parse_gs_url
from kinetic_prefect.storage import ObjectNotFound, Store, open_store

_COMPLETE = "complete.json"


def _node_entry(node_cache: Path, ident: str, fill: Callable[[Path], dict[str, Any]]) -> Path:
    """``node_cache/data/<ident>``, filled once per node: ``fill(staging)`` writes ``staging/files``; the marker is
    written inside the staging directory, which is then renamed into place (a crash leaves no partial entry)."""
    target = Path(node_cache) / "data" / ident
    if (target / _COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{ident[:16]}.", dir=target.parent))
    renamed = False
    try:
        info = fill(staging)
        (staging / _COMPLETE).write_text(json.dumps(info))
        if target.exists() and not (target / _COMPLETE).is_file():  # left by something else: not ours to trust
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
            renamed = True
        except OSError:
            if not (target / _COMPLETE).is_file():  # not a lost race with another job on this node
                raise
    finally:
        if not renamed:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _download_keys(store: Store, keys: list[str], base: str, dest: Path, workers: int = 32) -> None:
    def fetch(key: str) -> None:
        store.get_file(key, dest.joinpath(*key[len(base) :].split("/")))

    if len(keys) <= 1:
        for key in keys:
            fetch(key)
        return
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(workers, len(keys)), thread_name_prefix="kinetic-data"
    ) as pool:
        for future in [pool.submit(fetch, key) for key in keys]:
            future.result()


def _localize_uploaded(ref: DataRef, store: Store, node_cache: Path, key: signing.KeyLike = None) -> Path:

    if ref.key is None or ref.sha256 is None:
        raise DataError(f"data {ref.name} was not uploaded (no store key): pass it again from the caller")
    marker = data_manifest_key(ref.key)
    local = store.local_path(data_files_key(ref.key))
    if local is not None:  # the store is a directory on this machine: read the data in place
        if not store.exists(marker):
            raise _not_uploaded(ref, store)
        # Authenticated stores: the data read in place must be what the signed payload names. Its content hash
        # is the check (the manifest is the caller's, signed under the store scope that no job holds a key for).
        if key is not None:
            got = build_manifest(local / ref.name if ref.kind == "file" else local, workers=8, memo=True)
            if got.sha256 != ref.sha256:
                raise DataError(
                    f"data {ref.name} in {store.url_for(ref.key)} does not match its content hash "
                    f"{ref.sha256}: it was changed in the store; refusing to use it. The caller puts "
                    "the damaged files back from its own copy before the next call; without that copy, "
                    f"delete {store.url_for(ref.key)}/ and call with the data again"
                )
        return local / ref.name if ref.kind == "file" else local

    prefix = ref.key

    def fill(staging: Path) -> dict[str, Any]:
        try:
            # Read for the report only: what is used is checked against the payload's content hash below.
            manifest = Manifest.from_json(store.get_bytes(marker), staging / "files")
        except ObjectNotFound:
            raise _not_uploaded(ref, store) from None
        store.get_tree(data_files_key(prefix), staging / "files")
        root = staging / "files" / ref.name if ref.kind == "file" else staging / "files"
        got = build_manifest(root, workers=8, memo=False) if root.exists() else None
        if got is None or got.sha256 != ref.sha256:
            raise DataError(
                f"data {ref.name} downloaded from {store.url_for(prefix)} does not match its content "
                f"hash {ref.sha256} ({_diff(manifest, got)}): the store copy is damaged. The caller "
                "uploads it again from its own copy on reading this report, so the task's retry or "
                f"the next call gets a good one; without that copy, delete {store.url_for(prefix)}/ "
                "and call with the data again"
            )
        return {"sha256": ref.sha256, "name": ref.name, "kind": ref.kind, "source": store.url_for(prefix)}

    target = _node_entry(node_cache, ref.sha256, fill)
    return target / "files" / ref.name if ref.kind == "file" else target / "files"


def _diff(expected: Manifest, got: Manifest | None) -> str:
    if got is None:
        return "nothing was downloaded"
    want = {rel: sha for rel, _s, sha in expected.files}
    have = {rel: sha for rel, _s, sha in got.files}
    bad = sorted(set(want) ^ set(have)) + sorted(r for r in set(want) & set(have) if want[r] != have[r])
    return f"{len(bad)} file(s) differ, e.g. {bad[:3]}" if bad else "kind differs"


def _not_uploaded(ref: DataRef, store: Store) -> DataError:
    manifest = store.url_for(data_manifest_key(ref.key or data_key(str(ref.sha256))))
    return DataError(
        f"data {ref.name} ({ref.sha256}) is not in the store {store.url}: "
        f"{manifest} is missing; the caller uploads it before "
        "launching the job, so check that the job uses the caller's store"
    )


def _localize_url(ref: DataRef, node_cache: Path) -> Path:
    url = ref.url
    if url is None:
        raise DataError(f"data {ref.name} names no URL: pass Data('gs://...') from the caller")
    bucket, path = parse_gs_url(url)
    ident = hashlib.sha256(url.encode()).hexdigest()
    kind_box: list[str] = []

    def fill(staging: Path) -> dict[str, Any]:
        files = staging / "files"
        files.mkdir()
        if path and not path.endswith("/"):
            bucket_store = open_store(f"gs://{bucket}")
            if bucket_store.exists(path):  # an object: a file (else the URL names a prefix without its slash)
                bucket_store.get_file(path, files / ref.name)
                kind_box.append("file")
                return {"url": url, "kind": "file", "name": ref.name}
        prefix = path.rstrip("/")
        store = open_store(f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}")
        keys = [key for key in store.list("") if not key.endswith("/")]  # "folder/" placeholders hold no data
        if not keys:
            raise DataError(
                f"data URL {url} names no object and no objects exist under it: check the bucket and "
                "path (gsutil ls " + url + ")"
            )
        for key in keys:
            if any(part in ("", ".", "..") for part in key.split("/")):
                raise DataError(
                    f"object {store.url_for(key)} under {url} has a name that is not a file path "
                    "(empty, '.' or '..' segments): rename it or point Data at a cleaner prefix"
                )
        _download_keys(store, keys, "", files)
        kind_box.append("dir")
        return {"url": url, "kind": "dir", "name": ref.name, "files": len(keys)}

    target = _node_entry(node_cache, ident, fill)
    kind = kind_box[0] if kind_box else json.loads((target / _COMPLETE).read_text()).get("kind", "dir")
    return target / "files" / ref.name if kind == "file" else target / "files"


def _localize_hf(ref: DataRef, node_cache: Path) -> Path:
    url = ref.url or ""

    def fill(staging: Path) -> dict[str, Any]:
        files = download_hf(url, staging / "files")
        return {"url": url, "kind": "dir", "name": ref.name, "files": files}

    return _node_entry(node_cache, "hf-" + hashlib.sha256(url.encode()).hexdigest(), fill) / "files"


def _localize_fuse(ref: DataRef) -> Path | None:
    """FUSE data where it is: the pod's mount (kinetic-gke), the caller's path in place; None: fetch it as a copy."""
    root = os.environ.get(Env.FUSE_ROOT)
    source = ref.url or ref.path
    if root:
        mount = Path(root) / str(ref.fuse)
        if not mount.is_dir():
            raise DataError(
                f"Data({source!r}, fuse=True) was to be mounted at {mount}, but this pod has no such mount: the "
                "pool's job template predates FUSE volumes (its gcs_fuse_mounts variable); update it with "
                "`prefect work-pool update POOL --base-job-template work_pools/kinetic-gke.json`"
            )
        return mount / ref.name if ref.kind == "file" else mount
    if ref.path is None:
        return None  # gs:// on kinetic-local: fetched through the store's client into the node cache
    local = Path(ref.path)
    if not local.exists():
        raise DataError(
            f"Data({ref.path!r}, fuse=True) is read in place on kinetic-local, and {ref.path} does not exist on "
            f"this job's host ({os.uname().nodename}): run the worker on the machine that has the data, or drop "
            "fuse=True so the data is uploaded through the store"
        )
    return local


def localize(ref: DataRef, store: Store, node_cache: Path, key: signing.KeyLike = None) -> Path:
    """Job side: a local path to the file or directory ``ref`` stands for (downloaded at most once per node).

    Uploaded data is read in place from a local store, else downloaded into ``node_cache`` and checked against
    its content hash. gs:// data is cached per URL: an object rewritten later under the same URL is not fetched
    again on a node that already holds it (point Data at a new URL, e.g. a versioned prefix, to change data).
    """
    if ref.fuse is not None:
        where = _localize_fuse(ref)
        if where is not None:
            return where
    if ref.url is not None and ref.url.startswith("hf://"):
        return _localize_hf(ref, Path(node_cache))
    if ref.url is not None:
        return _localize_url(ref, Path(node_cache))
    if not ref.key or not ref.sha256:
        raise DataError(f"{ref!r} has neither a gs:// URL nor a store key: it was not made by to_ref()")
    return _localize_uploaded(ref, store, Path(node_cache), key)
