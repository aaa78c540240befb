"""Authenticated store objects: a store writer without the key cannot run code in the caller or the job."""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task


class _Boom:
    """Unpickling this writes a file: stands in for code a forged pickle would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("pwned",))


def _forge_results_while_running(store_dir: Path, name: str, proof: Path, stop: threading.Event) -> None:
    """A store writer that replaces every result.pkl the moment it appears."""
    while not stop.is_set():
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
        for run in runs:
            result = store_dir / "runs" / run.job_variables["env"]["KINETIC_RUN_ID"] / "result.pkl"
            if result.exists() and result.read_bytes() != pickle.dumps(_Boom(str(proof))):
                result.write_bytes(pickle.dumps(_Boom(str(proof))))
        time.sleep(0.02)


@pytest.mark.parametrize("signed", [True, False], ids=["with-key", "without-key"])
@pytest.mark.slow
def test_a_forged_result_never_runs_code_in_the_caller(store_dir, tmp_path, monkeypatch, signed):
    from kinetic_prefect.errors import StoreTampered

    if signed:
        monkeypatch.setenv("KINETIC_SIGNING_KEY", "test-key-" + uuid.uuid4().hex)
    name = f"forged-{uuid.uuid4().hex[:6]}"
    proof = tmp_path / "proof"

    @kinetic_task(name=name)
    def slow_value() -> int:
        import time as _time

        _time.sleep(1)  # the runner writes result.pkl, then outcome.json: room for the forger
        return 7

    @flow
    def pipeline():
        return slow_value()

    # Deterministic instead of racing: forge the result between the job's write and the caller's read.
    import kinetic_prefect.caller.outcomes as outcomes

    real = outcomes.read_signed

    def forge_then_read(store, object_key, key):
        if object_key.endswith("result.pkl"):
            (store_dir / object_key).write_bytes(pickle.dumps(_Boom(str(proof))))
        return real(store, object_key, key)

    monkeypatch.setattr(outcomes, "read_signed", forge_then_read)
    if signed:
        with pytest.raises(StoreTampered, match="does not match its signature"):
            pipeline()
        assert not proof.exists(), "a forged result was unpickled in the caller"
    else:  # documented: without a key the store is trusted, and the caller says so
        with pytest.warns(UserWarning, match="unauthenticated"):
            import kinetic_prefect.caller._prefect as kp

            kp.forget_signing_key()
            pipeline()
        assert proof.exists()


def test_signed_calls_work_end_to_end_and_the_key_is_stored_nowhere(store_dir, monkeypatch):
    secret = "k-" + uuid.uuid4().hex
    monkeypatch.setenv("KINETIC_SIGNING_KEY", secret)
    name = f"signed-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def double(x: int) -> int:
        import os as _os

        assert _os.environ["KINETIC_SIGNING_KEY"]  # the job verifies its payload with it
        return 2 * x

    @flow
    def pipeline():
        return double(21)

    assert pipeline() == 42
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    assert secret not in run.model_dump_json()
    run_dir = store_dir / "runs" / run.job_variables["env"]["KINETIC_RUN_ID"]
    assert (run_dir / "outcome.json.sig").exists()
    assert not any(secret.encode() in p.read_bytes() for p in store_dir.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_forged_payload_is_refused_by_the_job(store_dir, monkeypatch):
    """The payload's sha256 travels in the job variables; with a key the store copy must also be signed."""
    from kinetic_prefect import signing
    from kinetic_prefect.errors import KineticJobSetupError

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "payload-key")
    import kinetic_prefect.caller.uploads as uploads

    real_put = signing.put

    def put_then_drop_signature(store, object_key, data, key, **kwargs):
        real_put(store, object_key, data, key, **kwargs)
        if object_key.endswith("payload.pkl"):
            store.delete(object_key + signing.SUFFIX)  # as if someone wrote the payload without the key

    monkeypatch.setattr(uploads.signing, "put", put_then_drop_signature)

    @kinetic_task(name=f"payload-{uuid.uuid4().hex[:6]}")
    def one() -> int:
        return 1

    @flow
    def pipeline():
        return one()

    with pytest.raises(KineticJobSetupError, match="verifying the payload.*no signature"):
        pipeline()


@pytest.mark.slow
def test_the_missing_key_warning_comes_once_for_a_whole_map(monkeypatch):
    """The calls of a .map() all missed the key cache at once and each warned (28 times in one run). ≈ 8 s: a
    real 6-input map."""
    import warnings

    import kinetic_prefect.caller._prefect as kp

    monkeypatch.delenv("KINETIC_SIGNING_KEY", raising=False)
    monkeypatch.delenv("KINETIC_UNSIGNED_OK", raising=False)

    @kinetic_task(name=f"unsigned-map-{uuid.uuid4().hex[:6]}")
    def double(x: int) -> int:
        return 2 * x

    @flow
    def pipeline():
        return [f.result() for f in double.map(range(6))]

    kp.forget_signing_key()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pipeline() == [0, 2, 4, 6, 8, 10]
    assert sum("unauthenticated" in str(w.message) for w in caught) == 1, [str(w.message)[:80] for w in caught]
