"""Worker side: a job's output lines into its run's Prefect logs, each one stored once.

The follow loop sends them itself (awaited, and through an API outage: ``outages.Outage``) instead of
handing them to Prefect's background log sender, which drops a batch it could not send within about a
minute and says nothing of what it sent. So the launcher learns when the output it read has *reached*
Prefect (``JobLauncher.forwarded``) and records only that: a worker killed and restarted resumes from the
last stored line (no line lost, none sent twice), and a server away for minutes loses no line.
The lines still go to the worker's console (the caller's terminal, in-process) as they are read.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from prefect.client.schemas.actions import LogCreate

from kinetic_prefect.contract import JOB_OUTPUT_LOGGER
from kinetic_prefect.shared.outages import Outage

REQUEST_BYTES = 1 << 20  # a flood read in one poll (up to 8 MiB) goes in several requests

# The runner's one-line reason a job failed (pod/runner.py prints it to stderr): logged at ERROR, so the UI's log
# marks it as the failure it is; every other line of the job's output is INFO.
RUNNER_FAILURE_LINES = ("kinetic runner: failed ", "kinetic runner: also failed ")


def by_level(text: str) -> list[tuple[int, str]]:
    """``text`` (one or more lines) cut into runs of lines of one log level, in order."""
    chunks: list[tuple[int, list[str]]] = []
    for line in text.split("\n"):
        level = logging.ERROR if line.startswith(RUNNER_FAILURE_LINES) else logging.INFO
        if chunks and chunks[-1][0] == level == logging.INFO:
            chunks[-1][1].append(line)
        else:
            chunks.append((level, [line]))
    return [(level, "\n".join(lines)) for level, lines in chunks]


class JobLogForwarder:
    """``emit`` (from any thread, as launchers stream from threads) queues a batch of lines; ``flush`` stores them."""

    def __init__(self, client: Any, flow_run_id: Any, console: Any, outage: Outage, to_api: bool = True):
        self.client, self.flow_run_id, self.console, self.outage = client, flow_run_id, console, outage
        self.to_api = to_api
        self._pending: list[LogCreate] = []
        self._lock = threading.Lock()

    def emit(self, text: str) -> None:
        for level, chunk in by_level(text):
            self.console.log(level, chunk, extra={"send_to_api": False})
            if not self.to_api:
                continue
            record = LogCreate(
                name=JOB_OUTPUT_LOGGER,
                level=level,
                message=chunk,
                flow_run_id=self.flow_run_id,
                timestamp=datetime.datetime.now(datetime.UTC),  # type: ignore[arg-type]  # pendulum-typed
            )
            with self._lock:
                self._pending.append(record)

    async def flush(self) -> bool:
        """Store what was emitted so far (waiting out an outage); True if anything was sent."""
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return False
        sent = 0
        try:
            while sent < len(batch):
                request: list[Any] = []
                size = 0
                for record in batch[sent:]:
                    if request and size + len(record.message) > REQUEST_BYTES:
                        break
                    request.append(record)
                    size += len(record.message)
                await self.outage.call(_once(self.client, self.flow_run_id, request), "forwarding the job's output")
                sent += len(request)
        except BaseException:
            with self._lock:  # not stored: sent again by the next flush, in order
                self._pending[:0] = batch[sent:]
            raise
        return True


def _once(client: Any, flow_run_id: Any, request: list[Any]) -> Any:
    """``create_logs(request)`` made safe to retry: a request cut off in an outage may have been stored even
    though no answer came back, so every try after the first sends only the records the run does not have yet
    (matched by timestamp and message, which a resent record keeps)."""
    tries = 0

    async def send() -> None:
        nonlocal tries
        tries += 1
        todo = request if tries == 1 else await _not_stored(client, flow_run_id, request)
        if todo:
            await client.create_logs(todo)

    return send


async def _not_stored(client: Any, flow_run_id: Any, records: list[Any]) -> list[Any]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp

    earliest = min(r.timestamp for r in records) - datetime.timedelta(microseconds=1)
    latest = max(r.timestamp for r in records) + datetime.timedelta(microseconds=1)
    stored: set[tuple[Any, str]] = set()
    offset = 0
    while True:
        page = await client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]),
                timestamp=LogFilterTimestamp(after_=earliest, before_=latest),
            ),
            limit=PAGE,
            offset=offset,
        )
        stored.update((log.timestamp, log.message) for log in page)
        if len(page) < PAGE:
            break
        offset += len(page)
    return [r for r in records if (r.timestamp, r.message) not in stored]


PAGE = 200

__all__ = ["RUNNER_FAILURE_LINES", "JobLogForwarder", "by_level"]
