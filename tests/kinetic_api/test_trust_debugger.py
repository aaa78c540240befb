"""Issue 45, finding 9 (debugger): ``kinetic-prefect jobs debug`` relays 127.0.0.1:PORT to a debug job's debugpy,
and an attached debugger runs any code in the job (the job's keys, its service account). Any local user could
connect to the relay's port. Now the relay asks the kernel who owns each connection's other end (Linux
/proc/net/tcp) and relays only its own user's; an editor needs no token (the debug adapter protocol has none).

The attacker is another uid on the same machine (the tests run as root and drop to it in a child process), sending a
debug adapter request that would evaluate code in the job. The job's debugpy is a stand-in that records what
reaches it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from kinetic_prefect.kinetic import debug

pytestmark = pytest.mark.no_server

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root (the tests run as root)")
OTHER_UID = 54321
# A debug adapter request that would run code in the job once relayed to its debugpy.
EVALUATE = json.dumps(
    {"seq": 1, "type": "request", "command": "evaluate", "arguments": {"expression": "__import__('os').system('id')"}}
)
ATTACKER = """
import socket, sys
body = sys.argv[2].encode()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body)
try:
    print(repr(s.recv(1000)))
except OSError as exc:
    print("error", exc)
"""


class _StandIn:
    """The job's debugpy: takes connections, records every byte, answers each read with ``reply``."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received.append(data)
                conn.sendall(b"reply:" + data[:20])


@pytest.fixture
def relay():
    """``jobs debug``'s relay (listen + serve, as ``forward`` runs them) in front of the stand-in."""
    stand_in = _StandIn()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listener = debug.listen(port)
    stop = threading.Event()
    thread = threading.Thread(
        target=debug.serve,
        args=(listener, lambda: socket.create_connection(("127.0.0.1", stand_in.port), timeout=10), stop.is_set),
        daemon=True,
    )
    thread.start()
    yield port, stand_in
    stop.set()
    thread.join(5)
    stand_in.server.close()


@AS_ROOT
def test_another_local_user_cannot_reach_the_job_through_the_relay(relay, capfd) -> None:
    port, stand_in = relay
    attack = subprocess.run(
        ["/usr/bin/python3", "-c", ATTACKER, str(port), EVALUATE],
        capture_output=True,
        text=True,
        user=OTHER_UID,
        timeout=30,
    )
    time.sleep(0.3)  # a relayed request would have reached the stand-in by now
    assert stand_in.connections == 0 and stand_in.received == [], "the attacker's request reached the job's debugger"
    assert "reply" not in attack.stdout, attack.stdout + attack.stderr
    assert f"refused a connection from user #{OTHER_UID} (uid {OTHER_UID})" in capfd.readouterr().err

    # the user who runs the relay (the editor) still gets through, with no token to present
    with socket.create_connection(("127.0.0.1", port), timeout=10) as editor:
        editor.sendall(b"hello")
        assert editor.recv(100) == b"reply:hello"
    assert stand_in.connections == 1


def test_peer_uid_names_the_owner_of_a_loopback_connection() -> None:
    """The kernel's answer for both address families a client may use to reach 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1")):
            with socket.socket(family) as client:
                client.connect((host, port))
                accepted, _ = server.accept()
                with accepted:
                    assert debug.peer_uid(accepted) == os.geteuid()
