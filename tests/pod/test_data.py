"""kinetic_prefect.pod.data: Data validation, content hashing, upload to the store and localize on the job side,
against a local directory store and a fake-gcs-server bucket."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest

from kinetic_prefect.pod import data as kd
from kinetic_prefect.pod import data_manifest
from kinetic_prefect.pod.data import (
    Data,
    DataError,
    DataRef,
    Manifest,
    find,
    hash_local,
    localize,
    to_ref,
    transform,
    upload,
)
from kinetic_prefect.storage import GCSStore, LocalStore, Store, open_store

REPO = pathlib.Path(__file__).resolve().parents[2]


def make_tree(root: pathlib.Path) -> pathlib.Path:
    files = {
        "a.txt": b"alpha\n",
        "empty.bin": b"",
        "sub/b.bin": bytes(range(256)) * 10,
        "sub/deeper/c.txt": b"gamma",
        "big.bin": os.urandom(300 * 1024),  # over the thread-pool threshold
        "spaced name é.txt": b"unicode names travel too",
    }
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return root


def read_tree(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(params=["local", "gcs"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return open_store(tmp_path / "store")
    return open_store(f"{request.getfixturevalue('gcs_bucket')}/kinetic")


@pytest.fixture
def tree(tmp_path) -> pathlib.Path:
    return make_tree(tmp_path / "dataset")


@pytest.fixture(autouse=True)
def _fresh_memo():
    data_manifest.forget_hashes()
    yield
    data_manifest.forget_hashes()


def count_calls(monkeypatch, obj, *names: str) -> list:
    """Wrap obj.<name> for each name; every call is appended (name, args) to the one returned list."""
    calls: list = []
    for name in names:
        _wrap(monkeypatch, obj, name, calls)
    return calls


def _wrap(monkeypatch, obj, name: str, calls: list) -> None:
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append((name, args))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


# --- Data: validation -------------------------------------------------------------------------------------------


def test_data_attributes(tree, tmp_path, monkeypatch):
    d = Data(tree)
    assert d.source == str(tree) and not d.is_remote and d.local_path == tree and d.kind == "dir"
    assert repr(d) == f"Data({str(tree)!r})"
    monkeypatch.chdir(tmp_path)
    rel = Data("dataset/a.txt")
    assert rel.local_path == tree / "a.txt" and rel.kind == "file" and rel.source == "dataset/a.txt"
    assert Data(f"file://{tree}") == d and hash(Data(str(tree))) == hash(d)
    remote = Data("gs://bucket/some/prefix/")
    assert remote.is_remote and remote.local_path is None and remote.source == "gs://bucket/some/prefix/"
    assert pickle.loads(pickle.dumps(d)) == d


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope" / "data.csv"
    with pytest.raises(DataError, match="does not exist") as info:
        Data(missing)
    assert str(missing) in str(info.value) and isinstance(info.value, ValueError)


def test_empty_directory_even_with_empty_subdirs(tmp_path):
    empty = tmp_path / "empty"
    (empty / "a" / "b").mkdir(parents=True)
    (empty / "c").mkdir()
    with pytest.raises(DataError, match="empty") as info:
        Data(empty)
    assert str(empty) in str(info.value)


def deny_reads(monkeypatch, victim: pathlib.Path) -> None:
    """Make one path unreadable as root would not be stopped by chmod: os.access and os.open refuse it."""
    real_access, real_open = os.access, os.open

    def access(path, mode, *args, **kwargs):
        if os.fspath(path) == str(victim) and mode & os.R_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == str(victim):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(kd.os, "access", access)
    monkeypatch.setattr(kd.os, "open", open_)


def test_unreadable_file_names_it(tree, monkeypatch):
    victim = tree / "sub" / "b.bin"
    data = Data(tree)  # readable now
    file_data = Data(victim)
    deny_reads(monkeypatch, victim)
    for make in (lambda: Data(tree), lambda: Data(victim), lambda: hash_local(data), lambda: hash_local(file_data)):
        with pytest.raises(DataError, match="not readable") as info:
            make()
        assert str(victim) in str(info.value) and "chmod" in str(info.value)


def test_unreadable_single_file_open_fails(tmp_path, monkeypatch):
    victim = tmp_path / "x.bin"
    victim.write_bytes(b"x")
    real_open = open

    def open_(path, *args, **kwargs):
        if os.fspath(path) == str(victim):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_)
    with pytest.raises(DataError, match="not readable") as info:
        Data(victim)
    assert str(victim) in str(info.value)


def test_broken_symlink_and_symlink_loop(tree):
    link = tree / "sub" / "dangling.jpg"
    link.symlink_to(tree / "gone.jpg")
    with pytest.raises(DataError, match="broken symbolic link") as info:
        Data(tree)
    assert str(link) in str(info.value)
    link.unlink()
    (tree / "sub" / "loop").symlink_to(tree)
    with pytest.raises(DataError, match="symlink loop"):
        Data(tree)
    (tree / "sub" / "loop").unlink()
    top_link = tree.parent / "link-to-nothing"
    top_link.symlink_to(tree.parent / "nothing")
    with pytest.raises(DataError, match="broken symbolic link") as info:
        Data(top_link)
    assert str(top_link) in str(info.value)


def test_bad_urls():
    for url in ("s3://bucket/x", "gs://", "gs://bucket/a/../b", "http://example.com/x"):
        with pytest.raises(DataError) as info:
            Data(url)
        assert url in str(info.value)


# --- hashing ----------------------------------------------------------------------------------------------------


def test_hash_depends_on_relative_paths_and_bytes_only(tree, tmp_path):
    first = hash_local(Data(tree))
    copy = tmp_path / "elsewhere" / "renamed-root"
    shutil.copytree(tree, copy)
    for path in copy.rglob("*"):
        os.utime(path, ns=(1, 1))  # other mtimes
    (copy / "a.txt").chmod(0o600)
    second = hash_local(Data(copy))
    assert second.sha256 == first.sha256 and second.files == first.files and second.root == copy
    assert first.kind == "dir" and first.total_bytes == sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    assert [rel for rel, _s, _h in first.files] == sorted(read_tree(tree))

    (copy / "sub" / "b.bin").write_bytes(b"\x01" + (copy / "sub" / "b.bin").read_bytes()[1:])  # one byte
    assert hash_local(Data(copy)).sha256 != first.sha256
    shutil.rmtree(copy)
    shutil.copytree(tree, copy)
    assert hash_local(Data(copy)).sha256 == first.sha256
    (copy / "sub" / "b.bin").rename(copy / "sub" / "b2.bin")  # same bytes, another relative path
    assert hash_local(Data(copy)).sha256 != first.sha256
    (copy / "sub" / "b2.bin").rename(copy / "b.bin")  # moved up a level
    assert hash_local(Data(copy)).sha256 != first.sha256


def test_file_hash(tree, tmp_path):
    m = hash_local(Data(tree / "a.txt"))
    assert m.kind == "file" and m.files == (("a.txt", 6, hashlib.sha256(b"alpha\n").hexdigest()),)
    (tmp_path / "other").mkdir()
    shutil.copy(tree / "a.txt", tmp_path / "other" / "a.txt")
    shutil.copy(tree / "a.txt", tmp_path / "other" / "b.txt")
    assert hash_local(Data(tmp_path / "other" / "a.txt")).sha256 == m.sha256
    assert hash_local(Data(tmp_path / "other" / "b.txt")).sha256 != m.sha256  # the name is part of a file's data
    # a directory holding just that file is other data than the file
    solo = tmp_path / "solo"
    solo.mkdir()
    shutil.copy(tree / "a.txt", solo / "a.txt")
    assert hash_local(Data(solo)).sha256 != m.sha256


def test_hash_memoized_in_process(tree, monkeypatch):
    calls = count_calls(monkeypatch, data_manifest, "_hash_file")
    data = Data(tree)
    first = hash_local(data)
    assert len(calls) == len(first.files)
    second = hash_local(data)
    assert second == first and len(calls) == len(first.files)  # nothing re-read
    (tree / "a.txt").write_bytes(b"ALPHA\n")  # same size: the mtime/ctime in the key catch it
    third = hash_local(data)
    assert len(calls) == len(first.files) + 1 and third.sha256 != first.sha256


def test_file_changed_between_hash_and_upload(tree, tmp_path):
    manifest = hash_local(Data(tree))
    (tree / "a.txt").write_bytes(b"different length now")
    store = open_store(tmp_path / "store")
    with pytest.raises(DataError, match="changed between hashing and upload") as info:
        upload(manifest, store)
    assert str(tree / "a.txt") in str(info.value)
    assert not store.exists(f"data/{manifest.sha256}/manifest.json")


def test_manifest_json_round_trip(tree):
    m = hash_local(Data(tree))
    again = Manifest.from_json(m.to_json(), m.root)
    assert again == m and again.kind == "dir"


# --- upload -----------------------------------------------------------------------------------------------------


def test_upload_once(store, tree, monkeypatch):
    manifest = hash_local(Data(tree))
    assert upload(manifest, store) == manifest.total_bytes
    prefix = f"data/{manifest.sha256}"
    keys = store.list(prefix)
    assert keys == sorted([f"{prefix}/manifest.json"] + [f"{prefix}/files/{rel}" for rel, _s, _h in manifest.files])
    marker = store.get_bytes(f"{prefix}/manifest.json")
    assert Manifest.from_json(marker, tree) == manifest
    assert store.get_bytes(f"{prefix}/files/sub/b.bin") == (tree / "sub" / "b.bin").read_bytes()

    puts = count_calls(monkeypatch, store, "put_file", "put_bytes", "put_tree")
    again = hash_local(Data(tree))
    assert upload(again, store) == 0
    assert puts == [] and store.list(prefix) == keys
    assert store.get_bytes(f"{prefix}/manifest.json") == marker


def test_upload_single_file(store, tree):
    manifest = hash_local(Data(tree / "big.bin"))
    assert upload(manifest, store) == 300 * 1024
    assert store.list(f"data/{manifest.sha256}") == [
        f"data/{manifest.sha256}/files/big.bin",
        f"data/{manifest.sha256}/manifest.json",
    ]
    assert upload(manifest, store) == 0


def test_crashed_upload_leaves_no_marker(store, tree, monkeypatch):
    manifest = hash_local(Data(tree))
    marker = f"data/{manifest.sha256}/manifest.json"
    real_put_file = store.put_file
    done = []

    def flaky(key, path, **kwargs):
        if len(done) >= 3:
            raise ConnectionError("network dropped mid-upload")
        done.append(key)
        return real_put_file(key, path, **kwargs)

    monkeypatch.setattr(store, "put_file", flaky)
    with pytest.raises(ConnectionError):
        upload(manifest, store, workers=2)
    assert not store.exists(marker)
    assert 0 < len(store.list(f"data/{manifest.sha256}")) < len(manifest.files)
    monkeypatch.undo()

    assert upload(manifest, store) == manifest.total_bytes  # files are rewritten, then the marker goes last
    assert store.exists(marker)
    assert len(store.list(f"data/{manifest.sha256}")) == len(manifest.files) + 1
    assert upload(manifest, store) == 0


# --- localize ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_localize_round_trip(store, tree, tmp_path, monkeypatch, kind):
    data = Data(tree if kind == "dir" else tree / "sub" / "b.bin")
    manifest = hash_local(data)
    ref = to_ref(data, manifest)
    assert ref == DataRef(
        kind=kind, name=data.local_path.name, sha256=manifest.sha256, key=f"data/{manifest.sha256}", url=None
    )
    assert pickle.loads(pickle.dumps(ref)) == ref
    upload(manifest, store)
    node_cache = tmp_path / "node"

    downloads = count_calls(monkeypatch, store, "get_tree", "get_file", "get_bytes")
    path = localize(ref, store, node_cache)
    if kind == "dir":
        assert read_tree(path) == read_tree(tree)
    else:
        assert path.name == "b.bin" and path.read_bytes() == (tree / "sub" / "b.bin").read_bytes()

    if isinstance(store, LocalStore):  # read in place: no copy, nothing in the node cache
        assert path.is_relative_to(store.root) and not node_cache.exists() and downloads == []
    else:
        assert path.is_relative_to(node_cache / "data" / manifest.sha256) and downloads
        n = len(downloads)
        assert localize(ref, store, node_cache) == path  # a second job on the node
        assert len(downloads) == n
        assert [p.name for p in (node_cache / "data").iterdir()] == [manifest.sha256]  # no staging left over


def test_localize_not_uploaded(store, tree, tmp_path):
    data = Data(tree)
    ref = to_ref(data, hash_local(data))
    with pytest.raises(DataError, match="is not in the store") as info:
        localize(ref, store, tmp_path / "node")
    assert ref.sha256 in str(info.value)


def test_localize_detects_damaged_copy(gcs_bucket, tree, tmp_path):
    store = open_store(gcs_bucket)
    data = Data(tree)
    manifest = hash_local(data)
    upload(manifest, store)
    store.put_bytes(f"data/{manifest.sha256}/files/a.txt", b"tampered")
    with pytest.raises(DataError, match="does not match its content hash") as info:
        localize(to_ref(data, manifest), store, tmp_path / "node")
    assert "a.txt" in str(info.value)
    assert not (tmp_path / "node" / "data" / manifest.sha256).exists()


def test_localize_gs_urls(gcs_bucket, tmp_path, monkeypatch):
    bucket = open_store(gcs_bucket)
    bucket.put_bytes("raw/one.csv", b"x,y\n1,2\n")
    bucket.put_bytes("raw/images/cat.jpg", b"\xff\xd8 cat")
    bucket.put_bytes("raw/images/dog.jpg", b"\xff\xd8 dog")
    from kinetic_prefect.storage import _gcs_client

    # a console "folder" placeholder: not a valid store key, so through the client
    _gcs_client().bucket(bucket.bucket_name).blob("raw/images/").upload_from_string(b"")
    bucket.put_bytes("rawhide/other.csv", b"not under raw/")
    node_cache = tmp_path / "node"
    gets = count_calls(monkeypatch, GCSStore, "get_file")

    file_ref = to_ref(Data(f"{gcs_bucket}/raw/one.csv"), None)
    assert file_ref == DataRef(kind="file", name="one.csv", sha256=None, key=None, url=f"{gcs_bucket}/raw/one.csv")
    path = localize(file_ref, bucket, node_cache)
    assert path.name == "one.csv" and path.read_bytes() == b"x,y\n1,2\n"

    for url in (f"{gcs_bucket}/raw/", f"{gcs_bucket}/raw"):  # with or without the slash: a prefix
        ref = to_ref(Data(url), None)
        assert ref.name == "raw" and ref.sha256 is None and ref.url == url
        path = localize(ref, bucket, node_cache)
        assert read_tree(path) == {
            "one.csv": b"x,y\n1,2\n",
            "images/cat.jpg": b"\xff\xd8 cat",
            "images/dog.jpg": b"\xff\xd8 dog",
        }

    n = len(gets)
    assert localize(to_ref(Data(f"{gcs_bucket}/raw/"), None), bucket, node_cache).is_dir()
    assert localize(file_ref, bucket, node_cache).read_bytes() == b"x,y\n1,2\n"
    assert len(gets) == n  # cached on the node

    for empty in (f"{gcs_bucket}/nothing/here/", f"{gcs_bucket}/raw/missing.csv"):
        with pytest.raises(DataError, match="no objects") as info:
            localize(to_ref(Data(empty), None), bucket, node_cache)
        assert empty in str(info.value)


# --- transform / find -------------------------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Config:
    data: Data
    epochs: int = 3
    extra: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.data, Data):  # transform must not re-run this
            raise TypeError("data must be Data")


@dataclasses.dataclass(frozen=True)
class Frozen:
    data: Data
    derived: str = dataclasses.field(init=False, default="set-later")


def test_transform_and_find(tree):
    a, b, c = Data(tree), Data(tree / "a.txt"), Data("gs://bucket/x/")
    untouched = {"k": [1, 2, (3, "four")]}
    obj = {
        "list": [a, 1, "s"],
        "tuple": (b, untouched),
        "pair": Pair(a, 2),
        "set": {c, 5},
        "frozen": frozenset({b}),
        "config": Config(a, extra=[c]),
        "frozen_dc": Frozen(b),
        "default": collections.defaultdict(list, x=[c]),
        "untouched": untouched,
        "cls": Config,
    }
    obj["list"].append(obj["list"])  # a cycle must not hang the walk
    assert [id(x) for x in find(obj, Data)] == [id(a), id(b), id(c)]  # each distinct instance once, in order met

    out = transform(obj, lambda d: f"<{d.source}>", Data)
    assert out["list"][:3] == [f"<{a.source}>", 1, "s"]
    assert out["tuple"][0] == f"<{b.source}>" and out["tuple"][1] is untouched
    assert type(out["pair"]) is Pair and out["pair"] == Pair(f"<{a.source}>", 2)
    assert out["set"] == {"<gs://bucket/x/>", 5} and out["frozen"] == frozenset({f"<{b.source}>"})
    assert type(out["config"]) is Config and out["config"].data == f"<{a.source}>"
    assert out["config"].extra == ["<gs://bucket/x/>"] and out["config"].epochs == 3
    assert type(out["frozen_dc"]) is Frozen and out["frozen_dc"].data == f"<{b.source}>"
    assert out["frozen_dc"].derived == "set-later"
    assert type(out["default"]) is collections.defaultdict and out["default"]["x"] == ["<gs://bucket/x/>"]
    assert out["untouched"] is untouched and out["cls"] is Config
    # the input is not modified
    assert obj["list"][0] is a and obj["config"].data is a and obj["frozen_dc"].data is b

    nothing = {"a": [1, (2, 3)], "b": Pair(1, 2), "c": Config.__new__(Config)}
    assert transform(nothing, lambda d: 1 / 0, Data) is nothing
    assert find(nothing, Data) == []
    assert transform(a, lambda d: "x", Data) == "x"


def test_transform_to_refs(tree):
    data = Data(tree)
    refs = transform([data, {"again": data}], lambda d: to_ref(d, hash_local(d)), Data)
    assert refs[0] is refs[1]["again"] and isinstance(refs[0], DataRef)


# --- real data and the import contract --------------------------------------------------------------------------


def test_eurosat_sample_round_trip(shared_data, tmp_path, gcs_bucket):
    zip_path = shared_data / "eurosat" / "EuroSAT_RGB_sample.zip"
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(tmp_path / "x")
    root = tmp_path / "x" / "EuroSAT_RGB"
    data = Data(root)
    manifest = hash_local(data)
    assert len(manifest.files) == 1000 and {rel.split("/")[0] for rel, _s, _h in manifest.files} == {
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
    }
    out = subprocess.run(["sha256sum", str(root / "Forest" / "Forest_1.jpg")], capture_output=True, text=True)
    assert dict((r, h) for r, _s, h in manifest.files)["Forest/Forest_1.jpg"] == out.stdout.split()[0]

    ref = to_ref(data, manifest)
    for store in (open_store(tmp_path / "store"), open_store(gcs_bucket)):
        assert upload(manifest, store) == manifest.total_bytes
        assert upload(hash_local(Data(root)), store) == 0
        path = localize(ref, store, tmp_path / "node")
        again = hash_local(Data(path))
        assert again.sha256 == manifest.sha256 and len(again.files) == 1000


def test_module_imports_no_prefect_or_google():
    # What the import adds: google-cloud-aiplatform's namespace-package .pth puts empty `google` and `google.cloud`
    # modules in every interpreter at start-up, before anything is imported.
    code = (
        "import sys; before = set(sys.modules); import kinetic_prefect.pod.data; "
        "bad = [m for m in set(sys.modules) - before if m.split('.')[0] in ('prefect', 'google', 'cloudpickle')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
