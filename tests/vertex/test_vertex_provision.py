"""`kinetic-prefect up / down --platform vertex`, end to end through the CLI, at the client boundary.

Service Usage and IAM are google-api-python-client's own resources built from their discovery documents over a fake
HTTP transport that keeps state and records every request (method, URL, JSON body: what would go to Google); the
Artifact Registry client and the bucket are fakes with the client libraries' calls (the registry's IAM policy is
the real ``google.iam.v1`` Policy message); the work pool and the signing key are real, on the session's Prefect
server. Google's APIs are unreachable from here.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import httplib2
import pytest
from google.api_core import exceptions as google_errors
from google.iam.v1 import policy_pb2
from googleapiclient import discovery

from kinetic_prefect import signing
from kinetic_prefect.cli import main
from kinetic_prefect.cli import provision as provision_cli
from kinetic_prefect.workers.vertex import provision

PROJECT, REGION = "test-project-1", "europe-west4"
SA = f"kinetic-vertex-jobs@{PROJECT}.iam.gserviceaccount.com"


class FakeGoogleHttp:
    """The transport under google-api-python-client: Service Usage's services and operations, IAM's service
    accounts, answered from state; every request recorded as (method, path, JSON body)."""

    def __init__(self, enabled: set[str]) -> None:
        self.enabled = set(enabled)
        self.accounts: dict[str, dict] = {}
        self.operations: dict[str, str] = {}
        self.requests: list[tuple[str, str, Any]] = []

    def request(self, uri: str, method: str = "GET", body: Any = None, headers: Any = None, **_: Any):
        path = uri.split("googleapis.com", 1)[1].split("?")[0]
        sent = json.loads(body) if body else None
        self.requests.append((method, path, sent))
        status, answer = self._answer(method, path, sent)
        return httplib2.Response({"status": str(status), "content-type": "application/json"}), json.dumps(
            answer
        ).encode()

    def _answer(self, method: str, path: str, sent: Any) -> tuple[int, dict]:
        if m := re.fullmatch(r"/v1/projects/[^/]+/services/([^/:]+)(:enable)?", path):
            api = m.group(1)
            if m.group(2):
                name = f"operations/enable-{api}"
                self.operations[name] = api
                return 200, {"name": name, "done": False}
            return 200, {"name": path, "state": "ENABLED" if api in self.enabled else "DISABLED"}
        if m := re.fullmatch(r"/v1/(operations/.+)", path):
            self.enabled.add(self.operations[m.group(1)])
            return 200, {"name": m.group(1), "done": True, "response": {}}
        if m := re.fullmatch(r"/v1/projects/([^/]+)/serviceAccounts/?(.*)", path):
            return self._account(method, m.group(1), m.group(2), sent)
        return 404, {"error": {"code": 404, "message": f"no {path}"}}

    def _account(self, method: str, project: str, email: str, sent: Any) -> tuple[int, dict]:
        if method == "POST":
            email = f"{sent['accountId']}@{project}.iam.gserviceaccount.com"
            self.accounts[email] = {"email": email, **sent["serviceAccount"]}
            return 200, self.accounts[email]
        if email not in self.accounts:
            return 404, {"error": {"code": 404, "message": f"Unknown service account {email}"}}
        if method == "DELETE":
            del self.accounts[email]
            return 200, {}
        return 200, self.accounts[email]

    def calls(self, method: str) -> list[tuple[str, Any]]:
        return [(path, body) for called, path, body in self.requests if called == method]


class FakeOperation:
    def result(self, timeout: float | None = None) -> None:
        return None


class FakeRegistry:
    """ArtifactRegistryClient's calls: repositories and their IAM policies (``google.iam.v1`` Policy messages)."""

    def __init__(self) -> None:
        self.repositories: dict[str, Any] = {}
        self.policies: dict[str, policy_pb2.Policy] = {}
        self.requests: list[tuple[str, Any]] = []

    def get_repository(self, name: str) -> Any:
        if name not in self.repositories:
            raise google_errors.NotFound(f"repository {name}")
        return self.repositories[name]

    def create_repository(self, parent: str, repository_id: str, repository: Any) -> FakeOperation:
        self.requests.append(("create_repository", (parent, repository_id, repository)))
        self.repositories[f"{parent}/repositories/{repository_id}"] = repository
        return FakeOperation()

    def delete_repository(self, name: str) -> FakeOperation:
        self.requests.append(("delete_repository", name))
        del self.repositories[name]
        return FakeOperation()

    def get_iam_policy(self, request: dict) -> policy_pb2.Policy:
        self.get_repository(request["resource"])
        return policy_pb2.Policy().FromString(
            self.policies.get(request["resource"], policy_pb2.Policy()).SerializeToString()
        )

    def set_iam_policy(self, request: dict) -> policy_pb2.Policy:
        self.requests.append(("set_iam_policy", request))
        self.policies[request["resource"]] = request["policy"]
        return request["policy"]

    def calls(self, method: str) -> list[Any]:
        return [request for called, request in self.requests if called == method]


@dataclass
class FakeBucket:
    name: str
    storage: FakeStorage
    labels: dict = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.iam_configuration = type("Iam", (), {"uniform_bucket_level_access_enabled": False})()

    def get_iam_policy(self, requested_policy_version: int = 1) -> Any:
        policy = type("Policy", (), {})()
        policy.bindings = [dict(b, members=set(b["members"])) for b in self.storage.bindings.get(self.name, [])]
        return policy

    def set_iam_policy(self, policy: Any) -> Any:
        self.storage.requests.append(("set_iam_policy", self.name, policy.bindings))
        self.storage.bindings[self.name] = [dict(b, members=set(b["members"])) for b in policy.bindings]
        return policy

    def list_blobs(self, max_results: int | None = None) -> list[Any]:
        return [type("Blob", (), {"delete": lambda blob, n=n: self.objects.remove(n)})() for n in self.objects]

    def delete(self) -> None:
        self.storage.requests.append(("delete_bucket", self.name))
        del self.storage.buckets[self.name]


class FakeStorage:
    """storage.Client's calls: buckets (labels, uniform access, location) and their IAM bindings."""

    def __init__(self) -> None:
        self.buckets: dict[str, FakeBucket] = {}
        self.bindings: dict[str, list[dict]] = {}
        self.requests: list[tuple] = []

    def lookup_bucket(self, name: str) -> FakeBucket | None:
        return self.buckets.get(name)

    def bucket(self, name: str) -> FakeBucket:
        return FakeBucket(name, self)

    def create_bucket(self, bucket: FakeBucket, project: str, location: str) -> FakeBucket:
        self.requests.append(("create_bucket", bucket.name, project, location, bucket))
        self.buckets[bucket.name] = bucket
        return bucket

    def members(self, bucket: str, role: str) -> set[str]:
        return {m for b in self.bindings.get(bucket, []) if b["role"] == role for m in b["members"]}


@pytest.fixture
def no_signing_key():
    """`up` saves the signing key in the session's Prefect server: none before the test, the one there was back
    after it."""
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect.shared.key_blocks import forget_signing_key

    def value() -> str | None:
        try:
            return str(Secret.load(signing.SECRET_BLOCK).get())
        except ValueError:
            return None

    def delete() -> None:
        with contextlib.suppress(ValueError, ObjectNotFound):
            Secret.delete(signing.SECRET_BLOCK)

    before = value()
    delete()
    yield value
    delete()
    if before is not None:
        Secret(value=before).save(signing.SECRET_BLOCK, overwrite=True)
    forget_signing_key()


@pytest.fixture
def google(monkeypatch, no_signing_key):
    """The clients `kinetic-prefect up --platform vertex` gets; storage.googleapis.com is already enabled."""
    http = FakeGoogleHttp(enabled={"storage.googleapis.com"})
    clients = provision.VertexClients(
        services=discovery.build("serviceusage", "v1", http=http, static_discovery=True),
        iam=discovery.build("iam", "v1", http=http, static_discovery=True),
        registry=FakeRegistry(),
        storage=FakeStorage(),
        poll_seconds=0,
    )
    platforms: list[str] = []
    monkeypatch.setattr(
        provision_cli, "make_clients", lambda project, platform: platforms.append(platform.name) or clients
    )
    clients.http, clients.platforms, clients.signing_key = http, platforms, no_signing_key  # type: ignore[attr-defined]
    return clients


def _cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _pool(name: str) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_work_pool(name)


def _where(pool: str) -> list[str]:
    return ["--platform", "vertex", "--project", PROJECT, "--region", REGION, "--pool-name", pool]


def test_up_for_vertex_makes_each_resource_once_and_a_second_up_makes_nothing(google, capsys):
    pool = f"vx-{uuid.uuid4().hex[:6]}"
    code, out = _cli(capsys, "up", *_where(pool), "--yes")
    assert code == 0, out
    assert google.platforms == ["vertex"], "the platform came from the kinetic-vertex worker class's hook"
    enabled = [path.rsplit("/", 1)[1] for path, _ in google.http.calls("POST") if path.endswith(":enable")]
    assert enabled == [f"{api}:enable" for api in provision.APIS if api != "storage.googleapis.com"]
    [(parent, repository_id, repository)] = google.registry.calls("create_repository")
    assert (parent, repository_id) == (f"projects/{PROJECT}/locations/{REGION}", "kn-vertex")
    assert repository.format_.name == "DOCKER"
    [(_, bucket, project, location, made)] = [r for r in google.storage.requests if r[0] == "create_bucket"]
    assert (bucket, project, location) == (f"{PROJECT}-kn-vertex-jobs", PROJECT, REGION)
    assert made.iam_configuration.uniform_bucket_level_access_enabled
    [(path, body)] = [(p, b) for p, b in google.http.calls("POST") if p.endswith("/serviceAccounts")]
    assert path == f"/v1/projects/{PROJECT}/serviceAccounts" and body["accountId"] == "kinetic-vertex-jobs"
    assert google.storage.members(bucket, "roles/storage.objectUser") == {f"serviceAccount:{SA}"}
    [granted] = google.registry.calls("set_iam_policy")
    assert [(b.role, list(b.members)) for b in granted["policy"].bindings] == [
        ("roles/artifactregistry.reader", [f"serviceAccount:{SA}"])
    ]
    assert google.signing_key() is not None, "the signing key block was made"
    made_pool = _pool(pool)
    defaults = {k: v.get("default") for k, v in made_pool.base_job_template["variables"]["properties"].items()}
    assert made_pool.type == "kinetic-vertex"
    assert defaults["gcp_project"] == PROJECT and defaults["region"] == REGION
    assert defaults["service_account_name"] == SA
    assert defaults["image_repository"] == f"{REGION}-docker.pkg.dev/{PROJECT}/kn-vertex"
    assert defaults["store"] == f"gs://{bucket}/kinetic-prefect"
    assert "│ cluster" not in out and "│ node pool" not in out, "no cluster in a Vertex setup"

    writes = len(google.http.calls("POST")), len(google.registry.requests), len(google.storage.requests)
    code, out = _cli(capsys, "up", *_where(pool), "--yes")
    assert code == 0 and "Nothing to do." in out, out
    assert (len(google.http.calls("POST")), len(google.registry.requests), len(google.storage.requests)) == writes


def test_up_for_vertex_dry_run_shows_the_plan_and_only_looks(google, capsys):
    pool = f"vx-{uuid.uuid4().hex[:6]}"
    code, out = _cli(capsys, "up", *_where(pool), "--dry-run")
    assert code == 0 and "dry run: nothing was changed" in out, out
    folded = re.sub(r"[\s│]+", "", out)  # the table folds long names over lines
    for wanted in ("aiplatform.googleapis.com", "kn-vertex", f"gs://{PROJECT}-kn-vertex-jobs", SA, "willcreate"):
        assert wanted in folded, wanted
    assert {method for method, _, _ in google.http.requests} == {"GET"}, "only look-ups"
    assert google.registry.requests == [] and google.storage.requests == []
    assert google.signing_key() is None


def test_down_for_vertex_removes_what_up_made_and_keeps_data_and_the_key_unless_asked(google, capsys):
    pool = f"vx-{uuid.uuid4().hex[:6]}"
    assert _cli(capsys, "up", *_where(pool), "--yes")[0] == 0
    bucket = google.storage.buckets[f"{PROJECT}-kn-vertex-jobs"]
    bucket.objects.append("kinetic-prefect/runs/r/result.pkl")

    code, out = _cli(capsys, "down", *_where(pool), "--dry-run")
    assert code == 0 and "will delete" in out and "nothing was changed" in out, out
    assert google.registry.calls("delete_repository") == [] and _pool(pool).name == pool

    code, out = _cli(capsys, "down", *_where(pool), "--yes")
    assert code == 0, out
    assert google.registry.calls("delete_repository") == [
        f"projects/{PROJECT}/locations/{REGION}/repositories/kn-vertex"
    ]
    assert [p for p, _ in google.http.calls("DELETE")] == [f"/v1/projects/{PROJECT}/serviceAccounts/{SA}"]
    assert bucket.name in google.storage.buckets, "a bucket holding objects is kept without --delete-data"
    assert google.signing_key() is not None, "the signing key is kept without --delete-signing-key"
    assert not [p for p, _ in google.http.calls("POST") if ":disable" in p], "APIs stay enabled"
    from prefect.exceptions import ObjectNotFound

    with pytest.raises(ObjectNotFound):
        _pool(pool)

    code, out = _cli(capsys, "down", *_where(pool), "--delete-data", "--delete-signing-key", "--yes")
    assert code == 0, out
    assert bucket.name not in google.storage.buckets and google.signing_key() is None


def test_an_unknown_platform_names_the_ones_the_installed_launchers_provision(capsys):
    code, out = _cli(capsys, "up", "--platform", "azure", "--project", PROJECT, "--dry-run")
    assert code != 0 and "--platform 'azure'" in out and "gke" in out and "vertex" in out, out
