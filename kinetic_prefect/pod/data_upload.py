"""Caller side of local data: putting it into the artifact store under its content address.

Store layout (``sha`` is the content hash of the manifest)::

    data/<sha>/files/<relative path>     the files (a single file: data/<sha>/files/<its name>)
    data/<sha>/manifest.json             written last, first-writer-wins: its presence means "complete"

The job never uploads, but this module ships to it: :mod:`kinetic_prefect.pod.data` re-exports :func:`upload`, so
only the stdlib and the storage leaf are imported here at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kinetic_prefect import signing
from kinetic_prefect.contract import data_files_key, data_key, data_manifest_key
from kinetic_prefect.pod.data_manifest import Manifest
from kinetic_prefect.pod.data_sources import DataError, unreadable_error
from kinetic_prefect.storage import Store


def upload(
    manifest: Manifest,
    store: Store,
    *,
    workers: int = 32,
    key: signing.KeyLike = None,
    on_file: Callable[[int], None] | None = None,
    heal: Callable[[Manifest, Store, Callable[[int], None] | None], int] | None = None,
) -> int:
    """Put the data into ``store`` under ``data/<sha>/``; returns the bytes uploaded (0 if it is already there).
    ``heal`` (the caller's ``data_repair.heal_before_call``) checks a stored copy and puts back damaged files."""
    prefix = data_key(manifest.sha256)
    marker = data_manifest_key(prefix)
    if store.exists(marker):  # already there; a damaged file of it is put back from this copy
        return heal(manifest, store, on_file) if heal is not None else 0
    pairs = [(rel, manifest.path_of(rel)) for rel, _size, _sha in manifest.files]
    uploaded = store.put_tree(data_files_key(prefix), pairs, workers=workers, on_file=on_file)
    if manifest.stats_when_hashed:  # a file rewritten after hashing would sit under the wrong content address
        for (rel, _size, _sha), (size, mtime_ns) in zip(manifest.files, manifest.stats_when_hashed):
            path = manifest.path_of(rel)
            try:
                st = os.stat(path)
            except OSError as exc:
                raise unreadable_error(path, exc) from exc
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                raise DataError(
                    f"data file {path} changed between hashing and upload: call the task again once "
                    "it is no longer being written"
                )
    from kinetic_prefect import signing

    signing.put(store, marker, manifest.to_json().encode(), key, if_absent=True)
    return uploaded
