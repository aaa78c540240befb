"""Test-only: an HTTPS proxy in front of the Kubernetes API server that injects faults.

It answers some requests with ``503 Service Unavailable`` (as an API server does during a control-plane upgrade)
and drops the connection of others without an answer (a load balancer restarting), by a fixed pattern so runs
are repeatable; everything else is forwarded, streamed responses (``follow=true`` logs) included."""

from __future__ import annotations

import http.client
import http.server
import json
import ssl
import threading
from pathlib import Path

from kube_cluster import free_port

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


class FaultProxy:
    def __init__(self, upstream_port: int, pki: Path, fail_every: int = 4, drop_every: int = 7):
        self.upstream_port, self.fail_every, self.drop_every = upstream_port, fail_every, drop_every
        self.port = free_port()
        self.requests = self.failed = self.dropped = 0
        self.armed = True
        self._lock = threading.Lock()
        self._upstream_context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                    fault = None
                    if proxy.armed and n % proxy.drop_every == 0:
                        fault, proxy.dropped = "drop", proxy.dropped + 1
                    elif proxy.armed and n % proxy.fail_every == 0:
                        fault, proxy.failed = "fail", proxy.failed + 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fault == "fail":
                    payload = json.dumps(
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "message": "injected: the API server is restarting",
                            "reason": "ServiceUnavailable",
                            "code": 503,
                        }
                    ).encode()
                    self.send_response(503)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(payload)
                    self.close_connection = True
                    return
                upstream = http.client.HTTPSConnection(
                    "127.0.0.1", proxy.upstream_port, context=proxy._upstream_context, timeout=300
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_HEADERS:
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    while chunk := response.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    upstream.close()
                self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pki / "apiserver.crt"), str(pki / "apiserver.key"))
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True).start()

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
