"""Issue 45, finding 5: a shared store is signed by default. With no key, a gs:// store is refused before anything is
uploaded or launched, on the caller and on the worker; an explicit opt-out runs unsigned; a local store on one
machine stays keyless. (One call each against fake-gcs-server: about 10 s in all.)"""

from __future__ import annotations

import uuid

import pytest
from prefect import flow
from test_gcs import _pool_with_store

from kinetic_prefect import kinetic_task
from kinetic_prefect.storage import open_store


def _unkeyed(monkeypatch) -> None:
    monkeypatch.delenv("KINETIC_SIGNING_KEY", raising=False)
    import kinetic_prefect.caller._prefect as kp

    kp.forget_signing_key()  # no Secret block either: the session's server has none


def test_a_gcs_store_without_a_key_is_refused_before_anything_is_uploaded(gcs_bucket, monkeypatch):
    from kinetic_prefect.errors import SigningKeyMissing

    _unkeyed(monkeypatch)
    store_url = f"{gcs_bucket}/kinetic"
    pool = _pool_with_store(store_url)

    @kinetic_task(name=f"unsigned-{uuid.uuid4().hex[:6]}", work_pool=pool)
    def one() -> int:
        return 1

    @flow
    def pipeline():
        return one()

    with pytest.raises(SigningKeyMissing, match=r"KINETIC_UNSIGNED_SHARED_STORE=1") as caught:
        pipeline()
    assert "kinetic-prefect up" in str(caught.value) and store_url in str(caught.value)
    assert list(open_store(store_url).list("")) == [], "something was uploaded before the refusal"

    monkeypatch.setenv("KINETIC_UNSIGNED_SHARED_STORE", "1")  # the explicit opt-out
    with pytest.warns(UserWarning, match="unauthenticated"):
        import kinetic_prefect.caller._prefect as kp

        kp.forget_signing_key()
        assert pipeline() == 1


@pytest.mark.no_server
def test_the_worker_refuses_unsigned_jobs_on_a_shared_store_and_a_local_store_stays_keyless(monkeypatch):
    from kinetic_prefect import signing
    from kinetic_prefect.shared.key_blocks import unsigned_refusal

    monkeypatch.delenv("KINETIC_UNSIGNED_SHARED_STORE", raising=False)
    assert "no signing key" in (unsigned_refusal("gs://bucket/kinetic", None) or "")
    assert unsigned_refusal("gs://bucket/kinetic", signing.Keyring([b"k"])) is None
    assert unsigned_refusal("/home/me/.cache/kinetic-prefect/store", None) is None
    monkeypatch.setenv("KINETIC_UNSIGNED_SHARED_STORE", "1")
    assert unsigned_refusal("gs://bucket/kinetic", None) is None
