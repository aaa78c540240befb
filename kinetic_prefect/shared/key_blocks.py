"""The signing key and the forwarded env values a polling worker needs, kept as Prefect Secret blocks."""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from prefect.exceptions import ObjectNotFound

from kinetic_prefect import signing
from kinetic_prefect.contract import Env, settings
from kinetic_prefect.contract.layout import env_block_signed_name
from kinetic_prefect.pod import outputs

_signing_key_cache: dict[str, signing.Keyring | None] = {}
_read_at: dict[str, float] = {}  # when each API's block was last read (time.monotonic)
# A signature that does not verify under the cached key may mean the block was rotated since: it is read again, at
# most once per this many seconds (a stream of forged runs must not turn into a stream of block reads).
REREAD_SECONDS = 5.0
# However it verifies, a key read from the block is read again after this long: a long-lived caller (a notebook)
# signs with the rotated key within a minute, as running workers do.
KEY_TTL_SECONDS = 60.0


_warned: set[str] = set()  # the APIs whose missing key this process has warned about


def forget_signing_key() -> None:
    """Read the key again on the next call (and warn again if there is none): after a key is set or removed."""
    _signing_key_cache.clear()
    _read_at.clear()
    _warned.clear()


async def signing_key_again() -> signing.Keyring | None:
    """The key after a signature did not verify under the one this process holds: the Secret block is read again
    when its last read is older than REREAD_SECONDS (a rotation updates the block under running workers; they need no
    restart). A key from the environment is what it is: this process cannot see it change."""
    from prefect.settings import PREFECT_API_URL

    if signing.key_from_env() is None:
        cache_key = str(PREFECT_API_URL.value())
        if time.monotonic() - _read_at.get(cache_key, float("-inf")) >= REREAD_SECONDS:
            _signing_key_cache.pop(cache_key, None)
    return await signing_key()


async def signing_key() -> signing.Keyring | None:
    """The store signing key: ``KINETIC_SIGNING_KEY``, else the Secret block ``kinetic-signing-key``.

    Read once per process and API, and again after KEY_TTL_SECONDS (a rotation). Without one, store objects are
    unauthenticated and a warning says so once (see signing.py for what the key protects).
    """
    from_env = signing.key_from_env()
    if from_env is not None:
        return from_env
    from prefect.settings import PREFECT_API_URL

    cache_key = str(PREFECT_API_URL.value())
    if time.monotonic() - _read_at.get(cache_key, float("inf")) >= KEY_TTL_SECONDS:
        _signing_key_cache.pop(cache_key, None)
    if cache_key not in _signing_key_cache:
        from prefect.blocks.system import Secret

        _read_at[cache_key] = time.monotonic()
        try:
            secret: Secret[Any] = await Secret.aload(signing.SECRET_BLOCK)
            value = secret.get()
            _signing_key_cache[cache_key] = (
                signing.parse_keys(str(value), settings.SIGNING_KEY_PREVIOUS.value()) if value else None
            )
        except (ValueError, ObjectNotFound):
            _signing_key_cache[cache_key] = None
        if _signing_key_cache[cache_key] is None and not settings.UNSIGNED_OK.value() and cache_key not in _warned:
            _warned.add(cache_key)  # before the warning: the calls of a .map() that all missed the cache warn once
            warnings.warn(
                f"kinetic-prefect: no signing key ({Env.SIGNING_KEY} or the Prefect Secret block "
                f"{signing.SECRET_BLOCK!r}): store objects are unauthenticated, so anyone who can write the "
                "store can change results and payloads. Fine on one machine; set a key for shared stores.",
                stacklevel=2,
            )
    outputs.remember_key(_signing_key_cache[cache_key])  # JobOutputs.download checks a job's outputs with it
    return _signing_key_cache[cache_key]


def unsigned_refusal(store_url: str, key: signing.Keyring | None) -> str | None:
    """Why work on this store may not run unsigned, or None. A shared store (gs://) is written by more than one
    person or machine, so without a key anyone who can write the bucket could run code in callers and jobs:
    refused unless the user opts out explicitly. A local store on one machine may stay keyless."""
    if key is not None or not store_url.startswith("gs://") or settings.UNSIGNED_SHARED_STORE.value():
        return None
    return (
        f"the store {store_url} is shared and there is no signing key, so anyone who can write the bucket could "
        f"run code in your flow and your jobs. Create a key once (`kinetic-prefect up` does; or "
        f"`Secret(value=secrets.token_urlsafe(32)).save({signing.SECRET_BLOCK!r})`), or set {Env.SIGNING_KEY} "
        f"where callers and workers run. To run unsigned anyway, set {Env.UNSIGNED_SHARED_STORE}=1"
    )


async def store_secret_env(values: dict[str, str], name: str) -> str:
    """Forwarded env values for a polling worker, in a Prefect Secret block it reads once and deletes. With a key,
    the content is signed (under the store's own scope, which no job holds) as this run's: any API user can rewrite
    a block, and the worker uses only values a key holder's caller saved for this very run."""
    from prefect.blocks.system import Secret

    key = await signing_key()
    content: Any = values
    if key is not None:
        signature = signing.sign(key, env_block_signed_name(_run_of(name)), _env_bytes(values))
        content = {"values": values, "signature": signature.decode() if signature else ""}
    secret: Secret[Any] = Secret(value=json.dumps(content))  # type: ignore[arg-type]  # a plain str is a secret too
    await secret.asave(name=name, overwrite=True)
    return name


async def load_secret_env(name: str, run_id: str, key: signing.Keyring | None) -> dict[str, str]:
    """A run's forwarded env values from its block (then deleted: read once). With a key, TamperedObject unless a
    key holder signed exactly these values for ``run_id``; the block is deleted either way."""
    from prefect.blocks.system import Secret

    try:
        secret: Secret[Any] = await Secret.aload(name)
    except (ValueError, ObjectNotFound):
        raise signing.TamperedObject(
            f"the forwarded-env block {name!r} is missing (deleted, or taken by another worker)"
        ) from None
    content = secret.get()  # Prefect parses JSON secrets back into objects
    await Secret.adelete(name)
    content = json.loads(content) if isinstance(content, str) else content
    signed = isinstance(content, dict) and set(content) == {"values", "signature"}
    values = content["values"] if signed else content
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise signing.TamperedObject(f"the forwarded-env block {name!r} holds no env values")
    if key is not None:
        signature = str(content["signature"]).encode() if signed else None
        signing.check(
            key, env_block_signed_name(run_id), _env_bytes(values), signature, f"the forwarded-env block {name!r}"
        )
    return {str(k): v for k, v in values.items()}


async def delete_secret_env(name: str) -> bool:
    """Delete a run's forwarded-env block if it is still there: no worker read it (the call ended first, or the run
    was refused), and its secrets must not stay readable to every API user. True when it was there. Shielded and
    bounded: it runs while its call is being cancelled, and an unreachable API must not hold the call up."""
    import anyio
    from prefect.blocks.system import Secret

    with anyio.move_on_after(15, shield=True):
        try:
            await Secret.adelete(name)
        except (ValueError, ObjectNotFound):  # read and deleted by its worker, or by cleanup
            return False
        return True
    return False


def _env_bytes(values: dict[str, str]) -> bytes:
    return json.dumps(values, sort_keys=True, separators=(",", ":")).encode()


def _run_of(block_name: str) -> str:
    from kinetic_prefect.contract.layout import ENV_BLOCK_PREFIX

    return block_name.removeprefix(ENV_BLOCK_PREFIX)
