"""Authenticated store objects: HMAC-SHA256 over what crosses the store (stdlib only; ships with the runner).

The store is a trust boundary: whoever can write it could otherwise replace a pickled result and run code in the
caller when it is unpickled, or replace a payload and run code in the job. With a signing key configured, every
object that is unpickled or trusted on the other side (payload, result, outcome record, hand-over records,
checkpoint and output manifests) is written with a ``<key>.sig`` beside it, an HMAC of the object's store key and
bytes (so a valid object cannot be moved elsewhere), and is verified before it is used.

Keys are scoped. The *master key* (``KINETIC_SIGNING_KEY`` or the Prefect Secret block ``kinetic-signing-key``) is
held by callers and workers only. Every object belongs to a *scope* named by its store key (``runs/<id>``,
``sweeps/<id>``, ``checkpoints/<task run>``, ``outputs/<id>``, ``warm/<env>/<pod>``; anything else is the store's own
scope), and is signed with a key derived from the master key and that scope (HKDF-SHA256). A job is handed only the
derived keys of its own scopes, so code running in one job can sign its own run's objects and nothing else: not
another run's result, not a warm pod's hand-over, not a Data manifest. A key one job needs for a scope it does not
own from the start (a warm pod's next call, a slot's next input) travels *wrapped* in a signed record: XORed with a
pad that only the holder of the record's own scope key can compute.

Rotation: sign with the first master key, verify with any of ``KINETIC_SIGNING_KEY`` and
``KINETIC_SIGNING_KEY_PREVIOUS`` (comma-separated); see docs/security.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from typing import Any

from kinetic_prefect.contract import Env, RunLayout, checkpoints_key, job_variables_name, settings

KEY_ENV = Env.SIGNING_KEY
REQUIRED_ENV = Env.SIGNED  # set (not secret) on jobs whose caller signed: the job then insists
SECRET_BLOCK = "kinetic-signing-key"
SUFFIX = ".sig"
SCOPED_PREFIX = "kinetic-scoped-v1:"  # a job's keyring in KINETIC_SIGNING_KEY: never a master key
STORE_SCOPE = ""  # objects outside every per-run scope (Data manifests, locks, results): master key holders only
_SCOPED_ROOTS = {"runs": 2, "sweeps": 2, "checkpoints": 2, "outputs": 2, "warm": 3}  # root -> segments in the scope
_STORE_LEVEL_NAMES = ("runs", "left", "billed")  # sweeps/left, warm/billed...: store records, never an id
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# Objects that outlive a call and may have been written before a rotation: Prefect result records (a cache), Data
# manifests, checkpoints and outputs. Only these verify under a previous key; whatever starts a job or hands one over
# (job variables, payloads, hand-overs, queued inputs, forwarded-env blocks) verifies under the current key only, so
# a rotated-out key signs nothing new.
LONG_LIVED_ROOTS = ("results", "data", "checkpoints", "outputs")


class TamperedObject(Exception):
    """A store object's signature is missing or wrong: it was not written by a holder of the key."""


class KeyMismatch(TamperedObject):
    """The object was signed, intact, but with another key: the two sides were given different signing keys."""


class OutOfScope(TamperedObject):
    """This process holds no key for the object's scope: a job may sign and check only its own run's objects."""


class BadKey(ValueError):
    """A signing key value that cannot be a key (empty, or a job's keyring where a master key belongs)."""


def scope_of(object_key: str) -> str:
    """The scope an object belongs to, from its store key: ``runs/<id>/result.pkl`` -> ``runs/<id>``."""
    parts = object_key.strip("/").split("/")
    depth = _SCOPED_ROOTS.get(parts[0])
    if depth is None or len(parts) <= depth or parts[1] in ("runs", "left", "billed"):
        return STORE_SCOPE
    return "/".join(parts[:depth])


def check_id(value: str, what: str) -> str:
    """``value`` if it can name one run, sweep, task run or runner in the store (letters, digits, ``._-``; not a
    store-level name such as ``runs``); BadKey naming ``what`` otherwise: a job is never handed the keys of a scope
    chosen by a crafted id (``KINETIC_SWEEP_ID=runs`` read as the store's own scope)."""
    if not _ID.fullmatch(value or "") or value in _STORE_LEVEL_NAMES:
        raise BadKey(
            f"{what}={value!r} is not an id (letters, digits, '.', '_', '-'; not {'/'.join(_STORE_LEVEL_NAMES)}): "
            "refusing to hand a job keys for it"
        )
    return value


def long_lived(object_key: str) -> bool:
    """Whether an object may have been signed before a rotation and still be needed (LONG_LIVED_ROOTS)."""
    return object_key.strip("/").split("/", 1)[0] in LONG_LIVED_ROOTS


def derive(master: bytes, scope: str) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``master`` for ``scope``: one 32-byte key per scope; the store scope's is the
    master key's own derivation too, so no object is ever signed with the master key itself."""
    prk = hmac.new(b"kinetic-prefect signing v1", master, hashlib.sha256).digest()
    return hmac.new(prk, b"scope\0" + scope.encode() + b"\x01", hashlib.sha256).digest()


def key_id(key: bytes) -> str:
    """A short public name of a key, written beside each signature: it tells a reader that an object was signed
    with another key (a configuration error) rather than changed (a forgery), and reveals nothing of the key."""
    return hashlib.sha256(b"kinetic-signing-key-id\0" + key).hexdigest()[:12]


class Keyring:
    """The keys one process holds: master keys (callers and workers: every scope, the first signs) or the
    derived keys of a few scopes (a job)."""

    def __init__(
        self, masters: Iterable[bytes] = (), scoped: dict[str, bytes] | None = None, master_id: str = ""
    ) -> None:
        self.masters = [bytes(m) for m in masters]
        if any(not m.strip() for m in self.masters):
            raise BadKey("an empty signing key is not a key")
        self.scoped = dict(scoped or {})
        self.master_id = key_id(self.masters[0]) if self.masters else master_id  # public: names the signer

    @property
    def is_master(self) -> bool:
        return bool(self.masters)

    def key_for(self, scope: str) -> bytes:
        """The key that signs objects of ``scope``; OutOfScope if this keyring holds none."""
        if self.masters:
            return derive(self.masters[0], scope)
        if scope in self.scoped:
            return self.scoped[scope]
        held = ", ".join(sorted(self.scoped)) or "none"
        raise OutOfScope(
            f"this job holds signing keys for {held} only, not for {scope or 'the store scope'}: a job may "
            "sign and check its own run's objects only"
        )

    def verify_keys(self, scope: str, previous: bool = True) -> list[bytes]:
        """The keys an object of ``scope`` may be signed with: the current one, and the previous master keys when
        ``previous`` (objects that outlive a call: ``long_lived``)."""
        if self.masters:
            return [derive(m, scope) for m in (self.masters if previous else self.masters[:1])]
        return [self.key_for(scope)]

    def identity(self) -> str:
        """The key id signatures name: the first master key's, or for a job the id of its run's master."""
        return self.master_id

    def for_job(self, *scopes: str) -> Keyring:
        """The keyring a job is handed: the derived keys of ``scopes`` only (never a master key, never the store's
        own scope, whose key signs job variables for any run): BadKey for a scope that is not one run's, sweep's,
        task run's or runner's."""
        for scope in scopes:
            segments = scope.split("/")
            if (
                scope == STORE_SCOPE
                or scope_of(scope + "/_") != scope
                or not all(_ID.fullmatch(s) and s not in _STORE_LEVEL_NAMES for s in segments[1:])
            ):
                raise OutOfScope(
                    f"a job is never handed the key of {scope or 'the store scope'!r}: only its own run's, sweep's, "
                    "task run's or runner's (an id that names a store-level folder is not an id)"
                )
        return Keyring(scoped={scope: self.key_for(scope) for scope in scopes}, master_id=self.master_id)

    def to_env(self) -> str:
        """A job keyring as the value of KINETIC_SIGNING_KEY; a master key is never written out."""
        if self.masters:
            raise BadKey("a master signing key is never handed to a job: give it for_job(...)")
        items = [f"@id={self.master_id}", *(f"{scope}={key.hex()}" for scope, key in sorted(self.scoped.items()))]
        return SCOPED_PREFIX + ";".join(items)

    def grant(self, scopes: Iterable[str], under: str, nonce: str) -> dict[str, str]:
        """The keys of ``scopes``, each readable only by a holder of ``under``'s key, and only for ``nonce`` (the
        record's own name): what a hand-over or queued record carries for the call it hands over."""
        return {scope: _xor(self.key_for(scope), self._pad(scope, under, nonce)).hex() for scope in scopes}

    def accept(self, grant: dict[str, str], under: str, nonce: str) -> Keyring:
        """The job keyring that ``grant`` sent (this keyring must hold ``under``'s key)."""
        scoped: dict[str, bytes] = {}
        for scope, wrapped in grant.items():
            try:
                raw = bytes.fromhex(wrapped)
            except ValueError:
                raw = b""
            if len(raw) != hashlib.sha256().digest_size:
                raise TamperedObject(f"the key handed over for {scope} is malformed")
            scoped[scope] = _xor(raw, self._pad(scope, under, nonce))
        return Keyring(scoped=scoped, master_id=self.master_id)

    def _pad(self, scope: str, under: str, nonce: str) -> bytes:
        return hmac.new(self.key_for(under), f"wrap\0{scope}\0{nonce}".encode(), hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def run_scopes(run_id: str, checkpoint_key: str | None = None) -> list[str]:
    """The scopes a job for ``run_id`` writes: its run folder, its outputs, and its task run's checkpoints."""
    layout = RunLayout(check_id(run_id, Env.RUN_ID))
    scopes = [scope_of_prefix(layout.prefix), scope_of_prefix(layout.outputs)]
    if checkpoint_key:
        task_run = checkpoint_key.strip("/").removeprefix(checkpoints_key(""))
        if checkpoints_key(task_run) != checkpoint_key.strip("/"):
            raise BadKey(f"{Env.CHECKPOINT_KEY}={checkpoint_key!r} is not {checkpoints_key('<task run id>')}")
        scopes.append(scope_of_prefix(checkpoints_key(check_id(task_run, Env.CHECKPOINT_KEY))))
    return scopes


def scope_of_prefix(prefix: str) -> str:
    """The scope of every object under ``prefix`` (a run's folder, a sweep's, a warm pod's control prefix)."""
    return scope_of(prefix.rstrip("/") + "/_")


def parse_keys(value: str | None, previous: str | None = None) -> Keyring | None:
    """A keyring from KINETIC_SIGNING_KEY's value (a master key, or a job's scoped keyring) and the previous
    master keys; None when no key is set. An empty or blank key is refused, never read as "unsigned"."""
    if value is None:
        return None
    if not value.strip():
        raise BadKey(f"{KEY_ENV} is set but empty: unset it for an unsigned store, or give the key")
    if value.startswith(SCOPED_PREFIX):
        scoped: dict[str, bytes] = {}
        master_id = ""
        try:
            for item in value[len(SCOPED_PREFIX) :].split(";"):
                scope, _, hexkey = item.rpartition("=")
                if scope == "@id":
                    master_id = hexkey
                else:
                    scoped[scope] = bytes.fromhex(hexkey)
        except ValueError:
            raise BadKey(f"{KEY_ENV} holds a malformed job keyring") from None
        if not scoped:
            raise BadKey(f"{KEY_ENV} holds a job keyring with no key")
        return Keyring(scoped=scoped, master_id=master_id)
    olds = [k.strip().encode() for k in (previous or "").split(",") if k.strip()]
    return Keyring([value.encode(), *olds])


def key_from_env() -> Keyring | None:
    """This process's keys from its environment (a master key, or the keyring the worker handed a job)."""
    return parse_keys(settings.SIGNING_KEY.value(), settings.SIGNING_KEY_PREVIOUS.value())


KeyLike = Keyring | bytes | None


def as_keyring(key: KeyLike) -> Keyring | None:
    """``bytes`` is a master key (what callers and workers hold); a Keyring passes through."""
    if key is None or isinstance(key, Keyring):
        return key
    return Keyring([key])


def _mac(key: bytes, object_key: str, data: bytes) -> str:
    return hmac.new(key, object_key.encode() + b"\0" + data, hashlib.sha256).hexdigest()


def sign(key: KeyLike, object_key: str, data: bytes) -> bytes | None:
    """The signature ``put`` writes beside ``data`` (None without a key)."""
    ring = as_keyring(key)
    if ring is None:
        return None
    mac = _mac(ring.key_for(scope_of(object_key)), object_key, data)
    return f"{mac} key:{ring.identity()}".encode()


def check(key: KeyLike, object_key: str, data: bytes, signature: bytes | None, where: str) -> bytes:
    """``data`` if ``signature`` is its signature under ``key`` (or no key is in use); TamperedObject otherwise.
    ``where`` names the object in the error."""
    ring = as_keyring(key)
    if ring is None:
        return data
    if signature is None:
        raise TamperedObject(
            f"{where} has no signature; it was not written by a holder of the signing key: refusing to use it"
        )
    mac, _, signer = signature.decode(errors="replace").strip().partition(" key:")
    keys = ring.verify_keys(scope_of(object_key), previous=long_lived(object_key))
    expected = [_mac(k, object_key, data) for k in keys]
    if any(hmac.compare_digest(mac.encode(), e.encode()) for e in expected):
        return data
    if signer in {key_id(m) for m in ring.masters[1:]} and not long_lived(object_key):
        raise KeyMismatch(  # the signer holds a rotated-out key: a configuration to fix, not a forgery to retry
            f"{where} was signed with a previous signing key (key id {signer}; the current one is "
            f"{ring.identity()}): a rotated-out key verifies only results, Data, checkpoints and outputs made "
            f"before the rotation, never what starts or hands over a job. Sign it with the current key "
            f"({KEY_ENV} or the Prefect Secret block {SECRET_BLOCK!r}) and call again"
        )
    known = {key_id(m) for m in ring.masters} | {ring.identity()}
    if signer and signer not in known:
        raise KeyMismatch(
            f"{where} was signed with another signing key (key id {signer}; this side's is "
            f"{ring.identity()}): the worker's signing key differs from the caller's. Give the caller and the "
            f"worker the same key ({KEY_ENV}, or the Prefect Secret block {SECRET_BLOCK!r}) and call again"
        )
    raise TamperedObject(
        f"{where} does not match its signature: it was changed in the store after it was written, or signed by "
        "a job for another run; refusing to use it"
    )


def put(store, object_key: str, data: bytes, key: KeyLike, **kwargs) -> None:
    """Write ``data`` (and, with a key, its signature first: the object is the marker that it is complete)."""
    signature = sign(key, object_key, data)
    if signature is not None:
        store.put_bytes(object_key + SUFFIX, signature)
    store.put_bytes(object_key, data, **kwargs)


def verify(store, object_key: str, data: bytes, key: KeyLike) -> bytes:
    """``data`` if its signature checks out (or no key is in use); raises TamperedObject otherwise."""
    if key is None:
        return data
    try:
        signature: bytes | None = store.get_bytes(object_key + SUFFIX)
    except Exception:  # missing or unreadable: unsigned
        signature = None
    return check(key, object_key, data, signature, store.url_for(object_key))


def get(store, object_key: str, key: KeyLike) -> bytes:
    return verify(store, object_key, store.get_bytes(object_key), key)


def delete(store, object_key: str) -> None:
    for name in (object_key, object_key + SUFFIX):
        with contextlib.suppress(Exception):
            store.delete(name)


def _job_variables_bytes(job_variables: dict[str, Any]) -> tuple[str, bytes]:
    env = {k: v for k, v in (job_variables.get("env") or {}).items() if k != Env.JOB_SIGNATURE}
    body = {**job_variables, "env": env}
    run_id = str(env.get(Env.RUN_ID) or "")
    return job_variables_name(run_id), json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign_job_variables(key: KeyLike, job_variables: dict[str, Any]) -> None:
    """Put the caller's signature over a job run's variables into its ``env`` (nothing without a key): the worker
    then launches only what a key holder asked for (the run id, payload, code, requirements, image, store)."""
    name, body = _job_variables_bytes(job_variables)
    signature = sign(key, name, body)
    if signature is not None:
        job_variables.setdefault("env", {})[Env.JOB_SIGNATURE] = signature.decode()


def check_job_variables(key: KeyLike, job_variables: dict[str, Any]) -> None:
    """TamperedObject unless ``job_variables`` carry a key holder's signature over exactly themselves."""
    name, body = _job_variables_bytes(job_variables)
    given = (job_variables.get("env") or {}).get(Env.JOB_SIGNATURE)
    where = f"the job variables of run {name.rsplit('/', 1)[-1] or '(no run id)'}"
    check(key, name, body, given.encode() if given else None, where)
