"""Benchmark (not collected by default: the name has no ``test_`` prefix): launch overhead of an N-host group against
a single-host call, side by side on the real control plane with Docker pods (issue 13's goal: ≤ 1.5× for N = 4).

    KINETIC_BENCH_REPEATS=5 CI=1 uv run --all-extras pytest -q -s tests/gke/bench_gke_groups.py

Each round runs a no-op call with hosts=1 and with hosts=4 back to back (alternating which goes first); medians of
the wall times from the call to the returned value; written to ``bench/results/gke_groups.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from pathlib import Path

from prefect import flow
from test_gke_cluster import _cluster_block, _make_pool, job_image  # noqa: F401  (job_image is a fixture)

from kinetic_prefect import kinetic_task

RESULTS = Path(__file__).resolve().parents[2] / "bench/results/gke_groups.json"


def _call(pool: str, base_image: str, hosts: int) -> float:
    @kinetic_task(
        name=f"bench-{hosts}-{uuid.uuid4().hex[:6]}",
        work_pool=pool,
        accelerator="cpu",
        base_image=base_image,
        env=["STORAGE_EMULATOR_HOST"],
        job_variables={"hosts": hosts},
    )
    def noop() -> int:
        import os

        return int(os.environ.get("KINETIC_NUM_HOSTS", "1"))

    @flow
    def pipeline():
        return noop()

    started = time.perf_counter()
    assert pipeline() == hosts
    return time.perf_counter() - started


def test_group_launch_overhead(kube, gcs_bucket, local_registry, job_image, python_base_image):  # noqa: F811
    repeats = int(os.environ.get("KINETIC_BENCH_REPEATS", "5"))
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/bench", local_registry, poll_seconds=0.25)
    _call(pool, python_base_image, 1)  # warm: image pulled, modules imported
    single, group = [], []
    for round_ in range(repeats):
        order = (1, 4) if round_ % 2 == 0 else (4, 1)
        for hosts in order:
            (single if hosts == 1 else group).append(_call(pool, python_base_image, hosts))
    result = {
        "what": "no-op @kinetic_task on kinetic-gke against the real control plane (fake nodes, Docker pods): "
        "wall seconds from the call to the value, hosts=1 vs hosts=4, alternating, same run",
        "repeats": repeats,
        "single_host_s": [round(x, 2) for x in single],
        "four_hosts_s": [round(x, 2) for x in group],
        "single_host_median_s": round(statistics.median(single), 2),
        "four_hosts_median_s": round(statistics.median(group), 2),
        "ratio": round(statistics.median(group) / statistics.median(single), 2),
        "goal_ratio": 1.5,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
