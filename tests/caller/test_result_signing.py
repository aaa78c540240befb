"""Prefect's result records in ``<store>/results`` are signed (issue 45, finding 2): a writer of the store who
replaces a cached task's record cannot run code in the caller that hits the cache.

The attacker runs as one would: after a flow cached a kinetic task's result, they rewrite the record in the store
(local folder, or a ``gs://`` bucket on fake-gcs-server) with a pickle whose ``__reduce__`` writes a marker file,
keeping Prefect's record format: the result replaced under the record's own serializer, the serializer switched
to ``pickle`` on a task that persists JSON, or the record's signature removed. The flow runs again: the marker
never exists, the task runs again (a cache miss: a second job) and returns the right value, a warning names the
record, and the record written over it is signed (a third run is a cache hit).
"""

from __future__ import annotations

import base64
import json
import pickle
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.cache_policies import INPUTS
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task
from kinetic_prefect.storage import open_store
from kinetic_prefect.workers.base import load_template


class _Boom:
    """Unpickling this writes a file: stands in for code a forged pickle would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("pwned",))


ATTACKS = {
    # the record keeps its serializer (pickle) and its old signature; only the pickled value changes
    "forged-pickle": dict(serializer=None, switch_to=None, drop_signature=False),
    # a task that persists JSON: the record says "pickle" now, so Prefect would unpickle the forged bytes
    "switched-to-pickle": dict(serializer="json", switch_to={"type": "pickle", "picklelib": "cloudpickle"}),
    # the forged record with no signature beside it, as a writer without the key would leave it
    "signature-removed": dict(serializer=None, switch_to=None, drop_signature=True),
}


def _forged(record: bytes, proof: Path, switch_to: dict | None) -> bytes:
    """The record as the attacker rewrites it: Prefect's own JSON format, a pickle bomb as the result."""
    fields = json.loads(record)
    if switch_to is not None:
        fields["metadata"]["serializer"] = switch_to
    fields["result"] = base64.b64encode(pickle.dumps(_Boom(str(proof)))).decode()
    return json.dumps(fields).encode()


def _jobs(flow_name: str) -> int:
    with get_client(sync_client=True) as client:
        return len(client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name]))))


def _cached_flow(name: str, work_pool: str | None, serializer: str | None):
    options = {"result_serializer": serializer} if serializer else {}

    @kinetic_task(name=name, work_pool=work_pool, cache_policy=INPUTS, persist_result=True, **options)
    def expensive(token: str) -> str:
        return "computed for " + token

    @flow
    def run(token: str) -> None:
        states.append(expensive(token, return_state=True))

    states: list = []

    def pipeline(token: str):
        """The kinetic task's final state in this run of the flow."""
        run(token)
        return states.pop()

    return pipeline


def _run_the_attack(pipeline, name, token, proof, caplog, read, write, delete, switch_to, drop_signature):
    """Run once, rewrite the record through ``read``/``write``/``delete`` (store keys or paths the record's
    metadata names), run again; returns the record's storage key."""
    state = pipeline(token)
    assert state.result() == f"computed for {token}"
    storage_key = state.data.metadata.storage_key
    assert _jobs(name) == 1

    write(storage_key, _forged(read(storage_key), proof, switch_to))
    if drop_signature:
        delete(storage_key + ".sig")
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = pipeline(token)
    assert not proof.exists(), "a forged result record was unpickled in the caller"
    assert again.result() == f"computed for {token}"
    assert again.name != "Cached", "a tampered record must be a cache miss"
    assert _jobs(name) == 2, "the task runs again instead of using the tampered record"
    return storage_key


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(ATTACKS), ids=list(ATTACKS))
def test_a_rewritten_result_record_in_a_local_store_is_a_cache_miss_never_unpickled(
    store_dir, tmp_path, monkeypatch, caplog, attack
):
    """7-24 s each on 2 loaded cores (the first pays for the job environment): three runs of a flow, two jobs."""
    import kinetic_prefect.caller._prefect as kp

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "results-key-" + uuid.uuid4().hex)
    kp.forget_signing_key()
    how = ATTACKS[attack]
    name = f"signed-results-{uuid.uuid4().hex[:6]}"
    token = uuid.uuid4().hex
    proof = tmp_path / "proof"
    pipeline = _cached_flow(name, None, how["serializer"])

    def path(storage_key: str) -> Path:
        return Path(storage_key) if Path(storage_key).is_absolute() else store_dir / "results" / storage_key

    storage_key = _run_the_attack(
        pipeline,
        name,
        token,
        proof,
        caplog,
        read=lambda key: path(key).read_bytes(),
        write=lambda key, data: path(key).write_bytes(data),
        delete=lambda key: path(key).unlink(missing_ok=True),
        switch_to=how.get("switch_to"),
        drop_signature=how.get("drop_signature", False),
    )
    record = path(storage_key)
    assert record.is_relative_to(store_dir / "results"), f"with a key, results live in the store: {record}"
    assert str(record) in caplog.text, f"the warning names the record:\n{caplog.text}"
    assert "cache miss" in caplog.text
    assert (store_dir / "results" / (storage_key + ".sig")).exists()
    assert pipeline(token).name == "Cached", "the record written over the forgery is signed: a cache hit"
    assert _jobs(name) == 2


def _signed_store(folder: Path, key: bytes):
    """Prefect's own ResultStore over ``SignedResults`` around a local folder (a stand-in block id: a saved block's
    records name it)."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore

    from kinetic_prefect import signing
    from kinetic_prefect.caller.results import SignedResults

    inner = LocalFileSystem(basepath=str(folder))
    inner._block_document_id = uuid.uuid4()
    return ResultStore(result_storage=SignedResults.wrap(inner, str(folder), signing.Keyring([key])))


def test_prefects_result_store_reads_only_signed_records_sync_and_async(tmp_path, caplog):
    """Both of Prefect's read paths (a sync task's ``exists``/``read``, an async task's ``aexists``/``aread``)
    parse nothing that is not signed; a record swapped between ``exists`` and ``read`` is never read."""
    import asyncio

    from kinetic_prefect.errors import StoreTampered

    folder, proof = tmp_path / "results", tmp_path / "proof"
    store = _signed_store(folder, b"k1")
    store.write({"v": 1}, key="sync")
    asyncio.run(store.awrite({"v": 2}, key="async"))
    assert (folder / "sync.sig").exists() and (folder / "async.sig").exists()
    fresh = _signed_store(folder, b"k1")  # another process: nothing in Prefect's memory cache
    assert fresh.exists("sync") and fresh.read("sync").result == {"v": 1}
    assert asyncio.run(fresh.aexists("async")) and asyncio.run(fresh.aread("async")).result == {"v": 2}

    genuine = (folder / "sync").read_bytes()
    for name in ("sync", "async"):
        (folder / name).write_bytes(_forged((folder / name).read_bytes(), proof, None))
    with caplog.at_level("WARNING"):
        assert not _signed_store(folder, b"k1").exists("sync")
        assert not asyncio.run(_signed_store(folder, b"k1").aexists("async"))
    assert f"{folder}/sync" in caplog.text and f"{folder}/async" in caplog.text
    with pytest.raises(StoreTampered, match="does not match its signature"):
        _signed_store(folder, b"k1").read("sync")
    assert not _signed_store(folder, b"other-key").exists("async"), "another key's signature is no signature"
    assert not proof.exists()

    (folder / "sync").write_bytes(genuine)
    racing = _signed_store(folder, b"k1")
    assert racing.exists("sync")
    (folder / "sync").write_bytes(_forged(genuine, proof, None))  # swapped after the cache lookup found it
    assert racing.read("sync").result == {"v": 1}, "read() returns the bytes exists() verified"
    assert not proof.exists()


def _gcs_pool(store_url: str) -> str:
    name = f"signed-gcs-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


@pytest.mark.slow
def test_a_rewritten_result_record_in_a_gcs_store_is_a_cache_miss_never_unpickled(
    gcs_bucket, tmp_path, monkeypatch, caplog
):
    """≈ 14 s: the same attack on a gs:// store (fake-gcs-server), the record rewritten through the bucket."""
    import kinetic_prefect.caller._prefect as kp

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "results-key-" + uuid.uuid4().hex)
    monkeypatch.setenv("KINETIC_STORE", str(tmp_path / "local-store"))  # only the pool names the bucket
    kp.forget_signing_key()
    store_url = f"{gcs_bucket}/team"
    bucket = open_store(store_url)
    name = f"signed-gcs-results-{uuid.uuid4().hex[:6]}"
    token = uuid.uuid4().hex
    proof = tmp_path / "proof"
    pipeline = _cached_flow(name, _gcs_pool(store_url), None)

    storage_key = _run_the_attack(
        pipeline,
        name,
        token,
        proof,
        caplog,
        read=lambda key: bucket.get_bytes(f"results/{key}"),
        write=lambda key, data: bucket.put_bytes(f"results/{key}", data),
        delete=lambda key: bucket.delete(f"results/{key}"),
        switch_to=None,
        drop_signature=False,
    )
    assert f"{store_url}/results/{storage_key}" in caplog.text, f"the warning names the record:\n{caplog.text}"
    assert bucket.get_bytes(f"results/{storage_key}.sig")
    assert pipeline(token).name == "Cached", "the record written over the forgery is signed: a cache hit"
    assert _jobs(name) == 2
