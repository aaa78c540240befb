"""Benchmark (not collected by default: the name has no ``test_`` prefix): a sweep on kinetic-gke warm pods against
the same calls one after another on cold Jobs, on the real control plane with Docker pods (issue 20's goal: a
64-input sweep with 8 slots creates 8 pods, not 64).

    KINETIC_BENCH_INPUTS=64 KINETIC_BENCH_SLOTS=8 CI=1 uv run --all-extras pytest -q -s tests/gke/bench_gke_sweep.py

One run each, interleaved as: the sweep (``.map()`` over the inputs on a pool with warm pods,
``keep_warm_seconds=30``, ``KINETIC_SWEEP_SLOTS=SLOTS``: its inputs ride in slot pods), then the same inputs as
sequential calls on a pool without warm pods (a Job per call). Pods and Jobs are counted through the Kubernetes
API, job runs through Prefect's. Written to ``bench/results/gke_sweep.json``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client as k8s
from prefect import flow
from test_gke_cluster import _cluster_block, _make_pool, job_image  # noqa: F401  (job_image is a fixture)
from test_spine import job_runs

from kinetic_prefect import kinetic_task

RESULTS = Path(__file__).resolve().parents[2] / "bench/results/gke_sweep.json"


def _task(pool: str, base_image: str):
    @kinetic_task(
        name=f"bench-sweep-{uuid.uuid4().hex[:6]}",
        work_pool=pool,
        accelerator="cpu",
        base_image=base_image,
        # the emulator's address as a plain job variable: a forwarded env= value is a secret, which keeps calls out
        # of slots
        job_variables={"env": {"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}},
    )
    def noop(x: int) -> int:
        return x

    return noop


def _pool_objects(kube, pool: str) -> tuple[int, int]:
    """(Jobs, pods) the pool's calls created, through the API."""
    selector = f"kinetic.prefect.io/work-pool={pool}"
    jobs = k8s.BatchV1Api(kube.api()).list_namespaced_job("default", label_selector=selector).items
    pods = k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=selector).items
    return len(jobs), len(pods)


@pytest.mark.timeout(3600)
def test_warm_sweep_against_sequential_cold_calls(
    kube,
    gcs_bucket,
    local_registry,
    job_image,  # noqa: F811
    python_base_image,
    monkeypatch,
):
    inputs = int(os.environ.get("KINETIC_BENCH_INPUTS", "64"))
    slots = int(os.environ.get("KINETIC_BENCH_SLOTS", "8"))
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", str(slots))
    os.environ.setdefault("KINETIC_IN_PROCESS_CONCURRENCY", str(max(slots, 4)))
    block = _cluster_block(kube)
    warm_pool = _make_pool(
        block,
        f"{gcs_bucket}/warm",
        local_registry,
        poll_seconds=0.25,
        keep_warm_seconds=30,
        finished_job_ttl=3600,
        pod_watch_timeout_seconds=120,
    )
    cold_pool = _make_pool(
        block,
        f"{gcs_bucket}/cold",
        local_registry,
        poll_seconds=0.25,
        finished_job_ttl=3600,
        pod_watch_timeout_seconds=120,
    )
    warm_task = _task(warm_pool, python_base_image)

    @flow
    def sweep():
        return warm_task.map(range(inputs)).result()

    started = time.perf_counter()
    assert sweep() == list(range(inputs))
    warm_seconds = time.perf_counter() - started
    warm_jobs, warm_pods = _pool_objects(kube, warm_pool)
    warm_runs = len(job_runs(warm_task.name))
    print(f"warm sweep: {warm_seconds:.1f} s, {warm_jobs} Jobs, {warm_pods} pods, {warm_runs} job runs", flush=True)
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")  # the sequential calls: a Job each, as before slots

    cold_task = _task(cold_pool, python_base_image)

    @flow
    def loop():
        return [cold_task(x) for x in range(inputs)]

    started = time.perf_counter()
    assert loop() == list(range(inputs))
    cold_seconds = time.perf_counter() - started
    cold_jobs, cold_pods = _pool_objects(kube, cold_pool)

    result = {
        "what": "no-op @kinetic_task on kinetic-gke against the real control plane (fake nodes, Docker pods): "
        f".map() over {inputs} inputs in {slots} slots (warm pods), against {inputs} sequential calls on cold "
        "Jobs; pods and Jobs counted through the Kubernetes API",
        "inputs": inputs,
        "slots": slots,
        "warm_sweep_seconds": round(warm_seconds, 1),
        "warm_sweep_jobs": warm_jobs,
        "warm_sweep_pods": warm_pods,
        "warm_sweep_job_runs": warm_runs,
        "sequential_cold_seconds": round(cold_seconds, 1),
        "sequential_cold_jobs": cold_jobs,
        "sequential_cold_pods": cold_pods,
        "sequential_over_sweep": round(cold_seconds / warm_seconds, 2),
        "load_average": [round(x, 1) for x in os.getloadavg()],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    assert warm_pods <= slots, result
