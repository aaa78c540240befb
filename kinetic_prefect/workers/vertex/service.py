"""The Vertex AI clients of a kinetic-vertex pool: google-cloud-aiplatform's ``JobServiceClient`` (as prefect-gcp
makes it from a ``GcpCredentials`` block, or from Application Default Credentials), and the job's output read
from Cloud Logging.

Why Cloud Logging: Vertex AI sends each replica's stdout and stderr there by itself (resource type ``ml_job``,
labelled with the job's id; the log is named after the replica, ``workerpool0-0``), so the runner and the image
stay as they are on every other launcher. Its reads are rationed (``entries.list`` has a per-project quota per
minute), so a job's output is read at most every ``LOG_READ_SECONDS`` while it runs, and once more at its end.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kinetic_prefect.workers.vertex.configuration import KineticVertexJobConfiguration

LOG_READ_SECONDS = 5.0
LOGGING_ENDPOINT = "https://logging.googleapis.com"
_REPLICA_LOG = re.compile(r"/logs/workerpool(\d+)-(\d+)$")


def is_stand_in(endpoint: str | None) -> bool:
    """A plain-HTTP endpoint is a local stand-in or emulator: reached with anonymous credentials, never real ones."""
    return bool(endpoint) and str(endpoint).startswith("http://")


def job_service_client(configuration: KineticVertexJobConfiguration, block: Any = None) -> Any:
    """A ``JobServiceClient`` for the pool's region (``api_endpoint`` when the pool names one): gRPC to Google,
    REST with anonymous credentials to a stand-in."""
    from google.api_core.client_options import ClientOptions
    from google.cloud.aiplatform_v1 import JobServiceClient

    endpoint = configuration.api_endpoint or f"{configuration.region}-aiplatform.googleapis.com"
    options = ClientOptions(api_endpoint=endpoint)
    if is_stand_in(endpoint):
        from google.auth.credentials import AnonymousCredentials

        return JobServiceClient(credentials=AnonymousCredentials(), transport="rest", client_options=options)
    if block is not None:  # prefect-gcp's own way from its block
        return block.get_job_service_client(client_options=options)
    return JobServiceClient(client_options=options)


def logging_session(configuration: KineticVertexJobConfiguration, block: Any = None) -> Any:
    import requests

    if is_stand_in(configuration.logging_endpoint):
        return requests.Session()
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    if block is not None:
        credentials = block.get_credentials_from_service_account()
    else:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/logging.read"])
    return AuthorizedSession(credentials)


@dataclass
class JobLog:
    """One job's output, read from Cloud Logging in order: each entry once (by its insertId), from where the last
    read left off (its timestamp)."""

    project: str
    job_id: str
    since: str = "1970-01-01T00:00:00Z"
    seen: set[str] = field(default_factory=set)
    last_read: float = 0.0

    def filter(self) -> str:
        return f'resource.type="ml_job" AND resource.labels.job_id="{self.job_id}" AND timestamp>="{self.since}"'

    def read(self, session: Any, endpoint: str, emit: Callable[[str], None], final: bool = False) -> None:
        if not final and time.monotonic() - self.last_read < LOG_READ_SECONDS:
            return
        self.last_read = time.monotonic()
        page_token = None
        while True:
            body: dict[str, Any] = {
                "resourceNames": [f"projects/{self.project}"],
                "filter": self.filter(),
                "orderBy": "timestamp asc",
                "pageSize": 1000,
            }
            if page_token:
                body["pageToken"] = page_token
            response = session.post(f"{endpoint.rstrip('/')}/v2/entries:list", json=body, timeout=30)
            response.raise_for_status()
            data = response.json()
            self._emit(data.get("entries") or [], emit)
            page_token = data.get("nextPageToken")
            if not page_token:
                return

    def _emit(self, entries: list[dict[str, Any]], emit: Callable[[str], None]) -> None:
        for entry in entries:
            key = entry.get("insertId") or f"{entry.get('timestamp')}:{entry.get('textPayload')}"
            if key in self.seen:
                continue
            self.seen.add(key)
            self.since = max(self.since, str(entry.get("timestamp") or self.since))
            text = entry.get("textPayload")
            if text is None:
                text = str((entry.get("jsonPayload") or {}).get("message", ""))
            found = _REPLICA_LOG.search(str(entry.get("logName") or ""))
            host = 0 if found is None or found.group(1) == "0" else 1 + int(found.group(2))
            emit(text if host == 0 else f"[host {host}] {text}")
