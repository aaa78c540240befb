"""Concurrent payload building (``.map()`` fans calls out over threads) must not race on cloudpickle's
process-wide pickle-by-value registry."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import cloudpickle
import pytest

from kinetic_prefect.caller.payload import build_call_payload

pytestmark = pytest.mark.no_server

SCRIPT = textwrap.dedent(
    """
    import multiprocessing  # like Prefect: aliases sys.modules['__mp_main__'] to __main__
    import pickle
    import sys
    import threading
    from pathlib import Path

    import cloudpickle

    from kinetic_prefect.caller.payload import build_call_payload

    HERE = Path(__file__).resolve().parent
    sys.path.insert(0, str(HERE))
    import helpers  # a project module: must be pickled by value

    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    SCALE = 3

    def task(x):
        return helpers.scale(x) * SCALE

    errors, blobs = [], set()

    def worker(fn):
        try:
            for i in range(150):
                envelope = pickle.loads(build_call_payload(fn, (i,), {}, HERE))
                blobs.add(envelope["function"])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(fn,)) for fn in [task, helpers.scale] * 6]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert "__main__" not in cloudpickle.list_registry_pickle_by_value()
    assert "helpers" not in cloudpickle.list_registry_pickle_by_value(), "registration leaked"

    # every payload carries the project code by value: it loads where `helpers` cannot be imported
    sys.path.remove(str(HERE))
    del sys.modules["helpers"]
    for blob in blobs:
        fn = cloudpickle.loads(blob)
        assert fn(2) in (4, 12), fn(2)
    print("OK", len(blobs))
    """
)


def test_threads_building_payloads_for_a_main_script_do_not_race(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (tmp_path / "helpers.py").write_text("def scale(x):\n    return 2 * x\n")
    (tmp_path / "main.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_registration_made_by_the_user_is_left_alone():
    import json  # any importable module stands in for one the user registered themselves

    cloudpickle.register_pickle_by_value(json)
    try:
        errors = []

        def worker():
            try:
                for _ in range(50):
                    build_call_payload(lambda x: x, (1,), {}, None)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert "json" in cloudpickle.list_registry_pickle_by_value()
    finally:
        cloudpickle.unregister_pickle_by_value(json)


FIRST_USE_SCRIPT = textwrap.dedent(
    """
    import sys
    import sysconfig
    import threading
    import time

    sys.path.insert(0, sys.argv[1])
    import helpers  # a project module: its file is checked against the library roots

    import kinetic_prefect.caller.payload as payload

    # Python 3.11's sysconfig.get_paths() fills a shared dict on first use without a lock, so it must never
    # run in two threads at once. Count how many threads are inside it; the sleep stands in for the first
    # use's read of the platform's _sysconfigdata module, which is what leaves the window open.
    inside, most_inside, lock = {}, 0, threading.Lock()  # thread -> depth (get_paths may call itself)
    _get_paths = sysconfig.get_paths

    def counting_get_paths(*args, **kwargs):
        global most_inside
        me = threading.get_ident()
        with lock:
            inside[me] = inside.get(me, 0) + 1
            most_inside = max(most_inside, len(inside))
        try:
            time.sleep(0.05)
            return _get_paths(*args, **kwargs)
        finally:
            with lock:
                inside[me] -= 1
                if not inside[me]:
                    del inside[me]

    sysconfig.get_paths = counting_get_paths
    barrier = threading.Barrier(8)
    errors = []

    def first_call():
        try:
            barrier.wait()
            assert payload.project_module_names(sys.argv[1]) == ["helpers"]
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert most_inside == 1, f"sysconfig.get_paths ran in {most_inside} threads at once"
    print("OK")
    """
)


def test_the_first_calls_of_a_fan_out_do_not_race_on_sysconfig(tmp_path):
    """CI failure: the first payloads of a .map() asked sysconfig for the library paths from many threads at
    once, and Python 3.11 fills those lazily without a lock ("dictionary changed size during iteration")."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (tmp_path / "helpers.py").write_text("def scale(x):\n    return 2 * x\n")
    (tmp_path / "first_use.py").write_text(FIRST_USE_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "first_use.py"), str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_a_module_imported_in_the_middle_of_the_module_scan_does_not_fail_the_call(tmp_path, monkeypatch):
    """The scan for project modules must not fail when ``sys.modules`` changes while it reads it: the call failed
    with "RuntimeError: dictionary changed size during iteration" (1 input in 80 in a plain ``.map()``, 17 in 120
    with a thread importing modules). tests/support/collection_imports.py makes the interleaving certain."""
    from collection_imports import imports_during_collections

    from kinetic_prefect.caller import payload

    (tmp_path / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (tmp_path / "proj_helpers.py").write_text("def scale(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(payload, "_module_names", {})
    import proj_helpers  # noqa: F401 - a project module: the scan must find it

    try:
        with imports_during_collections(tmp_path) as imported:
            names = payload.project_module_names(tmp_path)
    finally:
        sys.modules.pop("proj_helpers", None)
    assert imported, "no collection ran during the scan: the test did not make the interleaving it is about"
    assert "proj_helpers" in names
