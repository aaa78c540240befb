"""The content of local data: a :class:`Manifest` lists every file (relative posix path, size, sha256) and combines
them into one content hash, the address the data is stored under.

Both sides hash: the caller before it uploads, the job to check what it downloaded or reads in place. Each file's
sha256 is memoized by its stat within a process, so data hashed again costs a stat per file; big files go to a
thread pool from the start, small ones are hashed inline unless the first of them had to be read from disk.

The job runner imports this module (through :mod:`kinetic_prefect.pod.data`): the stdlib only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kinetic_prefect.pod.data_sources import DataError, check_store_name, unreadable_error, walk_files

_FORMAT = 1
_READ_CHUNK = 1 << 20
_BIG_FILE = 256 << 10  # hashed on the thread pool from the start (hashlib and read() release the GIL)
_PROBE_FILES = 256  # small files hashed inline before deciding whether the disk is slow enough for threads
_SLOW_FILE_S = 150e-6  # a page-cached small file hashes in ~6 us (~30 us on a busy machine); slower: I/O waits
_SMALL_BATCH = 64  # small files per thread-pool task
_MEMO_MAX = 2_000_000


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The content of local data: sorted (relative posix path, size, sha256) entries and their combined hash.

    For a file the one entry's path is the file's name. ``sha256`` depends on the kind, the relative paths and
    the bytes only: not on mtimes, permissions or where the data lies.
    """

    root: Path
    sha256: str
    files: tuple[tuple[str, int, str], ...]
    total_bytes: int
    is_dir: bool = True
    # (size, mtime_ns) per entry when hashed: upload() checks nothing changed before it marks the upload complete
    stats_when_hashed: tuple[tuple[int, int], ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def kind(self) -> str:
        return "dir" if self.is_dir else "file"

    def path_of(self, rel: str) -> Path:
        return self.root.joinpath(*rel.split("/")) if self.is_dir else self.root

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _FORMAT,
                "kind": self.kind,
                "sha256": self.sha256,
                "name": self.root.name,
                "total_bytes": self.total_bytes,
                "files": [list(entry) for entry in self.files],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes, root: Path) -> Manifest:
        doc = json.loads(text)
        files = tuple((rel, int(size), sha) for rel, size, sha in doc["files"])
        return cls(
            root=Path(root),
            sha256=doc["sha256"],
            files=files,
            total_bytes=int(doc["total_bytes"]),
            is_dir=doc["kind"] == "dir",
        )


def _content_hash(kind: str, files: tuple[tuple[str, int, str], ...]) -> str:
    body = json.dumps({"format": _FORMAT, "kind": kind, "files": files}, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(body.encode("ascii")).hexdigest()


# (abs path, size, mtime_ns, ctime_ns, inode) -> file sha256. ctime and inode catch edits that restore the mtime
# and files replaced by rename; they only ever cause a re-hash.
_memo: dict[tuple[str, int, int, int, int], str] = {}
_memo_lock = threading.Lock()


def _memo_key(path: str, st: os.stat_result) -> tuple[str, int, int, int, int]:
    return (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _hash_file(path: str, size: int) -> tuple[int, str]:
    """(bytes read, sha256 hex) of one file; two read() calls for a small file. Raises DataError if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise unreadable_error(path, exc) from exc
    try:
        want = min(size + 1, _READ_CHUNK)  # size + 1: a short read proves EOF without a third syscall
        chunk = os.read(fd, want)
        digest = hashlib.sha256(chunk)
        total = len(chunk)
        if len(chunk) == want:
            while chunk := os.read(fd, _READ_CHUNK):
                digest.update(chunk)
                total += len(chunk)
        return total, digest.hexdigest()
    except OSError as exc:
        raise unreadable_error(path, exc) from exc
    finally:
        os.close(fd)


def file_sha256(path: str, st: os.stat_result) -> str:
    """The sha256 of the file at ``path`` (``st``: its stat now): remembered while its stat is unchanged, else
    read and remembered. DataError when it cannot be read."""
    key = _memo_key(path, st)
    sha = _memo.get(key)
    if sha is None:
        _read, sha = _hash_file(path, st.st_size)
        with _memo_lock:
            _memo[key] = sha
    return sha


def forget_hashes() -> None:
    """Forget every remembered hash: the next manifest reads each file again, as a new process would."""
    with _memo_lock:
        _memo.clear()


def _blocks_read() -> int:
    """Blocks this thread has read from storage (Linux: page-cache misses); 0 where unknown."""
    try:
        import resource

        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_inblock
    except (ImportError, OSError, ValueError):
        return 0


def _hash_batch(jobs: list[tuple[int, str, int]]) -> list[tuple[int, int, str]]:
    return [(index, *_hash_file(path, size)) for index, path, size in jobs]


def build_manifest(root: Path, *, workers: int, memo: bool) -> Manifest:
    is_dir, listing = _list_files(root)
    n = len(listing)
    rels: list[str] = [rel for rel, _p, _e in listing]
    paths: list[str] = [p for _r, p, _e in listing]
    stats = _stat_files(listing)
    sizes: list[int] = [st.st_size for st in stats]
    shas: list[str | None] = [None] * n
    keys = [_memo_key(p, st) for p, st in zip(paths, stats)] if memo else None

    todo_small: list[tuple[int, str, int]] = []
    todo_big: list[tuple[int, str, int]] = []
    for i in range(n):
        if keys is not None and (cached := _memo.get(keys[i])) is not None:
            shas[i] = cached
        elif sizes[i] >= _BIG_FILE:
            todo_big.append((i, paths[i], sizes[i]))
        else:
            todo_small.append((i, paths[i], sizes[i]))

    def record(results: list[tuple[int, int, str]]) -> None:
        for index, size_read, sha in results:
            if size_read != sizes[index]:
                raise DataError(
                    f"data file {paths[index]} changed while it was being hashed ({sizes[index]} "
                    f"bytes when listed, {size_read} read): retry once it is no longer being written"
                )
            shas[index] = sha

    _hash_files(todo_small, todo_big, workers, record)
    if keys is not None:
        _remember(keys, shas)
    files = tuple(zip(rels, sizes, shas))
    kind = "dir" if is_dir else "file"
    assert all(sha is not None for sha in shas)
    hashed: tuple[tuple[str, int, str], ...] = files  # type: ignore[assignment]  # checked just above
    return Manifest(
        root=root,
        sha256=_content_hash(kind, hashed),
        files=hashed,
        total_bytes=sum(sizes),
        is_dir=is_dir,
        stats_when_hashed=tuple((st.st_size, st.st_mtime_ns) for st in stats),
    )


def _list_files(root: Path) -> tuple[bool, list[tuple[str, str, os.DirEntry[str] | None]]]:
    """(is a directory, its (relative posix path, path, DirEntry or None) entries sorted by relative path)."""
    if not os.path.exists(root):
        raise DataError(f"data path {root} no longer exists: it was moved or deleted after Data() was created")
    is_dir = os.path.isdir(root)
    listing: list[tuple[str, str, os.DirEntry[str] | None]]
    if is_dir:
        listing = sorted(walk_files(root), key=lambda item: item[0])
    else:
        check_store_name(root.name, str(root))
        listing = [(root.name, str(root), None)]  # no DirEntry for a lone file
    if is_dir and not listing:
        raise DataError(
            f"data directory {root} is empty (no files at any depth): put the data in it or pass the "
            "directory that holds it"
        )
    return is_dir, listing


def _stat_files(listing: list[tuple[str, str, os.DirEntry[str] | None]]) -> list[os.stat_result]:
    """Each entry's stat (from its DirEntry where the walk made one); anything but a regular file fails."""
    stats: list[os.stat_result] = []
    for _rel, path, entry in listing:
        try:
            stats.append(entry.stat() if entry is not None else os.stat(path))
        except OSError as exc:
            raise unreadable_error(path, exc) from exc
        if not stat.S_ISREG(stats[-1].st_mode):
            raise DataError(f"data path {path} is not a regular file: pass a file or a directory of files")
    return stats


def _hash_files(
    todo_small: list[tuple[int, str, int]],
    todo_big: list[tuple[int, str, int]],
    workers: int,
    record: Callable[[list[tuple[int, int, str]]], None],
) -> None:
    """Hash the (index, path, size) jobs, handing each batch of results to ``record``: big files on a thread
    pool from the start, small ones inline unless the first of them had to be read from disk."""
    pool = None
    futures: list[concurrent.futures.Future[list[tuple[int, int, str]]]] = []
    try:
        if todo_big or len(todo_small) > _PROBE_FILES:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kinetic-hash")
        if pool is not None:
            futures += [pool.submit(_hash_batch, [job]) for job in todo_big]
        # Small files: inline is fastest while the page cache serves them (threads only add GIL hand-offs); if the
        # first ones had to be read from disk, the rest go to the pool, where the reads overlap.
        start, blocks = time.perf_counter(), _blocks_read()
        probe = todo_small[:_PROBE_FILES] if pool is not None else todo_small
        record(_hash_batch(probe))
        rest = todo_small[len(probe) :]
        if rest:
            per_file = (time.perf_counter() - start) / max(1, len(probe))
            if (_blocks_read() > blocks or per_file > _SLOW_FILE_S) and workers > 1:
                assert pool is not None  # made above whenever there are more than _PROBE_FILES
                futures += [
                    pool.submit(_hash_batch, rest[i : i + _SMALL_BATCH]) for i in range(0, len(rest), _SMALL_BATCH)
                ]
            else:
                record(_hash_batch(rest))
        for future in futures:
            record(future.result())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _remember(keys: list[tuple[str, int, int, int, int]], shas: list[str | None]) -> None:
    with _memo_lock:
        if len(_memo) + len(keys) > _MEMO_MAX:
            _memo.clear()
        for key, sha in zip(keys, shas):
            _memo[key] = sha  # type: ignore[assignment]  # every file is hashed by now
