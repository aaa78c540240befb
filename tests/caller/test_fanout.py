"""Fan-out: `.map()` runs jobs concurrently, bounded by Prefect's own tag concurrency limits."""

from __future__ import annotations

import uuid

import pytest
from prefect import flow, get_client

from kinetic_prefect import kinetic_task


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.slow
def test_map_runs_jobs_concurrently_within_a_tag_concurrency_limit():
    tag = f"fanout-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=tag, concurrency_limit=2)

    @kinetic_task(name=f"span-{tag}", tags=[tag])
    def span(i: int) -> tuple:
        import time as _time

        start = _time.time()
        _time.sleep(2)
        return start, _time.time()

    @flow
    def pipeline():
        return span.map(range(6)).result()

    spans = pipeline()
    assert len(spans) == 6
    # Concurrent (a loop would give 1), and never more than the limit. (It once let 3 or 4 run: the job's run hung
    # under the task run itself, whose states Prefect's server then mirrored from the job; the job's Pending took the
    # task out of Running and gave its slot away.)
    assert _max_overlap(spans) == 2, spans
