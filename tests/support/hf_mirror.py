"""A tiny local stand-in for the Hugging Face Hub, serving what ``huggingface_hub.snapshot_download`` asks for.

Hugging Face is unreachable from the test machines, so the hf:// tests point ``HF_ENDPOINT`` at this server. It
answers the three requests a dataset snapshot makes (huggingface_hub 2.x): the revision's info
(``/api/datasets/<repo>/revision/<rev>``), the file tree at that commit (``/api/datasets/<repo>/tree/<sha>``), and
each file (``HEAD``/``GET /datasets/<repo>/resolve/<sha>/<path>``, with the ``X-Repo-Commit`` and ``ETag`` headers
the client checks). Anything else is a 404 with the Hub's ``X-Error-Code``, so a wrong name fails as it would.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubMirror:
    """``datasets``: {repo id: {path: bytes}}; ``url`` once started. Requests are recorded in ``requests``."""

    def __init__(self, datasets: dict[str, dict[str, bytes]]):
        self.datasets = datasets
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def sha(self, repo: str) -> str:
        return hashlib.sha1(json.dumps(sorted(self.datasets[repo])).encode() + repo.encode()).hexdigest()

    def __enter__(self) -> HubMirror:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _send(self, status: int, payload: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for name, value in {"Content-Length": str(len(payload)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _answer(self, body: bool) -> None:
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                mirror.requests.append(f"{self.command} {path}")
                for pattern, route in (
                    (r"/api/datasets/(.+?)/revision/([^/]+)", self._info),
                    (r"/api/datasets/(.+?)/tree/([^/]+)(?:/.*)?", self._tree),
                    (r"/datasets/(.+?)/resolve/([^/]+)/(.+)", self._file),
                ):
                    match = re.fullmatch(pattern, path)
                    if match and match.group(1) in mirror.datasets:
                        return route(body, *match.groups())
                not_found = json.dumps({"error": "Repository not found"}).encode()
                self._send(404, not_found, {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, body)

            def _json(self, value, body: bool) -> None:
                self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, body)

            def _info(self, body: bool, repo: str, revision: str) -> None:
                if revision not in ("main", mirror.sha(repo)):
                    self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
                    return
                files = mirror.datasets[repo]
                self._json({"id": repo, "sha": mirror.sha(repo), "siblings": [{"rfilename": f} for f in files]}, body)

            def _tree(self, body: bool, repo: str, _revision: str) -> None:
                files = mirror.datasets[repo]
                entries = [
                    {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                    for name, data in sorted(files.items())
                ]
                self._json(entries, body)

            def _file(self, body: bool, repo: str, _revision: str, name: str) -> None:
                data = mirror.datasets[repo].get(name)
                if data is None:
                    self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
                    return
                etag = f'"{hashlib.sha1(data).hexdigest()}"'
                self._send(200, data, {"X-Repo-Commit": mirror.sha(repo), "ETag": etag}, body)

        return Handler
