"""Datasets as arguments of a kinetic task: ``Data("./eurosat")`` or ``Data("gs://bucket/prefix/")``.

The caller side turns every :class:`Data` found in a call's arguments into a :class:`DataRef` (what is pickled
into the payload), after :func:`hash_local` and :func:`upload` have put local data into the artifact store under a
content address; the job side turns each ``DataRef`` back into a local path with :func:`localize`.

This module holds the argument and what the payload carries in its place. Each job around them has its own
module, whose public names are importable from here too:

* :mod:`kinetic_prefect.pod.data_sources`: checking a source (a gs:// URL, a local path's files); :class:`DataError`;
* :mod:`kinetic_prefect.pod.data_manifest`: content hashing (:class:`Manifest`);
* :mod:`kinetic_prefect.pod.data_upload`: the caller's upload into the store (:func:`upload`);
* :mod:`kinetic_prefect.pod.data_localize`: the job's local path for each ``DataRef`` (:func:`localize`);
* :mod:`kinetic_prefect.pod.data_walk`: finding, replacing them in the arguments (:func:`find`, :func:`transform`).

The job runner imports this module, so only the stdlib and the storage leaf are imported here (and in those
modules) at module level.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from pathlib import Path

from kinetic_prefect.contract import data_key
from kinetic_prefect.pod.data_localize import localize
from kinetic_prefect.pod.data_manifest import Manifest, build_manifest
from kinetic_prefect.pod.data_sources import DataError, parse_gs_url, validate_local
from kinetic_prefect.pod.data_upload import upload
from kinetic_prefect.pod.data_walk import find, transform

__all__ = [
    "Data",
    "DataError",
    "DataRef",
    "Manifest",
    "find",
    "hash_local",
    "localize",
    "to_ref",
    "transform",
    "upload",
]


class Data:
    """A local file or directory, or gs://bucket/object or gs://bucket/prefix/ — passed to a kinetic task.

    Local data is validated here (it exists, holds at least one file, every file is readable) and content-hashed
    and uploaded once per content when the task is called; gs:// data is never copied through the store, the job
    downloads it itself (and nothing is checked here: no network at construction).
    """

    __slots__ = ("source", "is_remote", "local_path")

    def __init__(self, source: str | os.PathLike):
        if isinstance(source, Data):
            source = source.source
        try:
            text = os.fspath(source)
        except TypeError:
            raise DataError(f"Data() takes a path or a gs:// URL, not {type(source).__name__} {source!r}") from None
        if isinstance(text, bytes):
            text = os.fsdecode(text)
        if not text:
            raise DataError("Data('') names no data: pass a file, a directory or a gs://bucket/... URL")
        self.source: str = text
        self.is_remote: bool = text.startswith("gs://")
        self.local_path: Path | None = None
        if self.is_remote:
            parse_gs_url(text)
            return
        if text.startswith("file://"):
            parsed = urllib.parse.urlsplit(text)
            if parsed.netloc not in ("", "localhost") or not parsed.path:
                raise DataError(f"unsupported file URL {text!r}: use file:///absolute/path or a plain path")
            text = urllib.parse.unquote(parsed.path)
        elif "://" in text:
            raise DataError(
                f"unsupported data source {text!r}: use a local path or gs://bucket/object "
                "(gs://bucket/prefix/ for a folder); other schemes are not supported"
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
        return f"Data({self.source!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Data) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (self.is_remote, self.source if self.is_remote else str(self.local_path))

    def __getstate__(self):
        return {"source": self.source, "is_remote": self.is_remote, "local_path": self.local_path}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class DataRef:
    """What is pickled into the payload instead of Data; resolved to a local path on the job side.

    For gs:// data ``kind`` is what the URL says ("dir" for a trailing slash or a bare bucket, else "file");
    :func:`localize` treats a "file" URL that names no object as a prefix.
    """

    kind: str  # "file" | "dir"
    name: str  # basename of the source (file name, or directory name)
    sha256: str | None  # content hash for local data (None for gs://)
    key: str | None  # store-relative prefix of uploaded local data: f"data/{sha256}"
    url: str | None  # gs:// source, never copied


def hash_local(data: Data, *, workers: int = 8) -> Manifest:
    """The content manifest of local data (validating it again: it may have changed since ``Data()``)."""
    if data.is_remote or data.local_path is None:
        raise DataError(f"{data!r} is gs:// data: it is not hashed or uploaded, the job downloads it directly")
    return build_manifest(data.local_path, workers=workers, memo=True)


def to_ref(data: Data, manifest: Manifest | None) -> DataRef:
    if data.is_remote:
        bucket, path = parse_gs_url(data.source)
        name = path.rstrip("/").rsplit("/", 1)[-1] if path.strip("/") else bucket
        kind = "file" if path and not path.endswith("/") else "dir"
        return DataRef(kind=kind, name=name, sha256=None, key=None, url=data.source)
    if manifest is None:
        manifest = hash_local(data)
    elif manifest.root != data.local_path:
        raise ValueError(f"manifest of {manifest.root} passed with {data!r}: hash_local(data) makes the right one")
    assert data.local_path is not None  # not remote
    return DataRef(
        kind=manifest.kind, name=data.local_path.name, sha256=manifest.sha256, key=data_key(manifest.sha256), url=None
    )
