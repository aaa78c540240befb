"""What the payload carries in place of a :class:`~kinetic_prefect.pod.data.Data`: the caller makes it
(``data.to_ref``), the job turns it into a local path (``data_localize.localize``). Stdlib only."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataRef:
    """What is pickled into the payload instead of Data; resolved to a local path on the job side.

    For gs:// data ``kind`` is what the URL says ("dir" for a trailing slash or a bare bucket, else "file");
    :func:`localize` treats a "file" URL that names no object as a prefix. hf:// data is a "dir".

    ``fuse`` is the mount id of ``Data(..., fuse=True)`` (:func:`fuse_mount_id`): kinetic-gke mounts it at
    ``FUSE_MOUNT_ROOT/<id>``; ``path`` is the local source of local FUSE data (kinetic-local reads it in place).
    """

    kind: str  # "file" | "dir"
    name: str  # basename of the source (file name, or directory name)
    sha256: str | None  # content hash for local data (None for gs://)
    key: str | None  # store-relative prefix of uploaded local data: f"data/{sha256}"
    url: str | None  # gs:// or hf:// source, never copied through the store
    fuse: str | None = None  # Data(..., fuse=True): its mount id
    path: str | None = None  # local FUSE data: the caller's path (read in place on kinetic-local)
