"""kinetic_prefect.storage against a local directory and a GCS emulator bucket."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
import threading

import pytest

from kinetic_prefect import storage
from kinetic_prefect.storage import (
    GCSStore,
    LocalStore,
    ObjectNotFound,
    StoreError,
    open_store,
)

pytestmark = pytest.mark.no_server

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "gcs"])
def store(request, tmp_path) -> storage.Store:
    if request.param == "local":
        return open_store(tmp_path / "store")
    bucket = request.getfixturevalue("gcs_bucket")
    return open_store(f"{bucket}/root/prefix")


def test_bytes_round_trip_and_overwrite(store):
    assert store.put_bytes("a/b/c.bin", b"one") is True
    assert store.get_bytes("a/b/c.bin") == b"one"
    assert store.put_bytes("a/b/c.bin", b"two") is True
    assert store.get_bytes("a/b/c.bin") == b"two"
    assert store.put_bytes("empty", b"") is True
    assert store.get_bytes("empty") == b""
    assert store.exists("a/b/c.bin") and not store.exists("a/b") and not store.exists("nope")


def test_file_round_trip_20mb(store, tmp_path):
    src = tmp_path / "big.bin"
    data = os.urandom(20 * 1024 * 1024 + 12345)  # > 8 MiB: a resumable upload in several chunks on GCS
    src.write_bytes(data)
    assert store.put_file("big/big.bin", src) is True
    dest = tmp_path / "out" / "nested" / "big.bin"
    store.get_file("big/big.bin", dest)
    assert dest.read_bytes() == data
    assert store.get_bytes("big/big.bin") == data
    assert store.put_file("big/big.bin", src, if_absent=True) is False
    assert [p.name for p in dest.parent.iterdir()] == ["big.bin"]  # no temp files left behind


def test_missing_object_names_url(store, tmp_path):
    with pytest.raises(ObjectNotFound) as info:
        store.get_bytes("no/such.key")
    assert store.url_for("no/such.key") in str(info.value)
    assert info.value.url == store.url_for("no/such.key")
    assert isinstance(info.value, KeyError) and isinstance(info.value, StoreError)
    dest = tmp_path / "dest.bin"
    with pytest.raises(ObjectNotFound, match="no/such.key"):
        store.get_file("no/such.key", dest)
    assert not dest.exists() and list(tmp_path.glob(".kp-tmp*")) == []


def test_if_absent_race_has_one_winner(store):
    barrier = threading.Barrier(8)
    results: dict[int, bool] = {}

    def racer(i: int) -> None:
        barrier.wait()
        results[i] = store.put_bytes("race/key", f"writer-{i}".encode() * 100, if_absent=True)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(results) == 8 and len(winners) == 1, results
    assert store.get_bytes("race/key") == f"writer-{winners[0]}".encode() * 100
    assert store.list("race") == ["race/key"]


def test_crashed_local_write_leaves_nothing_visible(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    store.put_bytes("kept", b"old")

    def boom(*args, **kwargs):
        raise OSError("simulated crash")

    with monkeypatch.context() as m:
        m.setattr(storage.os, "replace", boom)
        with pytest.raises(OSError, match="simulated"):
            store.put_bytes("new", b"x" * 1000)
        with pytest.raises(OSError, match="simulated"):
            store.put_bytes("kept", b"new content")
    with monkeypatch.context() as m:
        m.setattr(storage.os, "link", boom)
        with pytest.raises(OSError, match="simulated"):
            store.put_bytes("new", b"x", if_absent=True)

    # the source dies half-way through the copy
    src = tmp_path / "src.bin"
    src.write_bytes(b"y" * (3 << 20))

    def half_copy(fsrc, fdst, length=0):
        fdst.write(fsrc.read(1 << 20))
        raise OSError("simulated crash mid-copy")

    with monkeypatch.context() as m:
        m.setattr(storage.shutil, "copyfileobj", half_copy)
        with pytest.raises(OSError, match="mid-copy"):
            store.put_file("partial", src)
        with pytest.raises(OSError, match="mid-copy"):
            store.get_file("kept", tmp_path / "dl.bin")

    assert store.list() == ["kept"]
    assert store.get_bytes("kept") == b"old"
    assert not store.exists("new") and not store.exists("partial") and not (tmp_path / "dl.bin").exists()
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".kp-tmp")]
    assert leftovers == []


def test_list_paginates_past_1000_keys(gcs_bucket, tmp_path, monkeypatch):
    store = open_store(gcs_bucket).child("many")
    n = 1050
    files = []
    for i in range(n):
        path = tmp_path / f"{i}.txt"
        path.write_bytes(str(i).encode())
        files.append((f"k/{i:05d}.txt", path))
    store.put_tree("", files)
    store.put_bytes("k-sibling", b"not under k/")

    # count list requests: more than one page must have been fetched
    session = storage._gcs_client()._http
    pages = []
    original = session.request

    def counting(method, url, *args, **kwargs):
        if method == "GET" and url.split("?")[0].endswith("/o"):
            pages.append(url)
        return original(method, url, *args, **kwargs)

    monkeypatch.setattr(session, "request", counting)
    keys = store.list("k")
    assert keys == [f"k/{i:05d}.txt" for i in range(n)]
    assert len(pages) >= 2
    assert len(store.list()) == n + 1


def test_tree_round_trip_300_files(store, tmp_path):
    src = tmp_path / "src"
    files = []
    for i in range(300):
        rel = f"class{i % 7}/img_{i}.jpg"
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(100 + i))
        files.append((rel, path))
    total = store.put_tree("data/eurosat", files, workers=32)
    assert total == sum(100 + i for i in range(300))
    assert len(store.list("data/eurosat")) == 300

    dest = tmp_path / "dest"
    assert store.get_tree("data/eurosat/", dest) == 300
    for rel, path in files:
        assert (dest / rel).read_bytes() == path.read_bytes()
    assert sorted(p for p in dest.rglob("*") if p.is_file()) == sorted(dest / rel for rel, _ in files)


def test_delete_and_delete_prefix(store):
    for key in ["run1/a", "run1/sub/b", "run10/c", "run2"]:
        store.put_bytes(key, b"x")
    store.delete("run2")
    store.delete("run2")  # missing is fine
    assert store.delete_prefix("run1") == 2  # a directory prefix: run10/ survives
    assert store.list() == ["run10/c"]
    assert store.delete_prefix("nothing/here") == 0
    assert store.delete_prefix("") == 1
    assert store.list() == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/./b", "a/", "a\\b", "C:/x"])
def test_bad_keys_rejected(store, key):
    with pytest.raises(ValueError, match="invalid store key"):
        store.put_bytes(key, b"x")
    with pytest.raises(ValueError):
        store.get_bytes(key)


def test_bad_prefixes_rejected(store):
    for prefix in ["../x", "/abs", "a//"]:
        with pytest.raises(ValueError):
            store.list(prefix)
        with pytest.raises(ValueError):
            store.delete_prefix(prefix)
    with pytest.raises(ValueError):
        store.put_tree("ok", [("../escape", __file__)])


def test_child_and_url_for(store):
    child = store.child("sub/dir/")
    assert child.url == store.url_for("sub/dir")
    child.put_bytes("k", b"v")
    assert store.get_bytes("sub/dir/k") == b"v"
    assert child.url_for("k") == store.url_for("sub/dir/k")
    assert open_store(child.url) == child
    assert pickle.loads(pickle.dumps(child)) == child
    if isinstance(store, LocalStore):
        assert child.local_path("k") == pathlib.Path(store.url) / "sub" / "dir" / "k"
        assert child.local_path("k").read_bytes() == b"v"
    else:
        assert child.local_path("k") is None
        assert store.url_for("sub/dir/k").startswith("gs://") and store.url_for("x").endswith("/root/prefix/x")


def test_open_store_dispatch(tmp_path, monkeypatch):
    assert isinstance(open_store("gs://bucket"), GCSStore)
    gcs = open_store("gs://bucket/a/b/")
    assert isinstance(gcs, GCSStore) and gcs.url == "gs://bucket/a/b"
    assert gcs.url_for("k") == "gs://bucket/a/b/k"

    via_url = open_store(f"file://{tmp_path}/viaurl")
    assert isinstance(via_url, LocalStore) and via_url.url == str(tmp_path / "viaurl")
    assert (tmp_path / "viaurl").is_dir()
    assert open_store(tmp_path / "pathlike").url == str(tmp_path / "pathlike")
    monkeypatch.chdir(tmp_path)
    assert open_store("rel/dir").url == str(tmp_path / "rel" / "dir")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert open_store("~/x").url == str(tmp_path / "home" / "x")

    for bad in ["s3://bucket/x", "http://example.com/x", "gcs://b"]:
        with pytest.raises(StoreError, match="unsupported storage URL") as info:
            open_store(bad)
        assert bad in str(info.value) and "gs://bucket" in str(info.value)
    for bad in ["gs://", "gs:///x", "gs://b/../x", "file://remotehost/x"]:
        with pytest.raises((StoreError, ValueError)):
            open_store(bad)


def test_module_imports_only_stdlib():
    # Load the module file directly (not through the package __init__, which others may grow) and check that
    # nothing outside the stdlib was imported; then check the package import does not pull google.cloud.storage.
    code = (
        "import importlib.util, sys\n"
        "before = set(sys.modules)\n"
        "spec = importlib.util.spec_from_file_location('kp_storage', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['kp_storage'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before} - {'kp_storage'}\n"
        "bad = sorted(m for m in new if m not in sys.stdlib_module_names and not m.startswith('_'))\n"
        "assert not bad, bad\n"
        "import kinetic_prefect.storage\n"
        "assert 'google.cloud.storage' not in sys.modules, 'google.cloud.storage imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "kinetic_prefect" / "storage.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
