"""Caller side, a call's inputs into the store: the project archive (content-addressed, checked once per process),
each local Data argument (with its progress) and the signed payload.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import uuid
from typing import Any

from prefect import get_client

from kinetic_prefect import signing
from kinetic_prefect.caller.calls import PreparedCall
from kinetic_prefect.caller.data_repair import heal_before_call
from kinetic_prefect.caller.project_archive import sha256_hex
from kinetic_prefect.contract import PHASE_RESTORE_CODE, Outcome
from kinetic_prefect.errors import StoreFull
from kinetic_prefect.pod import data

# Content-addressed objects this process has checked in each store: checked once, trusted after; a local one while
# its file keeps the size, mtime and inode it had when checked (its stat, else None).
_verified_objects: dict[tuple[str, str], tuple[int, int, int] | None] = {}


def _local_stat(store: Any, key: str) -> tuple[int, int, int] | None:
    path = store.local_path(key)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _ensure_content_addressed(store: Any, key: str, blob: bytes, sha256: str) -> None:
    """Upload ``blob`` under ``key`` unless the store already has exactly it.

    An object that exists but fails its check (a torn copy, a disk error, someone's edit) is
    replaced, instead of failing every later call on the job side.
    """
    from kinetic_prefect.storage import ObjectNotFound

    marker = (store.url_for(key), key)
    # A remote object is checked once per process (and dropped from trust when a job reports it broken, see
    # forget_broken_code); a local one again whenever its file's stat changed (an edit, a replacement).
    if marker in _verified_objects and _verified_objects[marker] == _local_stat(store, key):
        return
    try:
        stored = store.get_bytes(key)
    except ObjectNotFound:
        stored = None
    if stored is None:
        store.put_bytes(key, blob, if_absent=True)
    elif sha256_hex(stored) != sha256:
        store.put_bytes(key, blob)
    _verified_objects[marker] = _local_stat(store, key)


def forget_broken_code(store: Any, call: PreparedCall, outcome: Outcome) -> None:
    """The job could not verify or unpack the project archive: delete it so the next call (or
    this task's retry) uploads a good copy instead of failing the same way forever."""
    if call.code_archive is None or outcome.user_error or outcome.phase != PHASE_RESTORE_CODE:
        return
    _verified_objects.pop((store.url_for(call.code_archive.key), call.code_archive.key), None)
    with contextlib.suppress(Exception):
        store.delete(call.code_archive.key)


class UploadProgress:
    """Progress of one Data upload: a bar in the terminal (when stderr is one) and a Prefect progress
    artifact on the task run, updated at most once a second (called from the uploading threads)."""

    def __init__(self, name: str, total_bytes: int, task_run_id: str | None):
        import threading

        self.name, self.total, self.task_run_id = name, max(1, total_bytes), task_run_id
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._artifact_id: Any = None
        self._tty = sys.stderr.isatty()

    def __call__(self, size: int) -> None:
        import time

        with self._lock:
            self.done += size
            now = time.monotonic()
            if now - self._last < 1.0 and self.done < self.total:
                return
            self._last = now
            self.show()

    def show(self) -> None:
        percent = 100.0 * min(self.done, self.total) / self.total
        text = f"Data {self.name}: {self.done / 2**20:.1f} of {self.total / 2**20:.1f} MiB uploaded"
        if self._tty:
            bar = "#" * int(percent / 4)
            print(
                f"\r[{bar:<25}] {percent:5.1f}% {text}",
                end="\n" if self.done >= self.total else "",
                file=sys.stderr,
                flush=True,
            )
        if self.task_run_id is None:
            return
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        try:
            with get_client(sync_client=True) as client:
                if self._artifact_id is None:
                    self._artifact_id = client.create_artifact(
                        ArtifactCreate(
                            type="progress", data=percent, description=text, task_run_id=uuid.UUID(self.task_run_id)
                        )
                    ).id
                else:
                    client.update_artifact(self._artifact_id, ArtifactUpdate(data=percent, description=text))
        except Exception:  # progress never fails an upload
            pass


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _room_for(store: Any, what: str, object_key: str | None, size: int, fix: str) -> Any:
    """A store with no room (ENOSPC, a quota) for an input raises ``StoreFull``, naming the store and the object,
    which Prefect does not retry (a retry meets the same full store), as the job side does for its result."""
    try:
        yield
    except StoreFull:
        raise
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        where = store.url_for(object_key) if object_key else store.url
        raise StoreFull(
            f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror}) while uploading {what} "
            f"({size / 2**20:.1f} MiB) to {where}: the store {store.url} is full. Free space there, or {fix}; "
            "nothing was launched"
        ) from exc


def upload_inputs(store: Any, call: PreparedCall, logger: Any, key: signing.KeyLike = None) -> None:
    if (archive := call.code_archive) is not None:
        fix = "ship less of the project (ship_project=False, or leave large files out of it)"
        with _room_for(store, "the project archive", archive.key, len(archive.data), fix):
            _ensure_content_addressed(store, archive.key, archive.data, archive.sha256)
    for manifest in call.data:
        total = sum(size for _rel, size, _sha in manifest.files)
        with _room_for(store, f"Data {manifest.root.name}", None, total, "point the pool's `store` at one with room"):
            uploaded = data.upload(
                manifest,
                store,
                key=key,
                heal=heal_before_call,
                on_file=UploadProgress(manifest.root.name, total, call.task_run_id),
            )
        if logger:
            logger.info(
                f"Data {manifest.root.name} ({len(manifest.files)} files, sha256 {manifest.sha256[:12]}): "
                + (f"uploaded {uploaded / 2**20:.1f} MiB" if uploaded else "already in the store")
            )
    fix = "send less: a large argument travels better as Data(...) (uploaded once, not with every call)"
    with _room_for(
        store, "the call's payload (its function and arguments)", call.layout.payload, len(call.payload), fix
    ):
        signing.put(store, call.layout.payload, call.payload, key)
