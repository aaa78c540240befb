"""Concurrent payload building (``.map()`` fans calls out over threads) must not race on cloudpickle's
process-wide pickle-by-value registry."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import cloudpickle

from kinetic_prefect.payload import build_call_payload

SCRIPT = textwrap.dedent(
    """
    import multiprocessing  # like Prefect: aliases sys.modules['__mp_main__'] to __main__
    import pickle
    import sys
    import threading
    from pathlib import Path

    import cloudpickle

    from kinetic_prefect.payload import build_call_payload

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
