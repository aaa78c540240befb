"""Test-only: a TCP gate in front of the Prefect server, to cut the API away and bring it back.

Processes given ``url`` reach the server through it. ``cut()`` closes the listening socket and every open
connection, so new requests are refused and those in flight fail, as when the server process stops;
``restore()`` listens on the same port again. The server behind it keeps its data, as a restarted one does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kube_cluster import free_port


class ApiGate:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.cut_at: float | None = None
        self.outages: list[float] = []
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        if self.cut_at is not None:
            self.outages.append(time.monotonic() - self.cut_at)
            self.cut_at = None
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, []
        self.cut_at = time.monotonic()
        if listener is not None:
            # wakes the accepting thread: a listener closed under a blocked accept() would go on accepting
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._connections += [client, upstream]
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                for sock in (source, target):
                    if sock in self._connections:
                        self._connections.remove(sock)
            source.close()

    def close(self) -> None:
        self.cut()
