"""Built on prefect-gcp (issue 12): what a pool configures for GCP lives in Prefect blocks.

- results follow the pool's ``store`` (not only KINETIC_STORE), so a cache hit works from another machine
  when only the pool is configured;
- result records name their storage block: a saved ``GcsBucket`` derived from the store;
- a ``GcpCredentials`` block named by the pool's ``gcp_credentials`` is what the store client uses, and a bad
  name is refused before anything is uploaded, naming the setting and its fix.

Against fake-gcs-server (it ignores tokens); a small OAuth token endpoint stands in for Google's, so the
test sees which service account the store client signed in as.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prefect import flow, get_client
from prefect.cache_policies import INPUTS
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task
from kinetic_prefect.caller.results import block_name
from kinetic_prefect.storage import open_store
from kinetic_prefect.workers.base import load_template


def _pool(store_url: str, gcp_credentials: str | None = None) -> str:
    name = f"gcp-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    if gcp_credentials is not None:
        template["variables"]["properties"].setdefault("gcp_credentials", {"type": ["string", "null"]})
        template["variables"]["properties"]["gcp_credentials"]["default"] = gcp_credentials
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


def _jobs(flow_name: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))


def _result_record(store_url: str) -> dict:
    """The one result record (a gs:// store is signed: its signature sits beside it, ``<record>.sig``)."""
    from kinetic_prefect import signing

    listed = open_store(store_url).list("results")
    keys = [k for k in listed if not k.endswith(signing.SUFFIX)]
    assert len(keys) == 1, f"one result record in {store_url}/results, found {listed}"
    assert keys[0] + signing.SUFFIX in listed, f"the record {keys[0]} is not signed"
    return json.loads(open_store(store_url).get_bytes(keys[0]))


@pytest.fixture
def local_kinetic_store(tmp_path, monkeypatch):
    """KINETIC_STORE points somewhere else than the pool: a local directory."""
    monkeypatch.setenv("KINETIC_STORE", str(tmp_path / "local-store"))


@pytest.mark.slow
def test_a_cache_hit_works_from_another_machine_when_only_the_pool_names_the_bucket(gcs_bucket, tmp_path):
    store_url = f"{gcs_bucket}/team"
    pool = _pool(store_url)
    token = uuid.uuid4().hex
    script = tmp_path / "project" / "pool_cache.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(f"""
        from prefect import flow
        from prefect.cache_policies import INPUTS
        from kinetic_prefect import kinetic_task

        @kinetic_task(name="pooled-{token[:8]}", work_pool="{pool}", cache_policy=INPUTS, persist_result=True)
        def expensive(token: str) -> str:
            return "computed for " + token

        @flow
        def pipeline():
            return expensive("{token}")

        if __name__ == "__main__":
            print("RESULT", pipeline())
    """)
    )

    def run_on_machine(machine: str) -> str:
        home = tmp_path / machine
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "KINETIC_STORE"}  # only the pool names the bucket
        env.update(
            KINETIC_CACHE_DIR=str(home / "cache"),
            PREFECT_LOCAL_STORAGE_PATH=str(home / "prefect-storage"),
            PREFECT_HOME=str(home / "prefect"),
            HOME=str(home),
        )
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    first = run_on_machine("machine-a")
    assert f"RESULT computed for {token}" in first
    second = run_on_machine("machine-b")
    assert f"RESULT computed for {token}" in second
    assert "Cached" in second, second
    assert len(_jobs(f"pooled-{token[:8]}")) == 1, "machine B must not launch a job"


def test_result_records_name_a_saved_gcs_bucket_block_derived_from_the_pool_store(gcs_bucket, local_kinetic_store):
    store_url = f"{gcs_bucket}/kinetic"
    pool = _pool(store_url)

    @kinetic_task(name=f"recorded-{uuid.uuid4().hex[:6]}", work_pool=pool, cache_policy=INPUTS, persist_result=True)
    def square(x: int) -> int:
        return x * x

    @flow
    def pipeline():
        return square(7)

    assert pipeline() == 49
    record = _result_record(store_url)
    block_id = record["metadata"]["storage_block_id"]
    assert block_id is not None, "the result record must name its storage block"
    with get_client(sync_client=True) as client:
        document = client.read_block_document(block_id)
    assert document.block_type.slug == "gcs-bucket"
    assert document.name == block_name(store_url)
    assert document.data["bucket"] == gcs_bucket.removeprefix("gs://")
    assert document.data["bucket_folder"].rstrip("/") == "kinetic/results"
    # a second call (a new process would do the same) reuses the block rather than making another
    assert pipeline() == 49
    with get_client(sync_client=True) as client:
        same_name = [b for b in client.read_block_documents() if b.name == block_name(store_url)]
    assert [b.id for b in same_name] == [document.id]


# ------------------------------------------------------------------------------------------- credentials


class _TokenEndpoint(BaseHTTPRequestHandler):
    """Google's OAuth token endpoint as a service account sees it: a signed JWT in, an access token out."""

    assertions: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        claims = body["assertion"][0].split(".")[1]
        self.assertions.append(json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4))))
        reply = json.dumps({"access_token": "sa-token", "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def token_endpoint():
    _TokenEndpoint.assertions = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/token", _TokenEndpoint.assertions
    server.shutdown()


def _service_account_block(token_uri: str) -> tuple[str, str]:
    """A saved GcpCredentials block holding a service-account key; returns (block name, account email)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from prefect_gcp import GcpCredentials

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    suffix = uuid.uuid4().hex[:6]
    email = f"kinetic-{suffix}@block-project.iam.gserviceaccount.com"
    info = {
        "type": "service_account",
        "project_id": "block-project",
        "private_key_id": suffix,
        "private_key": pem,
        "client_email": email,
        "client_id": "1",
        "token_uri": token_uri,
    }
    name = f"gcp-{suffix}"
    GcpCredentials(service_account_info=info, project="block-project").save(name)
    return name, email


def test_the_store_and_the_results_use_the_gcp_credentials_block_the_pool_names(
    gcs_bucket, token_endpoint, local_kinetic_store
):
    token_uri, assertions = token_endpoint
    credentials, email = _service_account_block(token_uri)
    store_url = f"{gcs_bucket}/signed-in"
    pool = _pool(store_url, gcp_credentials=credentials)

    @kinetic_task(name=f"with-block-{uuid.uuid4().hex[:6]}", work_pool=pool, cache_policy=INPUTS, persist_result=True)
    def double(x: int) -> int:
        return 2 * x

    @flow
    def pipeline():
        return double(21)

    assert pipeline() == 42
    assert assertions and {a["iss"] for a in assertions} == {email}, "the store client signs in as the block's account"
    with get_client(sync_client=True) as client:
        results_block = client.read_block_document_by_name(block_name(store_url), "gcs-bucket")
        credentials_id = client.read_block_document_by_name(credentials, "gcp-credentials").id
    assert str(results_block.block_document_references["gcp_credentials"]["block_document"]["id"]) == str(
        credentials_id
    ), "the results block references the pool's credentials block (editing it in the UI applies)"
    assert _result_record(store_url)["metadata"]["storage_block_id"] == str(results_block.id)


def test_a_missing_credentials_block_is_refused_before_anything_is_uploaded(gcs_bucket, local_kinetic_store):
    store_url = f"{gcs_bucket}/refused"
    pool = _pool(store_url, gcp_credentials="no-such-block")

    @kinetic_task(name=f"refused-{uuid.uuid4().hex[:6]}", work_pool=pool)
    def one() -> int:
        return 1

    @flow
    def pipeline():
        return one()

    with pytest.raises(ValueError) as failure:
        pipeline()
    message = str(failure.value)
    assert "gcp_credentials='no-such-block'" in message and pool in message
    assert f"kinetic-prefect pool-set {pool} gcp_credentials=" in message  # the fix
    assert open_store(gcs_bucket).list("") == [], "nothing may be uploaded"


def test_cloud_build_and_artifact_registry_clients_take_the_block_credentials():
    from google.auth.credentials import AnonymousCredentials

    from kinetic_prefect.shared.builders import CloudBuildBuilder

    credentials = AnonymousCredentials()
    builder = CloudBuildBuilder("p", "us-central1", "repo", "gs://staging", credentials=credentials)
    assert builder.storage_client._credentials is credentials
    assert builder.registry_client._transport._credentials is credentials
    assert builder.build_client._transport._credentials is credentials
