"""Issue 57, defect 4: a key rotation under a running polling worker.

A polling worker read the ``kinetic-signing-key`` block once per process; after the documented rotation (the block
updated) every call was refused with "the worker's signing key differs", though caller and worker read the same
block, and nothing said to restart. Now a worker whose key does not verify a run reads the block again (at most once
per ``key_blocks.REREAD_SECONDS``) and goes on with the new key. The calls forward an ``env=`` value, so the signed
forwarded-env block (issue 54, finding 2) is checked under each key too.

One real polling kinetic-local worker (≈ 8 s to start), two calls, and the re-read's wait (5 s).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest
from prefect import flow
from prefect.blocks.system import Secret
from worker_fixture import WorkerProcess, new_pool

from kinetic_prefect import kinetic_task, signing
from kinetic_prefect.contract import Env
from kinetic_prefect.shared import key_blocks


@pytest.fixture
def block_key(prefect_server, monkeypatch):
    """The signing key as ``kinetic-up`` keeps it: the Secret block only (no key in the environment)."""
    monkeypatch.delenv(Env.SIGNING_KEY, raising=False)
    monkeypatch.delenv(Env.SIGNING_KEY_PREVIOUS, raising=False)
    try:
        before = str(Secret.load(signing.SECRET_BLOCK).get())
    except ValueError:
        before = None
    Secret(value="first-key-" + uuid.uuid4().hex).save(signing.SECRET_BLOCK, overwrite=True)
    key_blocks.forget_signing_key()
    yield
    if before is None:
        Secret.delete(signing.SECRET_BLOCK)
    else:
        Secret(value=before).save(signing.SECRET_BLOCK, overwrite=True)
    key_blocks.forget_signing_key()


@pytest.mark.slow
def test_a_rotation_needs_no_worker_restart(block_key, tmp_path, monkeypatch) -> None:
    pool = new_pool("rotation")
    worker = WorkerProcess(pool, tmp_path / "worker.log", {Env.CACHE_DIR: str(tmp_path / "cache")}).start()
    monkeypatch.setenv("WANDB_API_KEY", "token-1")

    @kinetic_task(name=f"rotation-{uuid.uuid4().hex[:6]}", work_pool=pool, submission="worker", env=["WANDB_API_KEY"])
    def forwarded() -> str:
        import os

        return os.environ["WANDB_API_KEY"]

    @flow
    def pipeline() -> str:
        return forwarded()

    try:
        assert pipeline() == "token-1"  # the worker reads the first key now
        Secret(value="second-key-" + uuid.uuid4().hex).save(signing.SECRET_BLOCK, overwrite=True)  # the rotation
        key_blocks.forget_signing_key()  # a caller started after it
        time.sleep(getattr(key_blocks, "REREAD_SECONDS", 5.0))
        monkeypatch.setenv("WANDB_API_KEY", "token-2")
        assert pipeline() == "token-2"
    finally:
        worker.stop()
    assert "signing key differs" not in (tmp_path / "worker.log").read_text()


@pytest.mark.slow
def test_a_worker_with_another_key_fails_the_call_once_with_signing_key_mismatch(
    prefect_server, tmp_path, monkeypatch
) -> None:
    """Caller and polling worker given different keys (not a rotation: the worker's key is in its environment, so
    reading again changes nothing): the call raises SigningKeyMismatch naming the fix, and ``retries=2`` makes no
    second job run, as on the in-process path. On the main of its day: KineticJobCrashed, and 3 refused job runs."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from kinetic_prefect.errors import SigningKeyMismatch

    pool = new_pool("mismatch")
    env = {Env.SIGNING_KEY: "workers-key-" + uuid.uuid4().hex, Env.CACHE_DIR: str(tmp_path / "cache")}
    worker = WorkerProcess(pool, tmp_path / "worker.log", env).start()
    monkeypatch.setenv(Env.SIGNING_KEY, "callers-key-" + uuid.uuid4().hex)
    name = f"mismatch-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, submission="worker", retries=2, retry_delay_seconds=0)
    def nothing() -> None:
        return None

    @flow
    def pipeline() -> None:
        nothing()

    try:
        with pytest.raises(SigningKeyMismatch, match="signing key differs"):
            pipeline()
    finally:
        worker.stop()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name)))
    assert len(runs) == 1, [r.name for r in runs]


@pytest.mark.no_server
def test_the_block_is_read_again_at_most_once_per_interval(monkeypatch) -> None:
    """A stream of runs signed with a key nobody holds must not become a stream of block reads; a key read from the
    block is read again after KEY_TTL_SECONDS."""
    reads = []

    async def aload(name):
        reads.append(name)
        return SimpleNamespace(get=lambda: f"key-{len(reads)}")

    monkeypatch.delenv(Env.SIGNING_KEY, raising=False)
    monkeypatch.setattr(Secret, "aload", aload)
    key_blocks.forget_signing_key()
    try:
        first = asyncio.run(key_blocks.signing_key())
        assert asyncio.run(key_blocks.signing_key_again()) is first and len(reads) == 1  # read a moment ago
        monkeypatch.setattr(key_blocks, "REREAD_SECONDS", 0.0)
        again = asyncio.run(key_blocks.signing_key_again())
        assert again is not None and again.identity() != first.identity() and len(reads) == 2
        # a long-lived caller, whose signatures the worker refuses, picks the rotated key up too
        assert asyncio.run(key_blocks.signing_key()) is again and len(reads) == 2
        monkeypatch.setattr(key_blocks, "KEY_TTL_SECONDS", 0.0)
        assert asyncio.run(key_blocks.signing_key()).identity() != again.identity() and len(reads) == 3
    finally:
        key_blocks.forget_signing_key()
