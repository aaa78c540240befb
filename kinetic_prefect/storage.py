"""One object-store layer for payloads, results, the data cache and outputs.

The caller, the worker and the job runner all talk to storage through :func:`open_store`, so a run can move
between a local directory and a GCS bucket by changing one URL.

Guarantees every backend keeps:

* a reader sees a whole object or no object, never a partial one (local: temp file + fsync + rename;
  GCS: an upload only becomes visible once it is complete);
* ``if_absent=True`` writes are first-writer-wins: exactly one concurrent writer gets ``True``;
* keys are '/'-separated relative paths that cannot escape the store root;
* a ``prefix`` argument names a "directory": ``"runs/1"`` covers ``runs/1/...`` but not ``runs/10/...``.

Only the stdlib is imported here at module level: the job runner imports this module on start-up and the
google-cloud-storage import costs about a second, so it happens inside the GCS backend on first use.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import os
import pathlib
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import BinaryIO

__all__ = ["GCSStore", "LocalStore", "ObjectNotFound", "Store", "StoreError", "open_store"]

_TMP_PREFIX = ".kp-tmp."  # local temp files; list() never reports them
_COPY_BUFSIZE = 1 << 20
_GCS_CHUNK_SIZE = 16 << 20  # resumable-upload chunk: bounds memory per upload (default is 100 MB)
_GCS_MULTIPART_MAX = 8 << 20  # google-cloud-storage uploads bigger files as resumable uploads
_GCS_POOL_SIZE = 128  # HTTP connections kept per host; >= the put_tree/get_tree thread count
_GCS_LIST_PAGE_SIZE = 1000  # the server maximum; explicit so every server (emulators too) pages the same way


class StoreError(Exception):
    """Any storage failure."""


class ObjectNotFound(StoreError, KeyError):
    """The object does not exist. ``url`` is the full URL of the missing object."""

    def __init__(self, url: str):
        super().__init__(f"object not found: {url}")
        self.url = url

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid store key {key!r}: must be a non-empty string")
    if key.startswith("/") or "\\" in key or (len(key) > 1 and key[1] == ":"):
        raise ValueError(f"invalid store key {key!r}: must be a relative '/'-separated path")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: empty, '.' and '..' path segments are not allowed")
    return key


def _check_prefix(prefix: str) -> str:
    """Normalise a directory prefix to '' or 'a/b/' (validated like a key)."""
    if not isinstance(prefix, str):
        raise ValueError(f"invalid store prefix {prefix!r}: must be a string")
    prefix = prefix.removesuffix("/")
    return _check_key(prefix) + "/" if prefix else ""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


class Store(abc.ABC):
    url: str

    # --- primitives each backend implements -------------------------------------------------------------------
    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool: ...

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike, *, if_absent: bool = False) -> bool: ...

    @abc.abstractmethod
    def get_file(self, key: str, path: str | os.PathLike) -> None: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def child(self, prefix: str) -> Store: ...

    @abc.abstractmethod
    def url_for(self, key: str) -> str: ...

    def local_path(self, key: str) -> pathlib.Path | None:
        return None

    # --- bulk operations built on the primitives --------------------------------------------------------------
    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        _run_parallel(self.delete, keys, workers=32)
        return len(keys)

    def put_tree(
        self,
        prefix: str,
        files: Iterable[tuple[str, str | os.PathLike]],
        *,
        workers: int = 32,
        on_file: Callable[[int], None] | None = None,
    ) -> int:
        """Upload (relative_key, local_path) pairs under ``prefix`` in parallel; returns the bytes uploaded.
        ``on_file(size)`` is called after each file (from the uploading threads): progress reporting."""
        base = _check_prefix(prefix)
        jobs = [(base + _check_key(rel), os.fspath(path)) for rel, path in files]

        def upload(job: tuple[str, str]) -> int:
            size = os.path.getsize(job[1])
            self.put_file(job[0], job[1])
            if on_file is not None:
                on_file(size)
            return size

        return sum(_run_parallel(upload, jobs, workers=workers))

    def get_tree(self, prefix: str, dest_dir: str | os.PathLike, *, workers: int = 32) -> int:
        """Download everything under ``prefix`` into ``dest_dir`` (each file atomically); returns the file count."""
        base = _check_prefix(prefix)
        dest = pathlib.Path(dest_dir)
        keys = self.list(prefix)
        _run_parallel(
            lambda key: self.get_file(key, dest.joinpath(*key[len(base) :].split("/"))), keys, workers=workers
        )
        return len(keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.url == self.url

    def __hash__(self) -> int:
        return hash((type(self), self.url))


def _run_parallel(fn: Callable, items: Iterable, *, workers: int) -> list:
    items = list(items)
    if len(items) <= 1 or workers <= 1:
        return [fn(item) for item in items]
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=min(workers, len(items)), thread_name_prefix="kinetic-store"
    )
    try:
        return list(pool.map(fn, items))  # re-raises the first failure
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure, don't start the rest


# ---------------------------------------------------------------------------------------------------------------
# Local directory
# ---------------------------------------------------------------------------------------------------------------


def _open_object(path: pathlib.Path) -> BinaryIO:
    """The object's file, open for reading (the caller closes it); ObjectNotFound when there is none. Only the
    open is guarded: a missing folder while writing the copy is the copy's error, not a missing object."""
    try:
        return open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ObjectNotFound(str(path)) from None


# A local store is its owner's alone (issue 45, finding 9): whoever can write it can change the payloads, results and
# checkpoints a caller or job reads and runs, and whoever can read it reads every call's arguments and values. So its
# folders are made 0700 and its objects 0600 (one user's callers, workers, jobs and job environments all run as that
# user), and a root someone else owns is refused rather than adopted.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_COPY_FILE_MODE = 0o644  # get_file's copy outside the store: an ordinary file, as before


def make_private_dirs(path: pathlib.Path) -> None:
    """``path`` and its missing parents, each made owner-only (0700); folders that exist are left as they are."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent writer made it first
            folder.mkdir(mode=PRIVATE_DIR_MODE)


def check_owner(root: pathlib.Path) -> None:
    """Refuse a local store root this user does not own: its owner could swap any object in it."""
    if not hasattr(os, "geteuid"):
        return
    owner, me = root.stat().st_uid, os.geteuid()
    if owner == me:
        return
    from kinetic_prefect.contract import Env

    raise StoreError(
        f"local store {root} belongs to {_user_name(owner)} (uid {owner}), not to {_user_name(me)} (uid {me}): "
        "its owner can change the payloads, results and checkpoints read from it, so it is not used. Point the "
        f"store at a folder of your own ({Env.STORE}=/path/you/own, or the pool's `store`); if this folder is "
        f"yours, take it back: `sudo chown -R {_user_name(me)} {root}`"
    )


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"user #{uid}"


def _atomic_write(dest: pathlib.Path, write: Callable, *, if_absent: bool = False, private: bool = True) -> bool:
    """Write via a temp file in dest's directory, so the rename/link that publishes it is atomic. ``private``: an
    object of a local store (0600, its new folders 0700); else a copy out of the store (0644)."""
    for attempt in range(3):
        if private:
            make_private_dirs(dest.parent)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=dest.parent)
            break
        except FileNotFoundError:  # a concurrent delete_prefix pruned the directory; make it again
            if attempt == 2:
                raise
    published = False  # a replaced temp file is the object now: not removed
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if not private:  # mkstemp makes 0600, which a store object keeps
            os.chmod(tmp, _COPY_FILE_MODE)
        if if_absent:
            try:
                os.link(tmp, dest)  # fails if dest exists, unlike rename: that is the race arbiter
            except FileExistsError:
                return False
        else:
            os.replace(tmp, dest)
            published = True
        return True
    finally:
        if not published:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


class LocalStore(Store):
    """A directory on disk. ``url`` is the absolute directory path."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root).expanduser().resolve()
        make_private_dirs(self.root)
        check_owner(self.root)
        self.url = str(self.root)

    def __reduce__(self):
        return (LocalStore, (self.url,))

    def _path(self, key: str) -> pathlib.Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        return _atomic_write(self._path(key), lambda fh: fh.write(data), if_absent=if_absent)

    def put_file(self, key: str, path: str | os.PathLike, *, if_absent: bool = False) -> bool:
        dest = self._path(key)
        with open(path, "rb") as src:
            return _atomic_write(dest, lambda fh: shutil.copyfileobj(src, fh, _COPY_BUFSIZE), if_absent=if_absent)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(str(path)) from None

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        with _open_object(self._path(key)) as src:
            _atomic_write(pathlib.Path(path), lambda fh: shutil.copyfileobj(src, fh, _COPY_BUFSIZE), private=False)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = _check_prefix(prefix)
        top = self.root.joinpath(*base.split("/")[:-1]) if base else self.root
        keys = []
        for dirpath, _dirs, names in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in names:
                if not name.startswith(_TMP_PREFIX):
                    keys.append(name if rel_dir == "." else f"{rel_dir}/{name}")
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def delete_prefix(self, prefix: str) -> int:
        count = super().delete_prefix(prefix)
        base = _check_prefix(prefix)
        if base:  # drop the emptied directories too, but never the root; a busy one just stays
            top = self.root.joinpath(*base.split("/")[:-1])
            for dirpath, _dirs, _names in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        return count

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self._path(prefix.rstrip("/")))

    def local_path(self, key: str) -> pathlib.Path:
        """The object's file (it may not exist yet); read it in place instead of copying."""
        return self._path(key)

    def url_for(self, key: str) -> str:
        return str(self._path(key))


# ---------------------------------------------------------------------------------------------------------------
# Google Cloud Storage
# ---------------------------------------------------------------------------------------------------------------

_client_lock = threading.Lock()
_client_cache: dict[tuple, object] = {}


def _widen_connection_pool(client) -> None:
    """The default pool keeps 10 connections; put_tree's threads would otherwise open and drop
    connections per request, which dominates the time for thousands of small files."""
    import requests.adapters

    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=_GCS_POOL_SIZE)
    # google-cloud-storage takes a session only at construction (its ``_http``), not the pool size of the one it makes
    client._http.mount("https://", adapter)  # noqa: SLF001 - google-cloud-storage's session, no public pool setting
    client._http.mount("http://", adapter)  # noqa: SLF001 - google-cloud-storage's session, no public pool setting


def _gcs_client():
    """One client per process (and per emulator setting); its HTTP session is shared by all threads.

    Credentials: anonymous against an emulator (``STORAGE_EMULATOR_HOST``), else Application Default
    Credentials. A caller holding other credentials (a Prefect ``GcpCredentials`` block) passes its
    own client to :func:`open_store` instead.
    """
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    cache_key = (os.getpid(), emulator)  # after a fork the parent's sockets must not be reused
    with _client_lock:
        client = _client_cache.get(cache_key)
        if client is None:
            from google.cloud import storage  # type: ignore[attr-defined]

            try:
                if emulator:
                    # A fixed project and no credentials: no metadata-server or ADC lookup against an emulator.
                    from google.auth.credentials import AnonymousCredentials

                    client = storage.Client(project="test", credentials=AnonymousCredentials())
                else:
                    client = storage.Client()
            except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and friends
                raise StoreError(
                    f"cannot create a GCS client: {exc} "
                    "(run `gcloud auth application-default login` or set "
                    "GOOGLE_APPLICATION_CREDENTIALS)"
                ) from exc
            _widen_connection_pool(client)
            _client_cache[cache_key] = client
        return client


class GCSStore(Store):
    """``gs://bucket[/prefix]``.

    ``client``: a ``google.cloud.storage.Client`` to use instead of the process's default one (see
    :func:`_gcs_client`); it is not pickled: a copy in another process uses that process's default.
    """

    def __init__(self, url: str, client=None):
        parsed = urllib.parse.urlsplit(url)
        bucket, prefix = parsed.netloc, parsed.path.strip("/")
        if parsed.scheme != "gs" or not bucket or parsed.query or parsed.fragment:
            raise StoreError(f"not a GCS URL: {url!r} (expected gs://bucket[/prefix])")
        if prefix:
            _check_key(prefix)
        self.bucket_name, self.prefix = bucket, prefix
        self.url = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"
        if client is not None:
            _widen_connection_pool(client)
        self._client = client

    @property
    def client(self):
        return self._client if self._client is not None else _gcs_client()

    def __reduce__(self):
        return (GCSStore, (self.url,))

    def _name(self, key: str) -> str:
        return _join(self.prefix, _check_key(key))

    def _blob(self, key: str, *, upload: bool = False):
        # chunk_size only for uploads: on a download it would switch to ranged chunk requests, which skip
        # the whole-object checksum check (and trip fake-gcs-server on empty objects).
        return self.client.bucket(self.bucket_name).blob(
            self._name(key), chunk_size=_GCS_CHUNK_SIZE if upload else None
        )

    @contextlib.contextmanager
    def _errors(self, key: str, *, reading: bool):
        from google.api_core import exceptions as gexc

        url = self.url_for(key)
        try:
            yield
        except gexc.NotFound as exc:
            if reading:
                raise ObjectNotFound(url) from exc
            raise StoreError(f"bucket not found writing {url}: {exc.message}") from exc
        except gexc.GoogleAPICallError as exc:
            raise StoreError(f"GCS error on {url}: {exc}") from exc

    def _put(self, key: str, upload: Callable, if_absent: bool) -> bool:
        from google.api_core.exceptions import PreconditionFailed
        from google.cloud.storage.retry import DEFAULT_RETRY

        with self._errors(key, reading=False):
            try:
                # Generation 0 means "only if no live object": the server arbitrates the race. Every write is a
                # whole object, so repeating it is harmless: transient errors (429, 5xx, a dropped connection)
                # are retried with exponential backoff also without a precondition (the library's default
                # retries only conditional writes). Reads, lists and deletes are retried by the library.
                upload(self._blob(key, upload=True), if_generation_match=0 if if_absent else None, retry=DEFAULT_RETRY)
            except PreconditionFailed:
                # Also seen if a retried upload had in fact landed the first time: we then report False
                # although our bytes won, which is harmless to a first-writer-wins reader (it reads ours).
                return False
        return True

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        return self._put(
            key,
            lambda blob, **kw: blob.upload_from_string(bytes(data), content_type="application/octet-stream", **kw),
            if_absent,
        )

    def put_file(self, key: str, path: str | os.PathLike, *, if_absent: bool = False) -> bool:
        # Files over 8 MiB go as resumable uploads in _GCS_CHUNK_SIZE pieces; the object appears only at the end.
        if if_absent and os.path.getsize(path) > _GCS_MULTIPART_MAX and self.exists(key):
            # Real GCS enforces the precondition on resumable uploads too; fake-gcs-server ignores it there, and
            # either way one metadata read is cheaper than streaming a big file only to be refused.
            return False
        return self._put(
            key,
            lambda blob, **kw: blob.upload_from_filename(
                os.fspath(path), content_type="application/octet-stream", **kw
            ),
            if_absent,
        )

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key, reading=True):
            return self._blob(key).download_as_bytes()

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        blob = self._blob(key)
        with self._errors(key, reading=True):
            _atomic_write(pathlib.Path(path), blob.download_to_file)

    def exists(self, key: str) -> bool:
        with self._errors(key, reading=False):
            return self._blob(key).exists()

    def list(self, prefix: str = "") -> list[str]:
        base = _check_prefix(prefix)
        root = self.prefix + "/" if self.prefix else ""
        with self._errors(base, reading=False):
            blobs = self.client.list_blobs(
                self.bucket_name, prefix=root + base, page_size=_GCS_LIST_PAGE_SIZE, fields="items(name),nextPageToken"
            )
            return sorted(blob.name[len(root) :] for blob in blobs)  # the iterator follows every page

    def delete(self, key: str) -> None:
        from google.api_core.exceptions import NotFound

        with self._errors(key, reading=False), contextlib.suppress(NotFound):
            self._blob(key).delete()

    def child(self, prefix: str) -> GCSStore:
        return GCSStore(f"gs://{self.bucket_name}/{self._name(prefix.rstrip('/'))}", self._client)

    def url_for(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{_join(self.prefix, key)}"


# ---------------------------------------------------------------------------------------------------------------


def open_store(url: str | os.PathLike, *, gcs_client=None) -> Store:
    """``gs://bucket[/prefix]`` → GCSStore; ``file:///dir``, ``/dir``, ``~/dir`` or a relative path → LocalStore.

    ``gcs_client``: the ``google.cloud.storage.Client`` a GCS store uses (default: see ``_gcs_client``).
    """
    text = os.fspath(url)
    if text.startswith("gs://"):
        return GCSStore(text, gcs_client)
    if text.startswith("file://"):
        parsed = urllib.parse.urlsplit(text)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise StoreError(f"unsupported file URL {text!r}: use file:///absolute/path")
        return LocalStore(urllib.parse.unquote(parsed.path))
    if "://" in text or not text:
        raise StoreError(
            f"unsupported storage URL {text!r}: use gs://bucket[/prefix], file:///absolute/path "
            "or a local directory path"
        )
    return LocalStore(text)
