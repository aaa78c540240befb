"""Identical concurrent calls of a cached kinetic task run one job; the other callers wait for its result."""

from __future__ import annotations

import threading
import uuid

import pytest
from prefect import flow, get_client
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task


@pytest.mark.slow
def test_two_flows_calling_the_same_cached_task_run_one_job():
    name = f"isolated-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, cache_policy=INPUTS + TASK_SOURCE, persist_result=True)
    def expensive(x: int) -> int:
        import time as _time

        _time.sleep(3)
        return x * x

    @flow
    def caller(x: int) -> int:
        return expensive(x)

    results: list = []
    threads = [threading.Thread(target=lambda: results.append(caller(12))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert results == [144, 144]
    with get_client(sync_client=True) as client:
        jobs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    assert len(jobs) == 1, f"{len(jobs)} jobs ran for one cache key"


def test_the_store_lock_has_one_holder_across_store_clients(tmp_path, gcs_bucket):
    from kinetic_prefect.caller.locks import StoreLockManager

    for url in (str(tmp_path / "store"), f"{gcs_bucket}/locks-test"):
        first, second = StoreLockManager(url), StoreLockManager(url)  # two "machines"
        assert first.acquire_lock("k", "a", acquire_timeout=0)
        assert not second.acquire_lock("k", "b", acquire_timeout=0.5)
        assert second.is_locked("k") and not second.is_lock_holder("k", "b")
        first.release_lock("k", "a")
        assert second.acquire_lock("k", "b", acquire_timeout=0)
        second.release_lock("k", "b")
        assert first.acquire_lock("k", "c", hold_timeout=0.1)
        assert second.acquire_lock("k", "d", acquire_timeout=5), "an expired lock is broken"
