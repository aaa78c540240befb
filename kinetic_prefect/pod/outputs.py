"""A job's durable outputs, reachable from the flow that called it.

Inside a job, files written to the output directory (the variable ``contract.Env.OUTPUT_DIR`` names) are uploaded to
the store when the job ends.
To hand them to later steps, return ``JobOutputs.current()`` (a small picklable reference) with the
job's value, then, on the caller's side::

    @kinetic_task(accelerator="l4")
    def train(...) -> dict:
        ...  # writes model.keras into os.environ[Env.OUTPUT_DIR]  (from kinetic_prefect.contract import Env)
        return {"metrics": m, "outputs": JobOutputs.current()}

    trained = train(...)
    trained["outputs"].download("model.keras", "models/")     # or .url("model.keras"), .download_all(dir)

With a signing key, the job writes a signed manifest (each file's size and sha256) after its outputs, per host,
and ``names``/``download``/``download_all`` use only the files it lists, each checked against its sha256 before
anything lands in the destination: a file a store writer swapped or added is refused (``StoreTampered``). The
job's checkpoints are kept the same way (``pod.runner.CheckpointSync``, with the manifest helpers below).

No step rebuilds store keys itself: where outputs live is ``contract.RunLayout``'s business. This
module imports only the stdlib, the contract and the leaves (it ships with the job runner).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kinetic_prefect import signing
from kinetic_prefect.contract import FILES_MANIFEST_NAME, Env, RunLayout, files_manifest_key, settings

if TYPE_CHECKING:
    from kinetic_prefect.storage import Store

Version = tuple[int, str]  # (size, sha256) of one file
Manifest = dict[str, list[Version]]  # relative path -> every version the store may hold (one once a save completes)

_CHUNK = 1 << 20
RESERVED_NAMES = (FILES_MANIFEST_NAME, FILES_MANIFEST_NAME + signing.SUFFIX)  # a folder's own manifest, never a file


# --------------------------------------------------------------------------- signed manifests (outputs, checkpoints)


def hash_file(path: Path) -> Version:
    """The size and sha256 of a file's bytes."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def stage_file(path: Path, staged: Path) -> Version:
    """Copy ``path`` to ``staged`` and hash what was copied, in one read: the copy is what gets uploaded, so the
    manifest's sha256 is exactly the uploaded bytes even while the function keeps writing the original."""
    digest, size = hashlib.sha256(), 0
    staged.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") as src, open(staged, "wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def put_hashed(store: Store, object_key: str, path: Path, staging: Path) -> Version:
    """Upload ``path`` and return the version uploaded: hashed, uploaded, and checked unchanged since; a file that
    changed meanwhile is uploaded again from a copy (``staging``: a free path), so the hash is what the store has."""
    before = _stat(path)
    version = hash_file(path)
    store.put_file(object_key, path)
    if _stat(path) == before:
        return version
    try:
        version = stage_file(path, staging)
        store.put_file(object_key, staging)
    finally:
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
    return version


def write_manifest(store: Store, prefix: str, files: Manifest, key: signing.KeyLike) -> None:
    """The signed manifest of the files under ``prefix`` (``key`` signs it; written after the files it lists)."""
    body = {"files": {rel: [list(v) for v in versions] for rel, versions in sorted(files.items())}}
    signing.put(store, files_manifest_key(prefix), json.dumps(body, sort_keys=True).encode(), key)


def read_manifest(store: Store, prefix: str, key: signing.KeyLike) -> Manifest | None:
    """The manifest of ``prefix`` once its signature checks out; None when there is none; TamperedObject when it is
    unsigned, forged, moved or malformed."""
    from kinetic_prefect.storage import ObjectNotFound

    manifest_key = files_manifest_key(prefix)
    try:
        data = signing.get(store, manifest_key, key)
    except ObjectNotFound:
        return None
    try:
        files = json.loads(data)["files"]
        manifest: Manifest = {
            _check_relative(rel): [(int(size), str(sha)) for size, sha in versions] for rel, versions in files.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        raise signing.TamperedObject(f"{store.url_for(manifest_key)} is not a files manifest") from None
    return manifest


def _check_relative(rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative path: {rel!r}")
    return rel


def check_file(path: Path, versions: list[Version], what: str) -> Version:
    """``path``'s version when the manifest lists it; TamperedObject naming ``what`` (the object) otherwise."""
    version = hash_file(path)
    if version not in versions:
        raise signing.TamperedObject(
            f"{what} does not match its signed manifest (size {version[0]}, sha256 {version[1]}; the manifest "
            f"lists {', '.join(f'size {s}, sha256 {h}' for s, h in versions)}): it was changed in the store after "
            "the job wrote it; refusing to use it"
        )
    return version


# --------------------------------------------------------------------------- the job's side


def upload_outputs(store: Store, prefix: str, output_dir: Path, key: signing.KeyLike) -> list[str]:
    """Every file under ``output_dir`` uploaded under ``prefix``; with a key, then the signed manifest (last: it
    marks them complete). Returns their relative paths; a folder's manifest name is not a name a file may take."""
    pairs = []
    for path in sorted(output_dir.rglob("*")):
        if path.is_file():
            rel = path.relative_to(output_dir).as_posix()
            if rel in RESERVED_NAMES:
                raise ValueError(
                    f"{Env.OUTPUT_DIR} holds {rel}, a name kinetic-prefect keeps for the outputs' own manifest: "
                    "rename the file"
                )
            pairs.append((rel, path))
    if not pairs:
        return []
    if key is None:
        store.put_tree(prefix, pairs)
        return [rel for rel, _ in pairs]
    staging = Path(tempfile.mkdtemp(prefix="kinetic-outputs-stage-", dir=os.environ.get(Env.JOB_DIR) or None))
    try:
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(32, len(pairs)), thread_name_prefix="kinetic-outputs"
        ) as pool:
            versions = list(
                pool.map(
                    lambda item: put_hashed(store, f"{prefix}/{item[1][0]}", item[1][1], staging / str(item[0])),
                    enumerate(pairs),
                )
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_manifest(store, prefix, {rel: [version] for (rel, _), version in zip(pairs, versions, strict=True)}, key)
    return [rel for rel, _ in pairs]


# --------------------------------------------------------------------------- the caller's side

_caller_key: signing.Keyring | None = None  # the master keys this process resolved (env or the Secret block)


def remember_key(key: signing.Keyring | None) -> None:
    """The caller's side tells this module the keys it resolved (``shared.key_blocks.signing_key``), so outputs are
    checked with them where only the Prefect Secret block holds the key."""
    global _caller_key
    if key is not None:
        _caller_key = key


def _refused(exc: signing.TamperedObject) -> Exception:
    from kinetic_prefect.errors import SigningKeyMismatch, StoreTampered

    if isinstance(exc, signing.KeyMismatch):
        return SigningKeyMismatch(str(exc))
    return StoreTampered(str(exc))


@contextlib.contextmanager
def _staging_beside(dest: Path) -> Iterator[Path]:
    """A temporary folder beside ``dest`` (on its file system, so the checked files move into place by rename; the
    system's temporary folder where that cannot be written), removed with whatever is left in it."""
    anchor = dest.absolute().parent
    while not anchor.exists():
        anchor = anchor.parent
    try:
        staging = Path(tempfile.mkdtemp(prefix=".kinetic-download-", dir=anchor))
    except OSError:
        staging = Path(tempfile.mkdtemp(prefix="kinetic-download-"))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class JobOutputs:
    """The outputs of one job: ``store`` is the store URL, ``run_id`` the job's run in it. ``signed``: the job held
    a signing key, so its outputs carry signed manifests and reading them needs the key."""

    store: str
    run_id: str
    local_dir: str | None = None  # set when the function ran as a plain call (no job, no upload)
    signed: bool = False

    @classmethod
    def current(cls) -> JobOutputs:
        """The outputs of the job this code runs in (outside a job: the local output folder, if any)."""
        store, run_id = settings.STORE.value(), os.environ.get(Env.RUN_ID)
        if store and run_id:
            return cls(store=store, run_id=run_id, signed=settings.SIGNING_KEY.value() is not None)
        return cls(store="", run_id="", local_dir=os.environ.get(Env.OUTPUT_DIR) or os.getcwd())

    def _store(self) -> Store:
        from kinetic_prefect.storage import open_store

        return open_store(self.store)

    def _key(self, key: signing.KeyLike) -> signing.Keyring | None:
        """The keys that check these outputs: ``key``, else this process's (its environment, else what the caller
        resolved); None for unsigned outputs read without a key."""
        ring = signing.as_keyring(key) if key is not None else (signing.key_from_env() or _caller_key)
        if ring is None and self.signed:
            from kinetic_prefect.errors import SigningKeyMissing

            raise SigningKeyMissing(
                f"the outputs of run {self.run_id} are signed, and this process has no signing key to check them "
                f"with: set {signing.KEY_ENV}, or pass key=, or read them in a flow that called kinetic tasks "
                f"(it reads the Prefect Secret block {signing.SECRET_BLOCK!r})"
            )
        return ring

    def _index(
        self, store: Store, ring: signing.Keyring, only: str | None = None
    ) -> dict[str, tuple[str, list[Version]]]:
        """Output name -> (its object, the versions its host's signed manifest lists): the coordinator's, and the
        other hosts' under ``hosts/<i>/`` (``only``: just the manifest that may list that name)."""
        layout = RunLayout(self.run_id)
        prefixes = [layout.outputs]
        if only is None:
            root = files_manifest_key(layout.outputs)
            for object_key in store.list(layout.outputs):
                if object_key.endswith("/" + FILES_MANIFEST_NAME) and object_key != root:
                    digits = [p for p in object_key[len(layout.outputs) + 1 :].split("/") if p.isdigit()]
                    if digits and object_key == layout.host_outputs_manifest(int(digits[0])):
                        prefixes.append(layout.host_outputs(int(digits[0])))
        else:
            parts = only.split("/")
            if (
                len(parts) > 2
                and parts[1].isdigit()
                and layout.output(only).startswith(layout.host_outputs(int(parts[1])) + "/")
            ):
                prefixes.append(layout.host_outputs(int(parts[1])))
        index: dict[str, tuple[str, list[Version]]] = {}
        try:
            for prefix in prefixes:
                for rel, versions in (read_manifest(store, prefix, ring) or {}).items():
                    name = f"{prefix}/{rel}"[len(layout.outputs) + 1 :]
                    index.setdefault(name, (f"{prefix}/{rel}", versions))
        except signing.TamperedObject as exc:
            raise _refused(exc) from None
        return index

    def names(self, *, key: signing.KeyLike = None) -> list[str]:
        """Relative paths of every output file (with a key: those the job's signed manifests list)."""
        if self.local_dir is not None:
            root = Path(self.local_dir)
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        store = self._store()
        ring = self._key(key)
        prefix = RunLayout(self.run_id).outputs + "/"
        held = sorted(
            k[len(prefix) :]
            for k in store.list(prefix)
            if k.startswith(prefix) and k.rsplit("/", 1)[-1] not in RESERVED_NAMES
        )
        if ring is None:
            return held
        listed = sorted(self._index(store, ring))
        if held and not listed:
            raise _refused(
                signing.TamperedObject(
                    f"{store.url_for(prefix.rstrip('/'))} holds {len(held)} file(s) and no signed manifest: they "
                    "were not written by a signed job (or its manifest was removed); refusing to list them"
                )
            )
        return listed

    def url(self, name: str) -> str:
        if self.local_dir is not None:
            return str(Path(self.local_dir) / name)
        return self._store().url_for(RunLayout(self.run_id).output(name))

    def download(self, name: str, dest_dir: str | os.PathLike[str], *, key: signing.KeyLike = None) -> Path:
        """Copy one output into ``dest_dir`` (keeping its relative path); returns the local path. Signed outputs are
        checked against their manifest first: a file that fails leaves nothing in ``dest_dir``."""
        return self._download([name], dest_dir, key)[0]

    def download_all(
        self,
        dest_dir: str | os.PathLike[str],
        include: Callable[[str], bool] = lambda name: True,
        *,
        key: signing.KeyLike = None,
    ) -> list[Path]:
        """Every output ``include`` accepts; signed outputs all checked before any lands in ``dest_dir``."""
        if self.local_dir is not None or self._key(key) is None:
            return [self.download(name, dest_dir, key=key) for name in self.names(key=key) if include(name)]
        return self._download(None, dest_dir, key, include)

    def _download(
        self,
        names: list[str] | None,
        dest_dir: str | os.PathLike[str],
        key: signing.KeyLike,
        include: Callable[[str], bool] = lambda name: True,
    ) -> list[Path]:
        dest = Path(dest_dir)
        if self.local_dir is not None:
            targets = []
            for name in names or []:
                target, source = dest / name, Path(self.local_dir) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                if source.resolve() != target.resolve():
                    shutil.copyfile(source, target)
                targets.append(target)
            return targets
        store = self._store()
        ring = self._key(key)
        layout = RunLayout(self.run_id)
        if ring is None:  # unsigned outputs: as the store has them
            targets = []
            for name in names or []:
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                store.get_file(layout.output(name), target)
                targets.append(target)
            return targets
        index = self._index(store, ring, only=names[0] if names and len(names) == 1 else None)
        if names is None:
            names = sorted(name for name in index if include(name))
        for name in names:
            if name not in index:
                raise _refused(
                    signing.TamperedObject(
                        f"{store.url_for(layout.output(name))} is not among the outputs the job's signed manifest "
                        "lists: it was not written by the job; refusing to download it"
                    )
                )
        with _staging_beside(dest) as staging:
            for i, name in enumerate(names):
                object_key, versions = index[name]
                store.get_file(object_key, staging / str(i))
                try:
                    check_file(staging / str(i), versions, store.url_for(object_key))
                except signing.TamperedObject as exc:
                    raise _refused(exc) from None
            targets = []
            for i, name in enumerate(names):
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(staging / str(i), target)
                targets.append(target)
        return targets
