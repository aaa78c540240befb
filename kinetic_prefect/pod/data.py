"""Datasets as arguments of a kinetic task: ``Data("./eurosat")``, ``Data("gs://bucket/prefix/")``, a single object
``Data("gs://bucket/dir/file.csv")``, a Hugging Face dataset ``Data("hf://user/repo")``, and ``fuse=True`` for data
read where it is instead of copied (``Data("gs://bucket/imagenet/", fuse=True)``: a Cloud Storage FUSE volume on
kinetic-gke).

The caller side turns every :class:`Data` found in a call's arguments into a :class:`DataRef` (what is pickled
into the payload), after :func:`hash_local` and :func:`upload` have put local data into the artifact store under a
content address; the job side turns each ``DataRef`` back into a local path with :func:`localize`.

This module holds the argument and what the payload carries in its place. Each job around them has its own
module, whose public names are importable from here too:

* :mod:`kinetic_prefect.pod.data_ref`: the :class:`DataRef` itself (the job side reads it without this module);
* :mod:`kinetic_prefect.pod.data_sources`: checking a source (a gs:// URL, a local path's files); :class:`DataError`;
* :mod:`kinetic_prefect.pod.data_manifest`: content hashing (:class:`Manifest`);
* :mod:`kinetic_prefect.pod.data_upload`: the caller's upload into the store (:func:`upload`);
* :mod:`kinetic_prefect.pod.data_localize`: the job's local path for each ``DataRef`` (:func:`localize`);
* :mod:`kinetic_prefect.pod.data_hf`: an hf:// dataset's files, through ``huggingface_hub`` in the job;
* :mod:`kinetic_prefect.pod.data_walk`: finding, replacing them in the arguments (:func:`find`, :func:`transform`).

The job runner imports this module, so only the stdlib and the storage leaf are imported here (and in those
modules) at module level.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from pathlib import Path

from kinetic_prefect.contract import data_key
from kinetic_prefect.pod.data_localize import localize
from kinetic_prefect.pod.data_manifest import Manifest, build_manifest
from kinetic_prefect.pod.data_ref import DataRef
from kinetic_prefect.pod.data_sources import DataError, check_fuse_url, parse_gs_url, parse_hf_url, validate_local
from kinetic_prefect.pod.data_upload import upload
from kinetic_prefect.pod.data_walk import find, transform

__all__ = [
    "Data",
    "DataError",
    "DataRef",
    "Manifest",
    "find",
    "fuse_mount_id",
    "hash_local",
    "localize",
    "to_ref",
    "transform",
    "upload",
]


class Data:
    """A local file or directory, gs://bucket/object or gs://bucket/prefix/, or hf://user/dataset — passed to a
    kinetic task.

    Local data is validated here (it exists, holds at least one file, every file is readable) and content-hashed
    and uploaded once per content when the task is called; gs:// and hf:// data is never copied through the store,
    the job fetches it itself (and nothing is checked here but the URL: no network at construction).

    ``fuse=True``: the job reads the data where it is instead of a copy. On kinetic-gke a gs:// source (or the
    store's copy of a local one) is a read-only Cloud Storage FUSE volume, read as files are opened; on
    kinetic-local a local path is used in place and gs:// data is fetched through the store's client.
    """

    __slots__ = ("source", "is_remote", "local_path", "fuse")

    def __init__(self, source: str | os.PathLike[str], fuse: bool = False):
        if isinstance(source, Data):
            source = source.source
        if not isinstance(fuse, bool):
            raise DataError(f"Data({source!r}, fuse={fuse!r}): fuse takes True or False")
        self.fuse: bool = fuse
        try:
            text = os.fspath(source)
        except TypeError:
            raise DataError(f"Data() takes a path or a gs:// URL, not {type(source).__name__} {source!r}") from None
        if isinstance(text, bytes):
            text = os.fsdecode(text)
        if not text:
            raise DataError("Data('') names no data: pass a file, a directory or a gs://bucket/... URL")
        self.source: str = text
        self.is_remote: bool = text.startswith(("gs://", "hf://"))
        self.local_path: Path | None = None
        if text.startswith("hf://"):
            parse_hf_url(text)
            if fuse:
                raise DataError(
                    f"Data({text!r}, fuse=True): a Hugging Face dataset cannot be mounted; drop fuse=True (the job "
                    "downloads it), or copy it to a bucket and pass Data('gs://...', fuse=True)"
                )
            return
        if self.is_remote:
            parse_gs_url(text)
            if fuse:
                check_fuse_url(text)
            return
        if text.startswith("file://"):
            parsed = urllib.parse.urlsplit(text)
            if parsed.netloc not in ("", "localhost") or not parsed.path:
                raise DataError(f"unsupported file URL {text!r}: use file:///absolute/path or a plain path")
            text = urllib.parse.unquote(parsed.path)
        elif "://" in text:
            raise DataError(
                f"unsupported data source {text!r}"
                + (" with fuse=True: only gs:// data is mounted" if fuse else "")
                + ": use a local path, gs://bucket/object (gs://bucket/prefix/ for a folder) or hf://user/dataset; "
                "other schemes are not supported"
            )
        # abspath, not resolve(): a symlink keeps the name the user gave it
        self.local_path = Path(os.path.abspath(os.path.expanduser(text)))
        validate_local(self.local_path)

    @property
    def kind(self) -> str | None:
        """ "file" or "dir" for local data (as it is now); None for gs:// data (decided when the job fetches it)."""
        if self.local_path is None:
            return None
        return "dir" if self.local_path.is_dir() else "file"

    def __repr__(self) -> str:
        return f"Data({self.source!r}" + (", fuse=True)" if self.fuse else ")")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Data) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[object, ...]:
        return (self.is_remote, self.source if self.is_remote else str(self.local_path), self.fuse)

    def __getstate__(self) -> dict[str, object]:
        return {"source": self.source, "is_remote": self.is_remote, "local_path": self.local_path, "fuse": self.fuse}

    def __setstate__(self, state: dict[str, object]) -> None:
        object.__setattr__(self, "fuse", False)  # pickled before fuse= existed
        for name, value in state.items():
            object.__setattr__(self, name, value)


def fuse_mount_id(data: Data) -> str:
    """The id of a FUSE Data's mount: one per source, so the same Data passed twice is mounted once."""
    return hashlib.sha256(data.source.encode() if data.is_remote else os.fsencode(data.local_path or "")).hexdigest()[
        :16
    ]


def hash_local(data: Data, *, workers: int = 8) -> Manifest:
    """The content manifest of local data (validating it again: it may have changed since ``Data()``)."""
    if data.is_remote or data.local_path is None:
        raise DataError(f"{data!r} is remote data: it is not hashed or uploaded, the job downloads it directly")
    return build_manifest(data.local_path, workers=workers, memo=True)


def to_ref(data: Data, manifest: Manifest | None) -> DataRef:
    fuse = fuse_mount_id(data) if data.fuse else None
    if data.source.startswith("hf://"):
        repo_id, _revision = parse_hf_url(data.source)
        return DataRef(kind="dir", name=repo_id.rsplit("/", 1)[-1], sha256=None, key=None, url=data.source)
    if data.is_remote:
        bucket, path = parse_gs_url(data.source)
        name = path.rstrip("/").rsplit("/", 1)[-1] if path.strip("/") else bucket
        kind = "file" if path and not path.endswith("/") else "dir"
        return DataRef(kind=kind, name=name, sha256=None, key=None, url=data.source, fuse=fuse)
    if data.fuse:  # not hashed here: kinetic-local reads it in place; a FUSE pool's caller uploads it (data_mounts)
        assert data.local_path is not None and data.kind is not None
        return DataRef(
            kind=data.kind,
            name=data.local_path.name,
            sha256=None,
            key=None,
            url=None,
            fuse=fuse,
            path=str(data.local_path),
        )
    if manifest is None:
        manifest = hash_local(data)
    elif manifest.root != data.local_path:
        raise ValueError(f"manifest of {manifest.root} passed with {data!r}: hash_local(data) makes the right one")
    assert data.local_path is not None  # not remote
    return DataRef(
        kind=manifest.kind, name=data.local_path.name, sha256=manifest.sha256, key=data_key(manifest.sha256), url=None
    )
