"""The kinetic-gke job follower against an API server that accepts a connection and never answers: its reads end
in a timeout the worker retries, instead of holding their thread for good."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kinetic_prefect.workers.gke import kube
from kinetic_prefect.workers.gke.follower import JobFollower
from kinetic_prefect.workers.gke.kube import is_transient_kube_error

pytestmark = pytest.mark.no_server


@pytest.fixture
def silent_api_server():
    """A TCP listener that takes connections and reads requests but never writes a byte back."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            held.append(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    thread.join(2)
    for connection in held:
        connection.close()
    listener.close()


@pytest.mark.parametrize("read", ["pod", "pod_events", "autoscaler_present"])
def test_a_read_the_api_server_never_answers_times_out_as_a_transient_error(silent_api_server, monkeypatch, read):
    """Found under a 64-input sweep on the control plane: caller threads waited in ``list_namespaced_pod`` with no
    request timeout. With the read timeout turned down to 0.25 s, each of the follower's reads ends (urllib3 retries
    a timed-out GET three times) in an error the worker's next look retries."""
    from kubernetes import client

    monkeypatch.setattr(kube, "READ_TIMEOUT", (0.25, 0.25), raising=False)
    configuration = client.Configuration()
    configuration.host = silent_api_server
    follower = JobFollower(client.ApiClient(configuration), "default", "job-1", lambda line: None)
    args = ("pod-1",) if read == "pod_events" else ()
    box: dict = {}

    def call() -> None:
        try:
            getattr(follower, read)(*args)
        except BaseException as exc:  # what the worker's look would catch
            box["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), f"{read}() was still waiting for an answer after 15 s"
    assert "error" in box, f"{read}() returned without an answer"
    assert is_transient_kube_error(box["error"]), repr(box["error"])
    assert time.monotonic() - started < 15
