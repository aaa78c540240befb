"""EuroSAT data: fetch, validate, decode once to uint8 arrays, and split.

Everything written to disk here appears atomically (a temporary sibling renamed into place), so an
interrupted run leaves either a complete cache entry or none, never a half-written one.

Layout accepted (the official ``EuroSAT_RGB.zip``, Zenodo record 7711810, and the shared dev/sample zips):
``<root>/<Class>/<image>.jpg`` where ``<root>`` is one top-level folder (``EuroSAT_RGB``) or nothing, in a
zip or in a directory. Every expected class must have a non-empty folder; a folder that is not an expected
class, an image outside a class folder, or an image that does not decode is an error naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

OFFICIAL_URL = "https://zenodo.org/records/7711810/files/EuroSAT_RGB.zip"
# Zenodo publishes an md5 per file: this is EuroSAT_RGB.zip's in record 7711810 (the value torchvision-style
# EuroSAT loaders check). Pass ``checksum="sha256:..."`` to pin the exact bytes instead.
OFFICIAL_CHECKSUM = "md5:f46e308c4d50d4bf32fedad2d3d62f3b"

CLASS_NAMES = (
    "AnnualCrop",
    "Forest",
    "HerbaceousVegetation",
    "Highway",
    "Industrial",
    "Pasture",
    "PermanentCrop",
    "Residential",
    "River",
    "SeaLake",
)
IMAGE_SIZE = 64
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".tif", ".tiff")
_IGNORED_PARTS = ("__MACOSX",)
FORMAT_VERSION = 1  # bump when the decoded layout changes: old cache entries are then ignored


class DatasetError(ValueError):
    """A problem with the input data; ``path`` names the offending file or folder (``None`` if none)."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class ChecksumMismatch(DatasetError):
    pass


# ------------------------------------------------------------------------------------------- atomic helpers


def atomic_write_bytes(dest: Path, data: bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".kp-tmp.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


def atomic_write_json(dest: Path, value) -> None:
    atomic_write_bytes(dest, json.dumps(value, indent=1, sort_keys=True).encode())


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def _publish_dir(staging: Path, target: Path) -> Path:
    """Rename a fully written staging directory into place; if another writer won, keep theirs."""
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / "COMPLETE").exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------- checksums


def parse_checksum(checksum: str | None) -> tuple[str, str] | None:
    """``"sha256:<hex>"``, ``"md5:<hex>"`` or a bare hex digest (64 chars: sha256, 32: md5)."""
    if not checksum:
        return None
    text = checksum.strip().lower()
    if ":" in text:
        algo, _, digest = text.partition(":")
    else:
        algo, digest = {64: "sha256", 32: "md5"}.get(len(text), "?"), text
    if algo not in ("sha256", "md5") or not digest or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"checksum {checksum!r}: expected 'sha256:<hex>', 'md5:<hex>' or a bare hex digest")
    return algo, digest


def file_digests(path: Path) -> dict[str, str]:
    sha, md5 = hashlib.sha256(), hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            sha.update(block)
            md5.update(block)
    return {"sha256": sha.hexdigest(), "md5": md5.hexdigest()}


def verify_checksum(path: Path, checksum: str | None) -> str:
    """Check ``path`` against ``checksum`` (if any); returns its sha256."""
    digests = file_digests(path)
    expected = parse_checksum(checksum)
    if expected is not None and digests[expected[0]] != expected[1]:
        raise ChecksumMismatch(
            f"{path}: {expected[0]} is {digests[expected[0]]}, expected {expected[1]} "
            "(a truncated or different download?)",
            str(path),
        )
    return digests["sha256"]


# ------------------------------------------------------------------------------------------- fetching


def default_cache_dir() -> Path:
    from kinetic_prefect.config import cache_dir

    explicit = os.environ.get("EUROSAT_CACHE_DIR")
    return Path(explicit).expanduser() if explicit else cache_dir() / "eurosat"


def source_fingerprint(source: str) -> str:
    """What identifies a source for caching besides its name: size+mtime of a local file or folder."""
    if "://" in source and not source.startswith("file://"):
        return ""
    path = Path(_local(source))
    if path.is_file():
        st = path.stat()
        return f"file:{st.st_size}:{st.st_mtime_ns}"
    if path.is_dir():
        latest, count = 0, 0
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                count += 1
                latest = max(latest, os.stat(os.path.join(dirpath, name)).st_mtime_ns)
        return f"dir:{count}:{latest}"
    return "missing"


def _local(source: str) -> str:
    if source.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlsplit(source).path)
    return os.path.expanduser(source)


@dataclass(frozen=True)
class Fetched:
    """A verified local copy of the source: a zip file or a directory."""

    path: str
    kind: str  # "zip" or "dir"
    sha256: str  # of the zip file; of the (relative path, content) list for a directory
    source: str

    def as_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "sha256": self.sha256, "source": self.source}


def _download_http(url: str, dest: Path, checksum: str | None, timeout: float = 60.0) -> str:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".kp-tmp.")
    try:
        with os.fdopen(fd, "wb") as fh, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, fh, 1 << 20)
        sha = verify_checksum(Path(tmp), checksum)
        os.replace(tmp, dest)
        return sha
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


def _download_gcs(url: str, dest: Path, checksum: str | None) -> tuple[str, str]:
    """A gs:// object (a zip) or prefix (a directory tree) through kinetic-prefect's storage layer.

    Returns (kind, sha256). A zip is verified before it is renamed into place; a tree appears by one rename.
    """
    from kinetic_prefect.storage import ObjectNotFound, open_store

    parsed = urllib.parse.urlsplit(url)
    bucket, key = parsed.netloc, parsed.path.strip("/")
    store = open_store(f"gs://{bucket}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if key and store.exists(key):
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".kp-tmp.")
        os.close(fd)
        try:
            store.get_file(key, tmp)
            sha = verify_checksum(Path(tmp), checksum)
            os.replace(tmp, dest)
            return "zip", sha
        except BaseException:
            with _suppress():
                os.unlink(tmp)
            raise
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".kp-tmp."))
    try:
        count = store.get_tree(key, staging)
        if not count:
            raise DatasetError(f"{url}: no such object or folder in the bucket", url)
        sha = directory_digest(staging)
        (staging / "COMPLETE").write_text(url)
        _publish_dir(staging, dest)
        return "dir", sha
    except ObjectNotFound as exc:
        raise DatasetError(f"{url}: no such object or folder in the bucket", url) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(source: str, checksum: str | None = None, cache_dir: str | Path | None = None) -> Fetched:
    """Make ``source`` available locally and verify it.

    ``source``: an http(s) URL of a zip (the official one by default), ``gs://bucket/path`` (a zip object or
    a folder), or a local zip file / directory (``file://`` accepted). ``checksum`` (``sha256:...`` or
    ``md5:...``) is verified for zips; downloads land in ``cache_dir/downloads`` atomically.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if source == OFFICIAL_URL and checksum is None:
        checksum = OFFICIAL_CHECKSUM
    if source.startswith(("http://", "https://")):
        name = PurePosixPath(urllib.parse.urlsplit(source).path).name or "download.zip"
        dest = cache / "downloads" / hashlib.sha256(source.encode()).hexdigest()[:16] / name
        if dest.is_file():
            sha = verify_checksum(dest, checksum)
        else:
            try:
                sha = _download_http(source, dest, checksum)
            except ChecksumMismatch:
                raise
            except OSError as exc:
                raise DatasetError(
                    f"could not download {source}: {exc}. Download it yourself and pass the local "
                    "zip (or a gs:// copy) as the source.",
                    source,
                ) from exc
        return Fetched(str(dest), "zip", sha, source)
    if source.startswith("gs://"):
        name = PurePosixPath(urllib.parse.urlsplit(source).path).name or "data"
        dest = cache / "downloads" / hashlib.sha256(source.encode()).hexdigest()[:16] / name
        if dest.is_file():
            return Fetched(str(dest), "zip", verify_checksum(dest, checksum), source)
        if (dest / "COMPLETE").exists():
            return Fetched(str(dest), "dir", directory_digest(dest), source)
        kind, sha = _download_gcs(source, dest, checksum)
        return Fetched(str(dest), kind, sha, source)
    path = Path(_local(source)).resolve()
    if path.is_dir():
        return Fetched(str(path), "dir", directory_digest(path), source)
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise DatasetError(f"{path} is neither a zip file nor a directory", str(path))
        return Fetched(str(path), "zip", verify_checksum(path, checksum), source)
    raise DatasetError(
        f"data source {source!r} does not exist (expected a URL, gs://..., a zip or a directory)", source
    )


def directory_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "COMPLETE"):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------- layout + decoding


@dataclass
class Entry:
    member: str  # path inside the zip/dir, '/'-separated
    label: int


def _list_members(fetched: Fetched) -> tuple[list[str], list[str]]:
    """(files, directories), '/'-separated and relative to the source root."""
    if fetched.kind == "zip":
        try:
            with zipfile.ZipFile(fetched.path) as zf:
                infos = zf.infolist()
        except zipfile.BadZipFile as exc:
            raise DatasetError(f"{fetched.path} is not a readable zip file: {exc}", fetched.path) from exc
        files = [i.filename for i in infos if not i.is_dir()]
        dirs = [i.filename.rstrip("/") for i in infos if i.is_dir()]
    else:
        root = Path(fetched.path)
        files, dirs = [], []
        for dirpath, dirnames, names in os.walk(root):
            rel = Path(dirpath).relative_to(root).as_posix()
            prefix = "" if rel == "." else rel + "/"
            dirs += [prefix + d for d in dirnames]
            files += [prefix + n for n in names if not (prefix == "" and n == "COMPLETE")]
    # implied directories (zips often omit directory entries)
    for f in files:
        parts = f.split("/")
        dirs += ["/".join(parts[:i]) for i in range(1, len(parts))]
    skip = lambda p: any(part.startswith(".") or part in _IGNORED_PARTS for part in p.split("/"))  # noqa: E731
    return sorted(f for f in set(files) if not skip(f)), sorted(d for d in set(dirs) if not skip(d))


def index_layout(fetched: Fetched, class_names: tuple[str, ...] = CLASS_NAMES) -> tuple[list[Entry], str]:
    """Check the ``<root>/<Class>/<image>`` layout; returns the images with labels and the root prefix."""
    where = fetched.path
    files, dirs = _list_members(fetched)
    images = [f for f in files if f.lower().endswith(IMAGE_SUFFIXES)]
    if not images:
        raise DatasetError(
            f"{where}: no images found (expected <root>/<Class>/<image>.jpg with classes {', '.join(class_names)})",
            where,
        )
    top = {f.split("/")[0] for f in images}
    # the root: one top-level folder that holds the class folders, or the top level itself
    if len(top) == 1 and (root := next(iter(top))) not in class_names and all(f.count("/") >= 2 for f in images):
        prefix = root + "/"
    else:
        prefix = ""
    if (
        not prefix
        and len(top) == 1
        and (root := next(iter(top))) not in class_names
        and all(f.count("/") == 1 for f in images)
    ):
        raise DatasetError(
            f"{where}: wrong layout: the images are directly inside {root + '/'!r} (e.g. {images[0]!r}); expected "
            f"one sub-folder per class: {root}/<Class>/<image>.jpg",
            images[0],
        )
    class_index = {name: i for i, name in enumerate(class_names)}
    entries = []
    for f in images:
        rel = f[len(prefix) :] if f.startswith(prefix) else f
        parts = rel.split("/")
        if len(parts) != 2:
            raise DatasetError(
                f"{where}: wrong layout: image {f!r} is not directly inside a class folder "
                f"(expected {prefix or ''}<Class>/<image>.jpg, e.g. EuroSAT_RGB/Forest/Forest_1.jpg)",
                f,
            )
        cls = parts[0]
        if cls not in class_index:
            raise DatasetError(
                f"{where}: unknown class {cls!r} (folder {prefix}{cls}/, e.g. {f!r}); expected one of "
                f"{', '.join(class_names)}",
                f,
            )
        entries.append(Entry(f, class_index[cls]))
    non_images = [
        f
        for f in files
        if f.startswith(prefix) and f.count("/") - prefix.count("/") == 1 and not f.lower().endswith(IMAGE_SUFFIXES)
    ]
    if non_images:
        raise DatasetError(
            f"{where}: {non_images[0]!r} is not an image (expected {', '.join(IMAGE_SUFFIXES)})", non_images[0]
        )
    counts = np.bincount([e.label for e in entries], minlength=len(class_names))
    dir_set = set(dirs)
    for name, count in zip(class_names, counts):
        if count == 0:
            folder = f"{prefix}{name}"
            state = "is empty" if folder in dir_set else "is missing"
            raise DatasetError(
                f"{where}: class folder {folder!r} {state} (every class needs at least one image)", folder
            )
    extra_dirs = [
        d
        for d in dirs
        if d.startswith(prefix)
        and d.count("/") == prefix.count("/")
        and d[len(prefix) :] not in class_index
        and d[len(prefix) :]
    ]
    if extra_dirs:
        d = extra_dirs[0]
        raise DatasetError(
            f"{where}: unknown class folder {d!r} (it holds no images); expected only {', '.join(class_names)}", d
        )
    entries.sort(key=lambda e: (e.label, _natural_key(e.member)))
    return entries, prefix


def _natural_key(name: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_members(fetched: Fetched, members: list[str]) -> Iterator[tuple[str, bytes]]:
    if fetched.kind == "zip":
        with zipfile.ZipFile(fetched.path) as zf:
            for m in members:
                try:
                    yield m, zf.read(m)
                except (zipfile.BadZipFile, OSError, EOFError) as exc:  # e.g. a CRC error
                    raise DatasetError(f"cannot read {m!r} from {fetched.path}: {exc}", m) from exc
    else:
        root = Path(fetched.path)
        for m in members:
            try:
                yield m, (root / m).read_bytes()
            except OSError as exc:
                raise DatasetError(f"cannot read {root / m}: {exc}", str(root / m)) from exc


def decode_image(data: bytes, name: str, size: int = IMAGE_SIZE) -> np.ndarray:
    """A (size, size, 3) uint8 array; a file that does not decode fully is an error naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # full decode: a truncated JPEG fails here, not later
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DatasetError(f"corrupt or unreadable image {name!r}: {type(exc).__name__}: {exc}", name) from exc
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


def decode_all(
    fetched: Fetched, entries: list[Entry], size: int = IMAGE_SIZE, workers: int | None = None
) -> np.ndarray:
    """Decode every image; JPEG decoding runs on a thread per core (Pillow releases the GIL while decoding).
    The first image that fails is reported by name, as in a sequential decode."""
    from concurrent.futures import ThreadPoolExecutor

    images = np.empty((len(entries), size, size, 3), dtype=np.uint8)
    workers = workers or max(1, min(8, os.cpu_count() or 1))

    def one(item):
        i, (member, data) = item
        images[i] = decode_image(data, f"{fetched.path}:{member}" if fetched.kind == "zip" else member, size)

    members = enumerate(_read_members(fetched, [e.member for e in entries]))
    if workers == 1:
        for item in members:
            one(item)
        return images
    with ThreadPoolExecutor(workers) as pool:
        batch = []
        for item in members:
            batch.append(item)
            if len(batch) == 512:
                list(pool.map(one, batch))  # raises the first failure in order
                batch = []
        list(pool.map(one, batch))
    return images


@dataclass(frozen=True)
class Decoded:
    """The decoded dataset on disk: ``images.npy`` (N,64,64,3) uint8, ``labels.npy``, ``meta.json``."""

    path: str
    sha256: str  # identity of the decoded content (source sha + class list + format)
    num_images: int
    class_names: tuple[str, ...]
    class_counts: tuple[int, ...]

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "num_images": self.num_images,
            "class_names": list(self.class_names),
            "class_counts": list(self.class_counts),
        }


def prepare(
    fetched: Fetched,
    cache_dir: str | Path | None = None,
    class_names: tuple[str, ...] = CLASS_NAMES,
    image_size: int = IMAGE_SIZE,
) -> Decoded:
    """Validate and decode every image once into ``cache_dir/decoded/<key>/`` (reused when present)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha256(json.dumps([fetched.sha256, list(class_names), image_size, FORMAT_VERSION]).encode())
    key = key.hexdigest()
    target = cache / "decoded" / key[:24]
    if (target / "COMPLETE").exists():
        meta = json.loads((target / "meta.json").read_text())
        return Decoded(str(target), key, meta["num_images"], tuple(meta["class_names"]), tuple(meta["class_counts"]))
    entries, prefix = index_layout(fetched, class_names)
    images = decode_all(fetched, entries, image_size)
    labels = np.array([e.label for e in entries], dtype=np.int32)
    counts = tuple(int(c) for c in np.bincount(labels, minlength=len(class_names)))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".kp-tmp."))
    try:
        np.save(staging / "images.npy", images)
        np.save(staging / "labels.npy", labels)
        meta = {
            "class_names": list(class_names),
            "num_images": len(entries),
            "class_counts": list(counts),
            "files": [e.member for e in entries],
            "source": fetched.source,
            "source_sha256": fetched.sha256,
            "root": prefix,
            "image_size": image_size,
            "format": FORMAT_VERSION,
        }
        (staging / "meta.json").write_text(json.dumps(meta))
        (staging / "COMPLETE").write_text(key)
        _publish_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Decoded(str(target), key, len(entries), tuple(class_names), counts)


def load_decoded(path: str | Path, mmap: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise DatasetError(f"{path} is not a complete decoded EuroSAT dataset (no COMPLETE marker)", str(path))
    images = np.load(path / "images.npy", mmap_mode="r" if mmap else None)
    labels = np.load(path / "labels.npy")
    meta = json.loads((path / "meta.json").read_text())
    return images, labels, meta


# ------------------------------------------------------------------------------------------- splitting


def stratified_split(
    labels: np.ndarray, val_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 0
) -> dict[str, np.ndarray]:
    """Per class: shuffle with ``seed``, then cut test, validation, train. Disjoint and deterministic."""
    if not (0 <= val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"bad split fractions val={val_fraction}, test={test_fraction}")
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        idx = idx[rng.permutation(len(idx))]
        n_test = max(1, int(round(len(idx) * test_fraction)))
        n_val = int(round(len(idx) * val_fraction))
        if val_fraction > 0:
            n_val = max(1, n_val)
        if n_test + n_val >= len(idx):
            raise DatasetError(
                f"class {int(cls)} has only {len(idx)} images: too few to split "
                f"(val {val_fraction}, test {test_fraction})"
            )
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test : n_test + n_val])
        parts["train"].append(idx[n_test + n_val :])
    split = {k: np.sort(np.concatenate(v)).astype(np.int64) for k, v in parts.items()}
    assert not (set(split["train"]) & set(split["test"])) and not (set(split["val"]) & set(split["test"]))
    return split


def save_split(
    decoded: Decoded, val_fraction: float, test_fraction: float, seed: int, cache_dir: str | Path | None = None
) -> tuple[str, dict[str, int]]:
    """Compute the split once and store it as ``split-<key>.npz`` beside the decoded data (atomically)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha256(json.dumps([decoded.sha256, val_fraction, test_fraction, seed]).encode()).hexdigest()[:24]
    target = cache / "splits" / f"split-{key}.npz"
    if not target.exists():
        labels = np.load(Path(decoded.path) / "labels.npy")
        split = stratified_split(labels, val_fraction, test_fraction, seed)
        buffer = io.BytesIO()
        np.savez(buffer, **split)
        atomic_write_bytes(target, buffer.getvalue())
    with np.load(target) as z:
        sizes = {k: int(z[k].shape[0]) for k in ("train", "val", "test")}
    return str(target), sizes


def load_split(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in ("train", "val", "test")}
