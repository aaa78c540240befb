"""A busy Prefect server (SQLite's "database is locked", answered as 503) costs a fan-out seconds, not minutes.

Measured: a 32-input `.map()` on a quiet machine took 36 s, most of it idle in Prefect's client backing off
2, 4, 8, 16 s after 503s to concurrent writes; with the retrying done in `_prefect.with_retries` (the client's
own retries off, 50 ms doubling) it took 18 s (bench/results/round2.json has the 64-input figure).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from kinetic_prefect.caller import _prefect

pytestmark = pytest.mark.no_server


class BusyServer(http.server.ThreadingHTTPServer):
    """Answers the first ``busy`` requests to /api/hello with 503, as a locked SQLite server does."""

    def __init__(self, busy: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.busy, self.hello_calls = busy, []


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        server: BusyServer = self.server  # type: ignore[assignment]
        body, status = b"{}", 200
        if self.path.endswith("/hello"):
            server.hello_calls.append(time.monotonic())
            if len(server.hello_calls) <= server.busy:
                body, status = json.dumps({"exception_message": "Service Unavailable"}).encode(), 503
            else:
                body = json.dumps("hello").encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def busy_server():
    server = BusyServer(busy=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.mark.slow
def test_a_busy_server_is_retried_at_the_pace_of_the_conflict(busy_server):
    from prefect.client.orchestration import PrefectClient

    async def call():
        async with PrefectClient(f"http://127.0.0.1:{busy_server.server_address[1]}/api") as client:
            start = time.monotonic()
            response = await _prefect.with_retries(client.hello, what="saying hello")
            return response, time.monotonic() - start

    response, seconds = asyncio.run(call())
    assert response.json() == "hello"
    assert len(busy_server.hello_calls) == 5  # four 503s, then the answer
    # Prefect's client alone waits 2 + 4 + 8 + 16 = 30 s for four 503s; here each costs its single 2 s wait
    # (which the client keeps even with retries off) plus tens of milliseconds.
    assert seconds < 20, seconds


def test_errors_that_will_not_pass_are_not_retried(busy_server):
    from prefect.client.orchestration import PrefectClient

    calls = []

    async def failing():
        calls.append(1)
        raise ValueError("a bug, not a busy server")

    async def call():
        async with PrefectClient(f"http://127.0.0.1:{busy_server.server_address[1]}/api"):
            await _prefect.with_retries(failing, what="failing")

    with pytest.raises(ValueError):
        asyncio.run(call())
    assert calls == [1]
