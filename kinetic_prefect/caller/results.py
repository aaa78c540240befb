"""Caller side: where Prefect persists a kinetic task's results when its pool's store is in the cloud.

Prefect's own result machinery does the work (result records, cache lookups by cache key); we only
point it at ``<store>/results`` through a *saved* prefect-gcp ``GcsBucket`` block, so every result
record names its storage block (``storage_block_id``) and anyone can read it back from the UI's block
or from another machine. The block is derived from the store: its name is ``kinetic-results-`` and a
hash of the bucket and prefix, it is created on first use and reused after, and it references the
pool's ``GcpCredentials`` block when the pool names one (else default credentials, i.e. Application
Default Credentials). Anyone who shares the bucket shares the cache.

The store is the one the task's pool uses (its ``store`` variable, else ``KINETIC_STORE``), resolved
when the task is called, before Prefect looks up its cache (see ``KineticTask``). A local store keeps
Prefect's default result storage.

With a signing key (kinetic_prefect.signing), every record is authenticated: the block is wrapped in
``SignedResults``, which writes ``<record>.sig`` beside each record (an HMAC of ``results/<key>`` and the
record's bytes, under the store scope that only master-key holders can sign) and checks it in ``read_path``,
before Prefect parses a byte. Verification sits under Prefect's serializer on purpose: a record names its own
serializer, so a writer of the store could otherwise switch it to ``pickle``. Prefect's cache lookup reads the
record through ``read_path`` and takes any error as "no cached result", so an unsigned or changed record is a
cache miss (with a warning naming it): the task runs again and writes a signed record over it. A local store
with a key keeps its records in ``<store>/results`` too, through a saved ``LocalFileSystem`` block.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from prefect.filesystems import WritableFileSystem
from pydantic import PrivateAttr

from kinetic_prefect import signing
from kinetic_prefect.contract import results_prefix
from kinetic_prefect.shared import gcp

BLOCK_PREFIX = "kinetic-results-"
_TTL_SECONDS = 30.0
_MEMO_SIZE = 16  # records verified by Prefect's exists() and read again at once by its read() ...
_MEMO_SECONDS = 10.0  # ... for this long at most
_blocks: dict[tuple[str, str, Any], tuple[float, Any]] = {}
_logger = logging.getLogger(__name__)


def block_name(store_url: str) -> str:
    """``kinetic-results-<12 hex>``: the same on every machine for one ``gs://bucket/prefix``."""
    return BLOCK_PREFIX + hashlib.sha256(store_url.rstrip("/").encode()).hexdigest()[:12]


def _bucket_and_folder(store_url: str) -> tuple[str, str]:
    parsed = urllib.parse.urlsplit(store_url)
    prefix = parsed.path.strip("/")
    return parsed.netloc, results_prefix(prefix)


def _same(block: Any, bucket: str, folder: str, credentials: Any) -> bool:
    nested = block.gcp_credentials
    wanted_id = getattr(credentials, "_block_document_id", None)
    return (
        block.bucket == bucket
        and block.bucket_folder.rstrip("/") == folder
        and getattr(nested, "_block_document_id", None) == wanted_id
        and (wanted_id is not None or nested.service_account_info is None and nested.service_account_file is None)
    )


def _warn(message: str) -> None:
    """In the task run's log (the UI shows it) when there is one, else this module's logger."""
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # outside a run
        _logger.warning(message)


class SignedResults(WritableFileSystem):
    """Prefect result storage that signs what it writes and checks what it reads (never saved itself).

    ``inner`` holds the bytes (the saved results block); this wrapper carries its block id, so every record
    names ``inner`` as its storage block. ``write_path`` writes ``<path>.sig`` and then the record;
    ``read_path`` returns the record only if its signature checks out under ``results/<path>``, and otherwise
    warns, naming the record, and raises ``StoreTampered``: Prefect's cache lookup (``ResultStore.exists``)
    takes that as a miss, so nothing of the record is parsed or unpickled and the task runs again.
    """

    _block_type_name = "Kinetic Signed Results"
    _block_type_slug = "kinetic-signed-results"

    inner: Any
    where: str  # the results folder's URL, to name a record in messages

    _keyring: Any = PrivateAttr(None)
    _memo: Any = PrivateAttr(None)
    _lock: Any = PrivateAttr(None)

    @classmethod
    def wrap(cls, inner: Any, where: str, keyring: signing.Keyring) -> SignedResults:
        wrapper = cls(inner=inner, where=where.rstrip("/"))
        wrapper._keyring = keyring
        wrapper._memo = collections.OrderedDict()
        wrapper._lock = threading.Lock()
        # Prefect's own name for a saved block: records name ``inner`` (a Task refuses an unsaved storage)
        wrapper._block_document_id = getattr(inner, "_block_document_id", None)
        wrapper._block_document_name = getattr(inner, "_block_document_name", None)
        return wrapper

    def _object_key(self, path: str) -> str:
        """The record's store key, which its signature covers: ``results/<path>`` (store scope)."""
        base = getattr(self.inner, "basepath", None)
        if base and Path(path).is_absolute():  # a LocalFileSystem record written with its absolute path
            path = Path(path).resolve().relative_to(Path(base).expanduser().resolve()).as_posix()
        return f"{results_prefix('')}/{path.strip('/')}"

    def _checked(self, path: str, data: bytes, signature: bytes | None) -> bytes:
        from kinetic_prefect.errors import StoreTampered

        object_key = self._object_key(path)
        where = f"{self.where}/{object_key.partition('/')[2]}"
        try:
            signing.check(self._keyring, object_key, data, signature, f"result record {where}")
        except signing.TamperedObject as exc:
            message = f"{exc}. Prefect's cached result is ignored (a cache miss): the task runs again"
            _warn(message)
            raise StoreTampered(message) from None
        # Prefect reads a record twice in a row, in exists() and then read(): the read gets the bytes checked
        # here, so a record swapped in between is never read (it would fail the task instead of missing).
        with self._lock:
            self._memo[path] = (time.monotonic(), data)
            while len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)
        return data

    def _remembered(self, path: str) -> bytes | None:
        with self._lock:
            at, data = self._memo.pop(path, (0.0, None))
        return data if time.monotonic() - at < _MEMO_SECONDS else None

    def _signature(self, path: str, content: bytes) -> bytes:
        signature = signing.sign(self._keyring, self._object_key(path), content)
        assert signature is not None
        return signature

    async def aread_path(self, path: str) -> bytes:
        remembered = self._remembered(path)
        if remembered is not None:
            return remembered
        data = await self.inner.aread_path(path)
        try:
            signature: bytes | None = await self.inner.aread_path(path + signing.SUFFIX)
        except Exception:  # missing or unreadable: unsigned
            signature = None
        return self._checked(path, data, signature)

    def read_path(self, path: str, **_sync: Any) -> Any:  # Prefect's sync callers pass _sync=True
        remembered = self._remembered(path)
        if remembered is not None:
            return remembered
        data = self.inner.read_path(path, _sync=True)
        try:
            signature: bytes | None = self.inner.read_path(path + signing.SUFFIX, _sync=True)
        except Exception:  # missing or unreadable: unsigned
            signature = None
        return self._checked(path, data, signature)

    async def awrite_path(self, path: str, content: bytes) -> Any:
        self._remembered(path)  # a record written now supersedes one remembered
        await self.inner.awrite_path(path + signing.SUFFIX, self._signature(path, content))
        return await self.inner.awrite_path(path, content)

    def write_path(self, path: str, content: bytes, **_sync: Any) -> Any:
        self._remembered(path)
        self.inner.write_path(path + signing.SUFFIX, self._signature(path, content), _sync=True)
        return self.inner.write_path(path, content, _sync=True)


async def _saved_block(name: str, make: Any, same: Any) -> Any:
    """The saved block ``name`` as ``make()`` would make it: loaded, else created (or updated when ``same``
    says the saved one differs)."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    fresh = make()
    try:
        block = await type(fresh).aload(name)
    except (ValueError, ObjectNotFound):
        block = None
    if block is None or not same(block):
        with contextlib.suppress(ObjectAlreadyExists):  # another caller created it a moment ago
            await fresh.asave(name, overwrite=block is not None)
        block = await type(fresh).aload(name)
    return block


async def _gcs_block(store_url: str, credentials: Any, pool_name: str) -> Any:
    from prefect_gcp import GcpCredentials, GcsBucket

    bucket, folder = _bucket_and_folder(store_url)
    try:
        if credentials is None:
            credentials = GcpCredentials()  # Application Default Credentials, looked up here
        return await _saved_block(
            block_name(store_url),
            lambda: GcsBucket(bucket=bucket, bucket_folder=folder, gcp_credentials=credentials),
            lambda block: _same(block, bucket, folder, credentials),
        )
    except gcp.GcpSettingError:
        raise
    except Exception as exc:  # google.auth's DefaultCredentialsError and friends
        raise gcp.GcpSettingError(
            f"results of work pool {pool_name!r} live in {store_url}/results, but no GCP credentials were found "
            f"({type(exc).__name__}: {exc}). Name a GcpCredentials block: `kinetic-prefect pool-set {pool_name} "
            f"{gcp.POOL_VARIABLE}=NAME`, or set up Application Default Credentials (`gcloud auth "
            "application-default login`, GOOGLE_APPLICATION_CREDENTIALS, Workload Identity)"
        ) from exc


async def _local_block(store_url: str) -> Any:
    from prefect.filesystems import LocalFileSystem

    from kinetic_prefect.storage import open_store

    folder = open_store(store_url).local_path(results_prefix(""))
    assert folder is not None
    return await _saved_block(
        block_name(store_url),
        lambda: LocalFileSystem(basepath=str(folder)),
        lambda block: block.basepath == str(folder),
    )


async def result_storage(
    store_url: str, credentials: Any = None, pool_name: str = "?", keyring: signing.Keyring | None = None
) -> Any:
    """The result storage of a store: for ``gs://`` the saved ``GcsBucket`` block for ``<store_url>/results``
    (created or updated if need be), else None (Prefect's default). With ``keyring`` (the signing key) it is
    wrapped in ``SignedResults``, and a local store gets a saved ``LocalFileSystem`` block for
    ``<store>/results`` so its records are signed too. ``credentials``: the pool's ``GcpCredentials`` block,
    or None for default ones."""
    is_gcs = store_url.startswith("gs://")
    if not is_gcs and keyring is None:
        return None
    key = (gcp.api_url(), store_url.rstrip("/"), getattr(credentials, "_block_document_id", None))
    cached = _blocks.get(key)
    if cached is not None and time.monotonic() - cached[0] < _TTL_SECONDS:
        block = cached[1]
    else:
        block = await (_gcs_block(store_url, credentials, pool_name) if is_gcs else _local_block(store_url))
        _blocks[key] = (time.monotonic(), block)
    if keyring is None:
        return block
    return SignedResults.wrap(block, f"{store_url.rstrip('/')}/{results_prefix('')}", keyring)


async def for_pool(pool_name: str) -> Any:
    """The result storage of a kinetic task that runs on ``pool_name`` (None: Prefect's default)."""
    from kinetic_prefect.caller.pools import ensure_work_pool
    from kinetic_prefect.shared.key_blocks import signing_key
    from kinetic_prefect.shared.prefect_runs import shared_client

    async with shared_client() as client:
        pool = await ensure_work_pool(client, pool_name)
    url = gcp.store_url(pool)
    keyring = await signing_key()
    if not url.startswith("gs://"):
        return await result_storage(url, keyring=keyring)
    return await result_storage(url, await gcp.pool_credentials(pool), pool.name, keyring)


__all__ = ["BLOCK_PREFIX", "SignedResults", "block_name", "for_pool", "result_storage"]
