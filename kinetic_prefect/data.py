"""Datasets as arguments of a kinetic task: ``Data("./eurosat")`` or ``Data("gs://bucket/prefix/")``.

The caller side turns every :class:`Data` found in a call's arguments into a :class:`DataRef` (what is pickled
into the payload), after :func:`hash_local` and :func:`upload` have put local data into the artifact store under a
content address; the job side turns each ``DataRef`` back into a local path with :func:`localize`.

Store layout of local data (``sha`` is the content hash of the manifest)::

    data/<sha>/files/<relative path>     the files (a single file: data/<sha>/files/<its name>)
    data/<sha>/manifest.json             written last, first-writer-wins: its presence means "complete"

Node cache layout (``<id>`` is the content hash, or sha256 of the URL for gs:// data)::

    <node_cache>/data/<id>/files/...     what localize() returns (the directory, or files/<name> for a file)
    <node_cache>/data/<id>/complete.json the marker; the whole <id> directory appears by one atomic rename

The job runner imports this module, so only the stdlib and the storage leaf are imported here at module level.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kinetic_prefect.contract import data_key
from kinetic_prefect.storage import ObjectNotFound, Store, open_store

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

_FORMAT = 1
_READ_CHUNK = 1 << 20
_BIG_FILE = 256 << 10  # hashed on the thread pool from the start (hashlib and read() release the GIL)
_PROBE_FILES = 256  # small files hashed inline before deciding whether the disk is slow enough for threads
_SLOW_FILE_S = 150e-6  # a page-cached small file hashes in ~6 us (~30 us on a busy machine); slower: I/O waits
_SMALL_BATCH = 64  # small files per thread-pool task
_MEMO_MAX = 2_000_000


class DataError(ValueError):
    """A dataset argument that cannot be used; the message names the path or URL and the fix."""


# ---------------------------------------------------------------------------------------------------------------
# Data: the user-facing argument
# ---------------------------------------------------------------------------------------------------------------


def _parse_gs(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` → ("bucket", "a/b"); ``gs://bucket/a/`` → ("bucket", "a/"); bucket only → ("bucket", "")."""
    parsed = urllib.parse.urlsplit(url)
    bucket, path = parsed.netloc, parsed.path.lstrip("/")
    if parsed.scheme != "gs" or not bucket or parsed.query or parsed.fragment:
        raise DataError(f"invalid data URL {url!r}: use gs://bucket/object or gs://bucket/prefix/")
    if any(part in (".", "..") for part in path.split("/")) or "//" in path or "\\" in path:
        raise DataError(
            f"invalid data URL {url!r}: empty, '.' and '..' segments and backslashes are not "
            "supported in the object path; name the object or prefix exactly"
        )
    return bucket, path


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
            _parse_gs(text)
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
        _validate(self.local_path)

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


def _unreadable(path: Path | str, exc: BaseException | None = None) -> DataError:
    why = f" ({exc.strerror or exc})" if isinstance(exc, OSError) else ""
    return DataError(
        f"data file {path} is not readable{why}: fix its permissions (chmod a+r) or move it out of the data directory"
    )


def _check_file(path: str) -> None:
    if not os.access(path, os.R_OK):
        raise _unreadable(path, PermissionError(13, "permission denied"))


def _check_rel(rel: str, path: str) -> None:
    """Every relative path becomes a store key / GCS object name."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(
            f"data file {path!r} has a name that is not valid UTF-8: rename it (object stores keep UTF-8 names only)"
        ) from None
    if "\\" in rel or "\n" in rel or "\r" in rel:
        raise DataError(
            f"data file {path!r} has a backslash or a line break in its name: rename it "
            "(object stores cannot keep such names)"
        )


def _walk(root: Path) -> Iterator[tuple[str, str, os.DirEntry]]:
    """Every file under ``root`` as (relative posix path, path, entry), following symlinks; raises DataError for
    broken links, special files, unreadable directories and symlink loops."""
    try:
        top = os.stat(root)
    except OSError as exc:
        raise _unreadable(root, exc) from exc
    stack: list[tuple[str, str, frozenset]] = [(str(root), "", frozenset({(top.st_dev, top.st_ino)}))]
    while stack:
        dir_path, rel_dir, ancestors = stack.pop()
        try:
            with os.scandir(dir_path) as it:
                entries = list(it)
        except OSError as exc:
            raise DataError(
                f"data directory {dir_path} cannot be listed ({exc.strerror or exc}): fix its "
                "permissions (chmod a+rx) or move it out of the data directory"
            ) from exc
        for entry in entries:
            rel = rel_dir + entry.name
            try:
                is_dir = entry.is_dir()  # follows symlinks
                is_file = not is_dir and entry.is_file()
            except OSError as exc:
                raise _unreadable(entry.path, exc) from exc
            if is_dir:
                try:
                    st = entry.stat()
                except OSError as exc:
                    raise _unreadable(entry.path, exc) from exc
                ident = (st.st_dev, st.st_ino)
                if ident in ancestors:
                    raise DataError(
                        f"data directory {entry.path} is a symlink loop (it links to one of its "
                        "parents): remove the link or pass a directory without loops"
                    )
                stack.append((entry.path, rel + "/", ancestors | {ident}))
            elif is_file:
                _check_rel(rel, entry.path)
                yield rel, entry.path, entry
            elif entry.is_symlink():
                raise DataError(
                    f"data file {entry.path} is a broken symbolic link (its target "
                    f"{_readlink(entry.path)!r} does not exist): fix or remove the link"
                )
            else:
                raise DataError(
                    f"data path {entry.path} is not a regular file (a fifo, socket or device): "
                    "move it out of the data directory"
                )


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _validate(path: Path) -> None:
    if not os.path.exists(path):
        if os.path.islink(path):
            raise DataError(
                f"data path {path} is a broken symbolic link (its target {_readlink(str(path))!r} "
                "does not exist): fix the link or pass the real path"
            )
        raise DataError(
            f"data path {path} does not exist: check the path (relative paths are resolved against "
            f"the working directory {os.getcwd()})"
        )
    if os.path.isdir(path):
        found = False
        for _rel, file_path, _entry in _walk(path):
            _check_file(file_path)
            found = True
        if not found:
            raise DataError(
                f"data directory {path} is empty (no files at any depth): put the data in it or pass "
                "the directory that holds it"
            )
        return
    if not os.path.isfile(path):
        raise DataError(
            f"data path {path} is not a regular file or directory (a fifo, socket or device): "
            "pass a file or a directory"
        )
    _check_rel(path.name, str(path))
    _check_file(str(path))
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _unreadable(path, exc) from exc


# ---------------------------------------------------------------------------------------------------------------
# Content hashing
# ---------------------------------------------------------------------------------------------------------------


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
    _stats: tuple[tuple[int, int], ...] = dataclasses.field(default=(), compare=False, repr=False)

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
        raise _unreadable(path, exc) from exc
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
        raise _unreadable(path, exc) from exc
    finally:
        os.close(fd)


def _blocks_read() -> int:
    """Blocks this thread has read from storage (Linux: page-cache misses); 0 where unknown."""
    try:
        import resource

        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_inblock
    except (ImportError, OSError, ValueError):
        return 0


def _hash_batch(jobs: list[tuple[int, str, int]]) -> list[tuple[int, int, str]]:
    return [(index, *_hash_file(path, size)) for index, path, size in jobs]


def _build_manifest(root: Path, *, workers: int, memo: bool) -> Manifest:
    if not os.path.exists(root):
        raise DataError(f"data path {root} no longer exists: it was moved or deleted after Data() was created")
    is_dir = os.path.isdir(root)
    if is_dir:
        listing = sorted(_walk(root), key=lambda item: item[0])
    else:
        _check_rel(root.name, str(root))
        listing = [(root.name, str(root), None)]  # type: ignore[list-item]  # no DirEntry for a lone file

    n = len(listing)
    if is_dir and n == 0:
        raise DataError(
            f"data directory {root} is empty (no files at any depth): put the data in it or pass the "
            "directory that holds it"
        )
    rels: list[str] = [rel for rel, _p, _e in listing]
    paths: list[str] = [p for _r, p, _e in listing]
    stats: list[os.stat_result] = []
    for _rel, path, entry in listing:
        try:
            stats.append(entry.stat() if entry is not None else os.stat(path))
        except OSError as exc:
            raise _unreadable(path, exc) from exc
        if not stat.S_ISREG(stats[-1].st_mode):
            raise DataError(f"data path {path} is not a regular file: pass a file or a directory of files")
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

    pool = None
    futures: list[concurrent.futures.Future] = []
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

    if keys is not None:
        with _memo_lock:
            if len(_memo) + n > _MEMO_MAX:
                _memo.clear()
            for key, sha in zip(keys, shas):
                _memo[key] = sha  # type: ignore[assignment]  # every file is hashed by now
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
        _stats=tuple((st.st_size, st.st_mtime_ns) for st in stats),
    )


def hash_local(data: Data, *, workers: int = 8) -> Manifest:
    """The content manifest of local data (validating it again: it may have changed since ``Data()``)."""
    if data.is_remote or data.local_path is None:
        raise DataError(f"{data!r} is gs:// data: it is not hashed or uploaded, the job downloads it directly")
    return _build_manifest(data.local_path, workers=workers, memo=True)


def to_ref(data: Data, manifest: Manifest | None) -> DataRef:
    if data.is_remote:
        bucket, path = _parse_gs(data.source)
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


# ---------------------------------------------------------------------------------------------------------------
# Upload (caller side)
# ---------------------------------------------------------------------------------------------------------------


def upload(
    manifest: Manifest,
    store: Store,
    *,
    workers: int = 32,
    key: bytes | None = None,
    on_file: Callable[[int], None] | None = None,
    heal: Callable[[Manifest, Store, Callable[[int], None] | None], int] | None = None,
) -> int:
    """Put the data into ``store`` under ``data/<sha>/``; returns the bytes uploaded (0 if it is already there).
    ``heal`` (the caller's ``data_repair.heal_before_call``) checks a stored copy and puts back damaged files."""
    prefix = data_key(manifest.sha256)
    marker = f"{prefix}/manifest.json"
    if store.exists(marker):  # already there; a damaged file of it is put back from this copy
        return heal(manifest, store, on_file) if heal is not None else 0
    pairs = [(rel, manifest.path_of(rel)) for rel, _size, _sha in manifest.files]
    uploaded = store.put_tree(f"{prefix}/files", pairs, workers=workers, on_file=on_file)
    if manifest._stats:  # a file rewritten after hashing would sit under the wrong content address
        for (rel, _size, _sha), (size, mtime_ns) in zip(manifest.files, manifest._stats):
            path = manifest.path_of(rel)
            try:
                st = os.stat(path)
            except OSError as exc:
                raise _unreadable(path, exc) from exc
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                raise DataError(
                    f"data file {path} changed between hashing and upload: call the task again once "
                    "it is no longer being written"
                )
    from kinetic_prefect import signing

    signing.put(store, marker, manifest.to_json().encode(), key, if_absent=True)
    return uploaded


# ---------------------------------------------------------------------------------------------------------------
# Localize (job side)
# ---------------------------------------------------------------------------------------------------------------

_COMPLETE = "complete.json"


def _node_entry(node_cache: Path, ident: str, fill: Callable[[Path], dict]) -> Path:
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
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(keys))) as pool:
        for future in [pool.submit(fetch, key) for key in keys]:
            future.result()


def _localize_uploaded(ref: DataRef, store: Store, node_cache: Path, key: bytes | None = None) -> Path:
    from kinetic_prefect import signing

    if ref.key is None or ref.sha256 is None:
        raise DataError(f"data {ref.name} was not uploaded (no store key): pass it again from the caller")
    marker = f"{ref.key}/manifest.json"
    local = store.local_path(f"{ref.key}/files")
    if local is not None:  # the store is a directory on this machine: read the data in place
        if not store.exists(marker):
            raise _not_uploaded(ref, store)
        if key is not None:  # authenticated stores: the data read in place must be what was signed
            signing.get(store, marker, key)
            got = _build_manifest(local / ref.name if ref.kind == "file" else local, workers=8, memo=True)
            if got.sha256 != ref.sha256:
                raise DataError(
                    f"data {ref.name} in {store.url_for(ref.key)} does not match its content hash "
                    f"{ref.sha256}: it was changed in the store; refusing to use it. The caller puts "
                    "the damaged files back from its own copy before the next call; without that copy, "
                    f"delete {store.url_for(ref.key)}/ and call with the data again"
                )
        return local / ref.name if ref.kind == "file" else local

    prefix = ref.key

    def fill(staging: Path) -> dict:
        try:
            manifest = Manifest.from_json(signing.get(store, marker, key), staging / "files")
        except ObjectNotFound:
            raise _not_uploaded(ref, store) from None
        store.get_tree(f"{ref.key}/files", staging / "files")
        root = staging / "files" / ref.name if ref.kind == "file" else staging / "files"
        got = _build_manifest(root, workers=8, memo=False) if root.exists() else None
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
    return DataError(
        f"data {ref.name} ({ref.sha256}) is not in the store {store.url}: "
        f"{store.url_for(f'{ref.key}/manifest.json')} is missing; the caller uploads it before "
        "launching the job, so check that the job uses the caller's store"
    )


def _localize_url(ref: DataRef, node_cache: Path) -> Path:
    url = ref.url
    if url is None:
        raise DataError(f"data {ref.name} names no URL: pass Data('gs://...') from the caller")
    bucket, path = _parse_gs(url)
    ident = hashlib.sha256(url.encode()).hexdigest()
    kind_box: list[str] = []

    def fill(staging: Path) -> dict:
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
    if kind_box:
        kind = kind_box[0]
    else:
        kind = json.loads((target / _COMPLETE).read_text()).get("kind", "dir")
    return target / "files" / ref.name if kind == "file" else target / "files"


def localize(ref: DataRef, store: Store, node_cache: Path, key: bytes | None = None) -> Path:
    """Job side: a local path to the file or directory ``ref`` stands for (downloaded at most once per node).

    Uploaded data is read in place from a local store, else downloaded into ``node_cache`` and checked against
    its content hash. gs:// data is cached per URL: an object rewritten later under the same URL is not fetched
    again on a node that already holds it (point Data at a new URL, e.g. a versioned prefix, to change data).
    """
    if ref.url is not None:
        return _localize_url(ref, Path(node_cache))
    if not ref.key or not ref.sha256:
        raise DataError(f"{ref!r} has neither a gs:// URL nor a store key: it was not made by to_ref()")
    return _localize_uploaded(ref, store, Path(node_cache), key)


# ---------------------------------------------------------------------------------------------------------------
# Walking call arguments
# ---------------------------------------------------------------------------------------------------------------

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, Path)


def _walker(fn: Callable[[Any], Any] | None, match: type | tuple[type, ...], found: list | None) -> Callable:
    memo: dict[int, Any] = {}
    active: set[int] = set()
    keep: list = []  # keeps walked objects alive, so their ids are not reused during the walk

    def visit(obj: Any) -> Any:
        if isinstance(obj, match):
            oid = id(obj)
            if oid in memo:
                return memo[oid]
            if found is not None:
                found.append(obj)
            new = fn(obj) if fn is not None else obj
            memo[oid] = new
            keep.append(obj)
            return new
        if isinstance(obj, _ATOMS) or isinstance(obj, type):
            return obj
        oid = id(obj)
        if oid in memo:
            return memo[oid]
        if oid in active:  # a cycle: leave the inner reference as it is
            return obj
        active.add(oid)
        try:
            new = _rebuild(obj, visit)
        finally:
            active.discard(oid)
        memo[oid] = new
        keep.append(obj)
        return new

    return visit


def _rebuild(obj: Any, visit: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
        new_items = [visit(item) for item in items]
        if all(a is b for a, b in zip(items, new_items)):
            return obj
        cls = type(obj)
        if cls in (list, tuple, set, frozenset):
            return cls(new_items)
        if isinstance(obj, tuple):
            if hasattr(cls, "_make"):  # namedtuple
                return cls._make(new_items)
            return cls(new_items)
        new: Any = copy.copy(obj)  # list/set subclasses: keep the class and its attributes
        if isinstance(obj, list):
            new[:] = new_items
            return new
        if isinstance(obj, set):
            new.clear()
            new.update(new_items)
            return new
        return cls(new_items)
    if isinstance(obj, dict):
        changed = {}
        for key, value in obj.items():
            new_value = visit(value)
            if new_value is not value:
                changed[key] = new_value
        if not changed:
            return obj
        new = dict(obj) if type(obj) is dict else copy.copy(obj)  # OrderedDict, defaultdict, Counter keep type
        new.update(changed)
        return new
    if dataclasses.is_dataclass(obj):
        changed = {}
        for field in dataclasses.fields(obj):
            try:
                value = getattr(obj, field.name)
            except AttributeError:  # an init=False field never set
                continue
            new_value = visit(value)
            if new_value is not value:
                changed[field.name] = new_value
        if not changed:
            return obj
        # A shallow copy plus setattr rather than dataclasses.replace(): works for frozen classes and init=False
        # fields, and does not run __post_init__ again (which may insist on the type that was just replaced).
        new = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(new, name, value)
        return new
    return obj


def transform(obj: Any, fn: Callable[[Any], Any], match: type | tuple[type, ...]) -> Any:
    """``obj`` with every instance of ``match`` replaced by ``fn(instance)``, through lists, tuples (namedtuples
    too), dict values, sets, frozensets and dataclass instances. Containers that hold no match are returned as they
    are (same identity); other objects are left alone. ``fn`` is called once per distinct instance."""
    return _walker(fn, match, None)(obj)


def find(obj: Any, match: type | tuple[type, ...]) -> list:
    """Every distinct instance of ``match`` inside ``obj`` (the walk of :func:`transform`), in the order met."""
    found: list = []
    _walker(None, match, found)(obj)
    return found
