"""A Prefect task timeout stops the kinetic job instead of leaving it running."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from prefect import flow

from kinetic_prefect import kinetic_task


@pytest.mark.slow
def test_task_timeout_stops_the_job(tmp_path):
    pid_file = tmp_path / "pid"

    @kinetic_task(name=f"too-slow-{uuid.uuid4().hex[:6]}", timeout_seconds=3)
    def too_slow(path: str) -> int:
        import pathlib
        import time as t

        pathlib.Path(path).write_text(str(os.getpid()))
        t.sleep(60)
        return 1

    @flow
    def pipeline():
        return too_slow(str(pid_file))

    started = time.time()
    with pytest.raises(TimeoutError):
        pipeline()
    assert time.time() - started < 30, "the timeout fired while the job was running, not after it"
    job_pid = int(pid_file.read_text())
    deadline = time.time() + 15  # well before the 60 s sleep would end
    while True:
        try:
            os.kill(job_pid, 0)
        except ProcessLookupError:
            break
        assert time.time() < deadline, "the job kept running after the task timed out"
        time.sleep(0.2)
