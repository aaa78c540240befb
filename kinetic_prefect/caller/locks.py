"""A Prefect lock manager on the artifact store, so cache isolation works across machines.

Two flows calling the same cached kinetic task with the same inputs must run one job, not two:
Prefect does this with a SERIALIZABLE cache policy and a lock manager (the second caller waits for
the lock, then finds the first one's cached result). Prefect ships an in-memory and a local-file
lock manager; neither is seen by another machine. This one keeps each lock as an object
``locks/<key>.json`` in the store, created with the store's create-if-absent precondition (an
atomic ``link()`` locally, ``if_generation_match=0`` on GCS), so exactly one holder wins wherever
the callers run. A lock records its holder and an expiry; an expired lock (its holder died) is
broken by the next caller.
"""

from __future__ import annotations

import json
import time

from prefect.locking.protocol import LockManager

from kinetic_prefect.contract import lock_key
from kinetic_prefect.storage import ObjectNotFound, Store, open_store

POLL_SECONDS = 0.2
# A holder that died leaves its lock; it is broken after this long unless the holder said otherwise.
DEFAULT_HOLD_SECONDS = 24 * 3600.0


class StoreLockManager(LockManager):
    def __init__(self, store_url: str):
        self.store_url = store_url
        self._store: Store | None = None

    def __getstate__(self) -> dict:  # Prefect copies cache policies; the client is rebuilt on use
        return {"store_url": self.store_url, "_store": None}

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.store_url)
        return self._store

    @staticmethod
    def _key(key: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
        return lock_key(safe)

    def _read(self, key: str) -> dict | None:
        try:
            return json.loads(self.store.get_bytes(self._key(key)))
        except ObjectNotFound:
            return None
        except ValueError:  # a torn or foreign object: treat as expired
            return {"holder": None, "expires": 0}

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        record = json.dumps({"holder": holder, "expires": time.time() + (hold_timeout or DEFAULT_HOLD_SECONDS)})
        while True:
            if self.store.put_bytes(self._key(key), record.encode(), if_absent=True):
                return True
            current = self._read(key)
            if current is not None and current.get("holder") == holder:
                return True
            if current is not None and current.get("expires", 0) < time.time():
                self.store.delete(self._key(key))  # its holder is gone; the next put decides who wins
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        import anyio

        return await anyio.to_thread.run_sync(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        current = self._read(key)
        if current is None or current.get("holder") != holder:
            raise ValueError(f"no lock held by {holder!r} for transaction record {key!r}")
        self.store.delete(self._key(key))

    def is_locked(self, key: str) -> bool:
        current = self._read(key)
        return current is not None and current.get("expires", 0) >= time.time()

    def is_lock_holder(self, key: str, holder: str) -> bool:
        current = self._read(key)
        return current is not None and current.get("holder") == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        import anyio

        return await anyio.to_thread.run_sync(self.wait_for_lock, key, timeout)
