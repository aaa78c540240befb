"""Caller side: a damaged ``Data`` object in the store heals from the caller's own copy.

A ``data/<sha>/`` object is content-addressed and written once; if a file under ``files/`` is changed or
removed later (a disk error, someone's edit), every call with the same content would be refused by the job,
forever. The caller has the data (it has just hashed it), so it puts the damaged files back:

* on a local store, before each call: every stored file is checked against the manifest (a stat per file;
  its content hash is memoized by stat like the caller's own hashing, so a healthy copy is read once per
  process);
* on a remote store the job checks what it downloads; when it reports a damaged copy, the caller uploads the
  files again, and the next call (or the task's retry) gets a good one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from kinetic_prefect.contract import PHASE_FETCH_DATA, data_files_key, data_key
from kinetic_prefect.pod import data_manifest
from kinetic_prefect.pod.data_manifest import Manifest
from kinetic_prefect.pod.data_sources import DataError
from kinetic_prefect.storage import Store

_logger = logging.getLogger(__name__)


def files_prefix(manifest: Manifest) -> str:
    return data_files_key(data_key(manifest.sha256))


def damaged_files(manifest: Manifest, store: Store) -> list[str]:
    """Relative paths of the stored files that are missing or differ from ``manifest`` (local stores only)."""
    base = store.local_path(files_prefix(manifest))
    if base is None:
        return []
    damaged = []
    for rel, size, sha in manifest.files:
        path = base.joinpath(*rel.split("/"))
        try:
            st = os.stat(path)
        except OSError:
            damaged.append(rel)
            continue
        if st.st_size != size:
            damaged.append(rel)
            continue
        try:
            stored_sha = data_manifest.file_sha256(str(path), st)
        except DataError:
            damaged.append(rel)
            continue
        if stored_sha != sha:
            damaged.append(rel)
    return damaged


def repair(manifest: Manifest, store: Store, rels: list[str], on_file: Callable[[int], None] | None = None) -> int:
    """Upload ``rels`` again from the caller's copy (just hashed: it is what the manifest says); bytes written."""
    pairs = [(rel, manifest.path_of(rel)) for rel in rels]
    written = store.put_tree(files_prefix(manifest), pairs, on_file=on_file)
    _warn(
        f"Data {manifest.root.name}: {len(rels)} damaged file(s) in the store's copy "
        f"{store.url_for(files_prefix(manifest))} replaced from {manifest.root} "
        f"(e.g. {', '.join(rels[:3])})"
    )
    return written


def heal_before_call(manifest: Manifest, store: Store, on_file: Callable[[int], None] | None = None) -> int:
    damaged = damaged_files(manifest, store)
    return repair(manifest, store, damaged, on_file) if damaged else 0


def heal_reported(store: Store, manifests: list[Manifest], outcome: Any) -> list[str]:
    """The job refused a ``Data`` object as damaged: upload every file of it again. Returns the names healed."""
    if outcome.user_error or outcome.phase != PHASE_FETCH_DATA:
        return []
    healed = []
    for manifest in manifests:
        if manifest.sha256 in (outcome.message or ""):
            repair(manifest, store, [rel for rel, _size, _sha in manifest.files])
            healed.append(manifest.root.name)
    return healed


def _warn(message: str) -> None:
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # outside a run: the module's logger
        _logger.warning(message)
