"""Fan-out sharing: a function is pickled once (not once per call) and the project is archived once
(not re-listed and re-tarred per call), while a change still produces a fresh payload or archive."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import cloudpickle
import pytest

from kinetic_prefect.caller import project_archive
from kinetic_prefect.caller.payload import build_call_payload, cached_project_archive, forget_function

pytestmark = pytest.mark.no_server


class Probe:
    """Counts how often it is pickled: stands in for a large captured object."""

    reductions = 0

    def __reduce__(self):
        Probe.reductions += 1
        return (Probe, ())


def _function(blob: bytes):
    return cloudpickle.loads(pickle.loads(blob)["function"])


def test_a_function_is_pickled_once_for_many_calls():
    probe = Probe()

    def task(x):
        return probe, x

    Probe.reductions = 0
    blobs = [build_call_payload(task, (i,), {}, None) for i in range(5)]
    threads = [threading.Thread(target=build_call_payload, args=(task, (i,), {}, None)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Probe.reductions == 1
    assert len({pickle.loads(b)["function"] for b in blobs}) == 1
    assert [pickle.loads(pickle.loads(b)["arguments"]["x"]) for b in blobs] == [0, 1, 2, 3, 4]


def test_rebinding_what_the_function_captures_gives_a_fresh_pickle():
    value = [1]

    def task():
        return value

    assert _function(build_call_payload(task, (), {}, None))() == [1]
    value = [2]  # a new object in the closure cell
    assert _function(build_call_payload(task, (), {}, None))() == [2]

    # a function pickled by value (defined in __main__) carries the globals it reads
    namespace = {"__name__": "__main__"}
    exec("SCALE = 2\ndef scaled(x, bias=0):\n    return x * SCALE + bias\n", namespace)
    scaled = namespace["scaled"]
    assert _function(build_call_payload(scaled, (3,), {}, None))(3) == 6
    namespace["SCALE"] = 5
    assert _function(build_call_payload(scaled, (3,), {}, None))(3) == 15
    scaled.__defaults__ = (1,)
    assert _function(build_call_payload(scaled, (3,), {}, None))(3) == 16


def test_rebinding_what_a_helper_or_a_project_module_holds_gives_a_fresh_pickle(tmp_path, monkeypatch):
    namespace = {"__name__": "__main__"}
    exec("SCALE = 2\ndef helper(x):\n    return x * SCALE\ndef task(x):\n    return helper(x)\n", namespace)
    task = namespace["task"]
    assert _function(build_call_payload(task, (3,), {}, None))(3) == 6
    namespace["SCALE"] = 7  # read by the helper, not by the task itself
    assert _function(build_call_payload(task, (3,), {}, None))(3) == 21

    (tmp_path / "pyproject.toml").write_text("[project]\nname='p'\n")
    (tmp_path / "kinetic_test_settings.py").write_text("FACTOR = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kinetic_test_settings as settings  # a project module: pickled by value, whole

    try:
        exec("import kinetic_test_settings\ndef scaled(x):\n    return x * kinetic_test_settings.FACTOR\n", namespace)
        scaled = namespace["scaled"]
        before = build_call_payload(scaled, (3,), {}, tmp_path)
        settings.FACTOR = 10
        after = build_call_payload(scaled, (3,), {}, tmp_path)
    finally:
        sys.modules.pop("kinetic_test_settings", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    # loaded where the module cannot be imported: each payload carries the module's state by value
    assert (_function(before)(3), _function(after)(3)) == (6, 30)


def test_in_place_mutation_is_a_documented_snapshot_until_forgotten():
    weights = [1, 2, 3]

    def task():
        return list(weights)

    assert _function(build_call_payload(task, (), {}, None))() == [1, 2, 3]
    weights.append(4)  # same object, mutated in place: the cached pickle is a snapshot
    assert _function(build_call_payload(task, (), {}, None))() == [1, 2, 3]
    forget_function(task)
    assert _function(build_call_payload(task, (), {}, None))() == [1, 2, 3, 4]


def _age(root, seconds=60):
    """Backdate every file, as if the project had been edited a while ago (not "racily" just now)."""
    stamp = time.time() - seconds
    for path in root.rglob("*"):
        os.utime(path, (stamp, stamp))


def _project(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / "train.py").write_text("print('hi')\n")
    (root / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (root / ".kineticignore").write_text("outputs/\n")
    _age(root)
    return root


def test_the_project_archive_is_built_once_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    root = _project(tmp_path)
    listings = []
    real = project_archive._select_project_files
    monkeypatch.setattr(project_archive, "_select_project_files", lambda *a, **k: listings.append(1) or real(*a, **k))

    first = cached_project_archive(root)
    assert cached_project_archive(root) is first
    assert cached_project_archive(root, exclude=()) is first
    threads = [threading.Thread(target=cached_project_archive, args=(root,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(listings) == 1, "later calls neither re-listed nor re-tarred the project"

    (root / "outputs").mkdir()
    (root / "outputs" / "log.txt").write_text("ignored folder: no rebuild needed\n")
    assert cached_project_archive(root) is first

    (root / "train.py").write_text("print('changed')\n")
    changed = cached_project_archive(root)
    assert changed.sha256 != first.sha256

    (root / "pkg" / "new.py").write_text("Y = 2\n")
    added = cached_project_archive(root)
    assert added.sha256 != changed.sha256 and added.files == changed.files + 1

    os.remove(root / "pkg" / "new.py")
    assert cached_project_archive(root).sha256 == changed.sha256
    assert cached_project_archive(root, exclude=[root / "pkg"]).files == changed.files - 1


def test_a_same_size_rewrite_right_after_a_build_is_not_served_stale(tmp_path):
    root = _project(tmp_path)
    (root / "train.py").write_text("print('A')\n")
    stamp = (root / "train.py").stat().st_mtime_ns
    first = cached_project_archive(root)
    (root / "train.py").write_text("print('B')\n")
    os.utime(root / "train.py", ns=(stamp, stamp))  # same size, same mtime tick: an identical signature
    second = cached_project_archive(root)
    assert second.sha256 != first.sha256
    _age(root)
    assert cached_project_archive(root) is cached_project_archive(root)
