"""Authenticated store objects: HMAC-SHA256 over what crosses the store (stdlib only; ships with the runner).

The store is a trust boundary: whoever can write it could otherwise replace a pickled result and
run code in the caller when it is unpickled, or replace a payload and run code in the job. With a
signing key configured, every object that is unpickled or trusted on the other side (payload,
result, outcome record, Data manifests) is written with a ``<key>.sig`` beside it, an HMAC of the
object's store key and bytes (so a valid object cannot be moved to another run), and is verified
before it is used. A store writer without the key can then only destroy, not forge.

Where the key comes from: ``KINETIC_SIGNING_KEY`` in the environment, else the Prefect Secret block
``kinetic-signing-key`` (read by the caller and the worker, which hands it to the job in memory:
in-process as a variable, on GKE through the Job-owned Kubernetes Secret, never in a manifest or a
Prefect record). Without a key everything still works, unauthenticated, and the caller says so once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac

from kinetic_prefect.contract import Env, settings

KEY_ENV = Env.SIGNING_KEY
REQUIRED_ENV = Env.SIGNED  # set (not secret) on jobs whose caller signed: the job then insists
SECRET_BLOCK = "kinetic-signing-key"
SUFFIX = ".sig"


class TamperedObject(Exception):
    """A store object's signature is missing or wrong: it was not written by a holder of the key."""


class KeyMismatch(TamperedObject):
    """The object was signed, intact, but with another key: the two sides were given different signing keys."""


def _mac(key: bytes, object_key: str, data: bytes) -> str:
    return hmac.new(key, object_key.encode() + b"\0" + data, hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """A short public name of a key, written beside each signature: it tells a reader that an object was signed
    with another key (a configuration error) rather than changed (a forgery), and reveals nothing of the key."""
    return hashlib.sha256(b"kinetic-signing-key-id\0" + key).hexdigest()[:12]


def _signature(key: bytes, object_key: str, data: bytes) -> bytes:
    return f"{_mac(key, object_key, data)} key:{key_id(key)}".encode()


def key_from_env() -> bytes | None:
    value = settings.SIGNING_KEY.value()
    return value.encode() if value else None


def put(store, object_key: str, data: bytes, key: bytes | None, **kwargs) -> None:
    """Write ``data`` (and, with a key, its signature first: the object is the marker that it is complete)."""
    if key is not None:
        store.put_bytes(object_key + SUFFIX, _signature(key, object_key, data))
    store.put_bytes(object_key, data, **kwargs)


def verify(store, object_key: str, data: bytes, key: bytes | None) -> bytes:
    """``data`` if its signature checks out (or no key is in use); raises TamperedObject otherwise."""
    if key is None:
        return data
    try:
        signature = store.get_bytes(object_key + SUFFIX).decode()
    except Exception as exc:  # missing or unreadable: unsigned
        raise TamperedObject(
            f"{store.url_for(object_key)} has no signature ({type(exc).__name__}); it was not "
            "written by a holder of the signing key: refusing to use it"
        ) from None
    mac, _, signer = signature.strip().partition(" key:")
    if hmac.compare_digest(mac.encode(), _mac(key, object_key, data).encode()):
        return data
    if signer and signer != key_id(key):
        raise KeyMismatch(
            f"{store.url_for(object_key)} was signed with another signing key (key id {signer}; "
            f"this side's is {key_id(key)}): the worker's signing key differs from the caller's. Give "
            f"the caller and the worker the same key ({KEY_ENV}, or the Prefect Secret block "
            f"{SECRET_BLOCK!r}) and call again"
        )
    raise TamperedObject(
        f"{store.url_for(object_key)} does not match its signature: it was changed in the "
        "store after it was written; refusing to use it"
    )


def get(store, object_key: str, key: bytes | None) -> bytes:
    return verify(store, object_key, store.get_bytes(object_key), key)


def delete(store, object_key: str) -> None:
    for name in (object_key, object_key + SUFFIX):
        with contextlib.suppress(Exception):
            store.delete(name)
