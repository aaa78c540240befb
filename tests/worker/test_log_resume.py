"""A polling worker killed (``kill -9``) and restarted resumes the job's log from the last line it stored in
Prefect: every line of the job reaches the run's logs exactly once (the job's own ``job.log`` has them all)."""

from __future__ import annotations

import time
import uuid

import pytest
from prefect import flow
from test_api_outages import _job_log_lines
from test_lifecycle import alive, final_job_run, in_thread, read_pid, sleeper  # noqa: F401

from kinetic_prefect import kinetic_task

LINES, PER_SECOND = 400, 20


@pytest.mark.timeout(900)  # the session's server start (minutes at a high load average) counts in the first test
@pytest.mark.slow
def test_a_restarted_worker_forwards_every_line_once(worker_factory, tmp_path):
    worker = worker_factory().start()
    name = f"resume-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"

    @kinetic_task(name=name, work_pool=worker.pool, submission="worker")
    def chatty(pid_path: str, lines: int, period: float) -> int:
        import os
        import pathlib
        import time as _time

        pathlib.Path(pid_path).write_text(str(os.getpid()))
        for i in range(lines):
            print(f"line-{i:05d}", flush=True)
            _time.sleep(period)
        return lines

    @flow
    def pipeline():
        return chatty(str(pid_file), LINES, 1 / PER_SECOND)

    thread, box = in_thread(pipeline)
    pid = read_pid(pid_file, timeout=180)
    time.sleep(5)
    worker.kill()
    time.sleep(4)
    assert alive(pid), "the job must survive its worker"
    worker.start()
    thread.join(240)
    assert box.get("value") == LINES, box
    [run] = final_job_run(name, timeout=60)
    assert run.state.is_completed(), run.state
    stored = _job_log_lines(run.id)
    expected = [f"line-{i:05d}" for i in range(LINES)]
    missing = sorted(set(expected) - set(stored))
    assert not missing, f"{len(missing)} of {LINES} lines never reached the run's logs, e.g. {missing[:5]}"
    assert stored == expected, f"{len(stored) - len(set(stored))} lines were forwarded twice"


def test_a_log_request_whose_answer_was_lost_is_not_stored_twice():
    """An outage can cut a request off after the server stored it: the retry sends only what is missing."""
    import asyncio

    import httpx
    from prefect import get_client

    from kinetic_prefect.shared.outages import Outage
    from kinetic_prefect.workers.log_forwarding import JobLogForwarder

    @flow
    def parent() -> str:
        from prefect.runtime import flow_run

        return flow_run.id

    flow_run_id = parent()
    marker = uuid.uuid4().hex[:8]

    class LosesTheFirstAnswer:
        """The server stores the first request, then the connection drops before its answer arrives."""

        def __init__(self, client):
            self.client, self.lost = client, False

        async def create_logs(self, logs):
            await self.client.create_logs(logs)
            if not self.lost:
                self.lost = True
                raise httpx.ReadError("connection dropped before the answer")

        def __getattr__(self, name):
            return getattr(self.client, name)

    async def forward() -> list[str]:
        async with get_client() as client:
            forwarder = JobLogForwarder(LosesTheFirstAnswer(client), flow_run_id, logging_console(), Outage("test"))
            for i in range(6):
                forwarder.emit(f"{marker}-{i}")
            assert await forwarder.flush()
            from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            return [log.message for log in logs if log.message.startswith(marker)]

    assert sorted(asyncio.run(forward())) == [f"{marker}-{i}" for i in range(6)]


def logging_console():
    import logging

    return logging.getLogger("kinetic-test-console")
