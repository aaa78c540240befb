"""Test-only: a stand-in for Vertex AI's JobService and Cloud Logging's entries.list, over plain HTTP (REST), that runs
each custom job's replicas in Docker.

The worker talks to it with the real google-cloud-aiplatform ``JobServiceClient`` (REST transport, ``api_endpoint``
pointing here), so the requests are the library's own: ``CreateCustomJob``, ``GetCustomJob``, ``ListCustomJobs``
(``labels.KEY="VALUE"`` filters), ``CancelCustomJob``. The bodies are parsed with ``aiplatform_v1`` types. Each
replica of each worker pool is a container of the job's image (host network, so jobs reach fake-gcs-server and the
stand-in), with the container spec's command and env and a ``CLUSTER_SPEC`` in Vertex's shape (every pool's
addresses, and the replica's own pool and index). A job is PENDING, then RUNNING, then SUCCEEDED when every replica
exited 0, else FAILED with "The replica workerpoolN-M exited with a non-zero status of C"; a cancel stops the
containers and ends CANCELLED. Each replica's output is served by ``/v2/entries:list`` as Cloud Logging entries
(``resource.type="ml_job"``, ``resource.labels.job_id``, log ``workerpoolN-M``).

Not Vertex: no quotas, no machine types checked beyond the tests' ``stock_out`` list, no IAM, and the wording of a
preemption (``preempt``) and a stockout is this file's, chosen to match what docs/vertex.md says Vertex reports.
"""

from __future__ import annotations

import datetime
import http.server
import json
import re
import socket
import subprocess
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field

from google.cloud.aiplatform_v1 import types as vertex

_ENDED = (
    vertex.JobState.JOB_STATE_SUCCEEDED,
    vertex.JobState.JOB_STATE_FAILED,
    vertex.JobState.JOB_STATE_CANCELLED,
    vertex.JobState.JOB_STATE_EXPIRED,
)
_JOB_PATH = re.compile(r"^/v1/(projects/[^/]+/locations/[^/]+)/customJobs(?:/(\d+))?(:cancel)?$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class Replica:
    pool: int
    index: int
    container: str | None = None
    exit_code: int | None = None

    @property
    def log_name(self) -> str:
        return f"workerpool{self.pool}-{self.index}"


@dataclass
class StandInJob:
    job: vertex.CustomJob
    replicas: list[Replica] = field(default_factory=list)
    cancelled: bool = False
    preempted: bool = False


class VertexStandIn:
    """``endpoint``: the JobService and Cloud Logging address a pool is given (api_endpoint, logging_endpoint)."""

    def __init__(self, docker: str, project: str = "kinetic-test", region: str = "us-central1"):
        self.docker, self.project, self.region = docker, project, region
        self.jobs: dict[str, StandInJob] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for tests
        self.stock_out: set[str] = set()  # accelerator type names (or machine types) with no capacity
        self.label = f"kinetic-test-vertex={uuid.uuid4().hex[:12]}"
        self.port = _free_port()
        self.lock = threading.Lock()
        self._server = self._make_server()
        threading.Thread(target=self._server.serve_forever, name="vertex-stand-in", daemon=True).start()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="vertex-stand-in-watch", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ the API
    def create(self, parent: str, body: dict) -> vertex.CustomJob:
        job = vertex.CustomJob.from_json(json.dumps(body), ignore_unknown_fields=True)
        job_id = str(int(time.time() * 1000) % 10**12 * 1000 + len(self.jobs))
        job.name = f"{parent}/customJobs/{job_id}"
        job.create_time = _now()
        job.update_time = _now()
        entry = StandInJob(job)
        pools = job.job_spec.worker_pool_specs
        for p, pool in enumerate(pools):
            entry.replicas += [Replica(p, i) for i in range(pool.replica_count or 0)]
        machine = pools[0].machine_spec
        if {machine.accelerator_type.name, machine.machine_type} & self.stock_out:
            job.state = vertex.JobState.JOB_STATE_FAILED
            job.error = {
                "code": 8,
                "message": f"RESOURCE_EXHAUSTED: The zone '{self.region}-a' does not have enough resources "
                f"available to fulfill the request ({machine.machine_type}).",
            }
            job.end_time = _now()
        else:
            job.state = vertex.JobState.JOB_STATE_PENDING
            threading.Thread(target=self._start, args=(entry,), daemon=True).start()
        with self.lock:
            self.jobs[job.name] = entry
        return job

    def _cluster_spec(self, entry: StandInJob, replica: Replica) -> str:
        cluster: dict[str, list[str]] = {}
        for r in entry.replicas:
            cluster.setdefault(f"workerpool{r.pool}", []).append(f"127.0.0.1:{2222 + r.pool * 100 + r.index}")
        return json.dumps(
            {
                "cluster": cluster,
                "environment": "cloud",
                "task": {"type": f"workerpool{replica.pool}", "index": replica.index},
                "job": entry.job.name,
            }
        )

    def _start(self, entry: StandInJob) -> None:
        job = entry.job
        for replica in entry.replicas:
            spec = job.job_spec.worker_pool_specs[replica.pool].container_spec
            argv = [self.docker, "run", "-d", "--network", "host", "--label", self.label]
            for var in spec.env:
                argv += ["-e", f"{var.name}={var.value}"]
            argv += ["-e", f"CLUSTER_SPEC={self._cluster_spec(entry, replica)}"]
            command = list(spec.command)
            if command:
                argv += ["--entrypoint", command[0]]
            argv += [spec.image_uri, *command[1:], *spec.args]
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                self._end(entry, vertex.JobState.JOB_STATE_FAILED, f"could not start the replica: {proc.stderr[-300:]}")
                return
            replica.container = proc.stdout.strip()
        with self.lock:
            if job.state == vertex.JobState.JOB_STATE_PENDING:
                job.state = vertex.JobState.JOB_STATE_RUNNING
                job.start_time = job.update_time = _now()

    def _end(self, entry: StandInJob, state: vertex.JobState, message: str = "", code: int = 0) -> None:
        with self.lock:
            job = entry.job
            job.state = state
            if message:
                job.error = {"code": code, "message": message}
            job.end_time = job.update_time = _now()

    def cancel(self, name: str) -> None:
        entry = self.jobs[name]
        entry.cancelled = True
        with self.lock:
            entry.job.state = vertex.JobState.JOB_STATE_CANCELLING
        threading.Thread(target=self._stop_replicas, args=(entry,), daemon=True).start()

    def preempt(self, name: str) -> None:
        """What a Spot VM's reclaim does to a job here: its replicas stopped (SIGTERM, then SIGKILL), FAILED."""
        entry = self.jobs[name]
        entry.preempted = True
        self._stop_replicas(entry)

    def _stop_replicas(self, entry: StandInJob) -> None:
        for replica in entry.replicas:
            if replica.container:
                subprocess.run([self.docker, "stop", "-t", "10", replica.container], capture_output=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.3):
            for entry in list(self.jobs.values()):
                try:
                    self._check(entry)
                except Exception as exc:  # one bad job must not stop the others
                    print(f"vertex-stand-in: {exc!r}")

    def _check(self, entry: StandInJob) -> None:
        job = entry.job
        if job.state not in (vertex.JobState.JOB_STATE_RUNNING, vertex.JobState.JOB_STATE_CANCELLING):
            return
        if not entry.replicas or any(r.container is None for r in entry.replicas):
            return
        for replica in entry.replicas:
            if replica.exit_code is None:
                out = subprocess.run(
                    [self.docker, "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", replica.container],
                    capture_output=True,
                    text=True,
                ).stdout.split()
                if out and out[0] == "false":
                    replica.exit_code = int(out[1])
        if any(r.exit_code is None for r in entry.replicas):
            return
        failed = [r for r in entry.replicas if r.exit_code]
        if entry.cancelled:
            self._end(entry, vertex.JobState.JOB_STATE_CANCELLED, "CANCELED: the job was cancelled", 1)
        elif entry.preempted:
            self._end(
                entry,
                vertex.JobState.JOB_STATE_FAILED,
                "The replica workerpool0-0 was preempted: its Spot VM was reclaimed by Compute Engine.",
                14,
            )
        elif failed:
            r = failed[0]
            self._end(
                entry,
                vertex.JobState.JOB_STATE_FAILED,
                f"The replica {r.log_name} exited with a non-zero status of {r.exit_code}. Termination reason: Error.",
                3,
            )
        else:
            self._end(entry, vertex.JobState.JOB_STATE_SUCCEEDED)

    # ------------------------------------------------------------------ Cloud Logging
    def entries(self, body: dict) -> dict:
        text = body.get("filter", "")
        job_id = re.search(r'resource\.labels\.job_id="(\d+)"', text)
        since = re.search(r'timestamp>="([^"]+)"', text)
        entry = next((e for n, e in self.jobs.items() if job_id and n.endswith(f"/{job_id.group(1)}")), None)
        found = []
        for replica in entry.replicas if entry else []:
            if not replica.container:
                continue
            logs = subprocess.run(
                [self.docker, "logs", "--timestamps", replica.container], capture_output=True, text=True
            )
            for n, line in enumerate((logs.stdout + logs.stderr).splitlines()):
                stamp, _, message = line.partition(" ")
                if since and stamp < since.group(1):
                    continue
                found.append(
                    {
                        "insertId": f"{job_id.group(1)}-{replica.log_name}-{n}-{stamp}",  # type: ignore[union-attr]
                        "timestamp": stamp,
                        "textPayload": message,
                        "logName": f"projects/{self.project}/logs/{replica.log_name}",
                        "resource": {"type": "ml_job", "labels": {"job_id": job_id.group(1)}},  # type: ignore[union-attr]
                    }
                )
        found.sort(key=lambda e: e["timestamp"])
        return {"entries": found}

    # ------------------------------------------------------------------ HTTP
    def _make_server(self) -> http.server.ThreadingHTTPServer:
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, payload: object) -> None:
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def _route(self, method: str) -> None:
                url = urllib.parse.urlsplit(self.path)
                stand_in.requests.append((method, url.path))
                if url.path == "/v2/entries:list" and method == "POST":
                    return self._reply(200, stand_in.entries(self._body()))
                match = _JOB_PATH.match(url.path)
                if not match:
                    return self._reply(404, {"error": {"code": 404, "message": url.path, "status": "NOT_FOUND"}})
                parent, job_id, cancel = match.groups()
                name = f"{parent}/customJobs/{job_id}"
                if job_id is None and method == "POST":
                    return self._reply(200, vertex.CustomJob.to_json(stand_in.create(parent, self._body())))
                if job_id is None and method == "GET":
                    return self._reply(200, stand_in.list_json(parent, urllib.parse.parse_qs(url.query)))
                if name not in stand_in.jobs:
                    return self._reply(404, {"error": {"code": 404, "message": name, "status": "NOT_FOUND"}})
                if cancel and method == "POST":
                    if stand_in.jobs[name].job.state in _ENDED:  # as Vertex answers a cancel of an ended job
                        return self._reply(
                            400,
                            {"error": {"code": 400, "message": f"{name} has ended", "status": "FAILED_PRECONDITION"}},
                        )
                    stand_in.cancel(name)
                    return self._reply(200, {})
                with stand_in.lock:
                    return self._reply(200, vertex.CustomJob.to_json(stand_in.jobs[name].job))

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        return http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)

    def list_json(self, parent: str, query: dict) -> str:
        wanted = dict(re.findall(r'labels\.([\w-]+)="([^"]*)"', (query.get("filter") or [""])[0]))
        with self.lock:
            jobs = [
                vertex.CustomJob.to_dict(e.job)
                for name, e in self.jobs.items()
                if name.startswith(parent) and all(e.job.labels.get(k) == v for k, v in wanted.items())
            ]
        return json.dumps({"customJobs": jobs})

    def containers(self) -> list[str]:
        return subprocess.run(
            [self.docker, "ps", "-q", "--no-trunc", "--filter", f"label={self.label}"], capture_output=True, text=True
        ).stdout.split()

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        ids = subprocess.run(
            [self.docker, "ps", "-aq", "--filter", f"label={self.label}"], capture_output=True, text=True
        ).stdout.split()
        if ids:
            subprocess.run([self.docker, "rm", "-f", *ids], capture_output=True)
