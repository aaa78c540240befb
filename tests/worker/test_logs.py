"""A job's output: never slows the job, reaches the caller and the Prefect run in order, and a
flood is bounded with a note of what was left out (the whole log is kept with the outputs)."""

from __future__ import annotations

import uuid

import pytest
from job_runs import calling_task_run
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task


def job_run(name: str):
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
        return run


def api_lines(run_id) -> list[str]:
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # in-process, this process sends the job's lines in background batches
    lines: list[str] = []
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200, offset=offset
            )
            for log in page:
                lines.extend(log.message.splitlines())
            if len(page) < 200:
                return lines
            offset += len(page)


def numbered(lines: list[str], prefix: str = "") -> list[int]:
    return [int(line[len(prefix) :].split()[1]) for line in lines if line[len(prefix) :].startswith("line ")]


@pytest.fixture(params=["in-process", "worker"])
def route(request):
    if request.param == "worker":  # the session's shared worker: these tests neither kill nor read it
        return request.getfixturevalue("shared_polling_worker").pool, "worker"
    return new_pool("inproc"), "in-process"


@pytest.mark.slow
def test_every_line_arrives_in_order_on_both_paths(route, capfd):
    pool, submission = route
    name = f"chatty-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, submission=submission)
    def chatty(n: int) -> int:
        for i in range(n):
            print(f"line {i} of the job")
        return n

    @flow
    def pipeline():
        return chatty(5000)

    assert pipeline() == 5000
    run = job_run(name)
    assert numbered(api_lines(run.id)) == list(range(5000)), "the Prefect run lacks lines or has them out of order"
    if submission == "worker":  # the caller prints what it reads from the API
        err = capfd.readouterr().err
        prefix = f"[{run.name}] "
        assert numbered([line for line in err.splitlines() if line.startswith(prefix)], prefix) == list(range(5000))


@pytest.mark.slow
def test_a_flood_is_bounded_with_a_note_and_the_whole_log_is_kept(store_dir):
    name = f"flood-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def flood(n: int) -> int:
        for i in range(n):
            print(f"line {i}")
        return n

    @flow
    def pipeline():
        return flood(100_000)

    assert pipeline() == 100_000
    run = job_run(name)
    lines = api_lines(run.id)
    kept = (store_dir / "outputs" / run.job_variables["env"]["KINETIC_RUN_ID"] / "job.log").read_text().splitlines()
    # Replay the run's log against the whole job.log: every forwarded line is the next line of the job's output
    # and every note skips exactly the lines it says (the runner's own lines included), so nothing is lost,
    # reordered or sent twice. Lines that are not the job's (the worker's own messages) sit in between.
    position, forwarded, left_out = 0, 0, 0
    for line in lines:
        if "lines of output left out here" in line:
            gap = int(line.split()[1].replace(",", ""))
            position += gap
            left_out += gap
        elif position < len(kept) and line == kept[position]:
            position += 1
            forwarded += line.startswith("line ")
        else:
            assert not line.startswith("line "), f"{line!r} is out of order: job.log has {kept[position]!r} here"
    assert position == len(kept), (position, len(kept))
    assert left_out > 0 and forwarded >= 1000, (forwarded, left_out)
    assert numbered(kept) == list(range(100_000))


@pytest.mark.slow
def test_job_progress_becomes_a_progress_artifact_on_the_job_run():
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    name = f"progress-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def epochs(n: int) -> int:
        import time as _time

        from kinetic_prefect.pod.progress import report

        for epoch in range(n):
            _time.sleep(0.3)
            report(epoch + 1, n, f"epoch {epoch + 1}/{n}")
        return n

    @flow
    def pipeline():
        return epochs(4)

    assert pipeline() == 4
    run = job_run(name)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    [progress] = [a for a in artifacts if a.type == "progress"]
    assert progress.data == 100.0 and progress.description == f"Progress of kinetic job {run.name}: epoch 4/4"
    lines = api_lines(run.id)
    assert "progress 50%: epoch 2/4" in lines and not any(line.startswith("[kinetic:progress]") for line in lines)


@pytest.mark.slow
def test_a_job_sees_the_same_environment_on_both_paths(route, monkeypatch):
    """The pool's variables plus what env= forwards (and the machine basics), never the caller's others."""
    pool, submission = route
    monkeypatch.setenv("CALLER_ONLY_SETTING", "leaks")
    monkeypatch.setenv("FORWARDED_SETTING", "ok")
    name = f"env-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name,
        work_pool=pool,
        submission=submission,
        env=["FORWARDED_SETTING"],
        job_variables={"env": {"POOL_SETTING": "from-the-pool"}},
    )
    def sees() -> dict:
        import os as _os

        return {k: _os.environ.get(k) for k in ("CALLER_ONLY_SETTING", "FORWARDED_SETTING", "POOL_SETTING", "PATH")}

    @flow
    def pipeline():
        return sees()

    seen = pipeline()
    assert seen["CALLER_ONLY_SETTING"] is None
    assert seen["FORWARDED_SETTING"] == "ok" and seen["POOL_SETTING"] == "from-the-pool" and seen["PATH"]


def test_data_uploads_and_environment_builds_show_progress(tmp_path):
    """Progress artifacts where people expect them: the Data upload on the task run, the build on the job run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    from kinetic_prefect import Data

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i}.bin").write_bytes(bytes([i]) * 50_000)
    name = f"upload-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def count(images) -> int:
        return len(list(images.iterdir()))

    @flow
    def pipeline():
        return count(Data(folder))

    assert pipeline() == 20
    run = job_run(name)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[calling_task_run(run).id]))
        )
    [upload] = [a for a in artifacts if a.type == "progress"]
    assert upload.data == 100.0 and "of 1.0 MiB uploaded" in upload.description


@pytest.mark.slow
def test_a_worker_notice_stored_before_earlier_output_does_not_hide_that_output():
    """After an API outage the worker's own notice (sent by Prefect's background log sender, stamped during the
    outage) can be stored before output lines stamped earlier (sent in order by the worker, one request after
    another). The caller following the job keeps its place by the output alone, so those lines still reach it."""
    import asyncio
    import datetime
    import logging

    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Completed

    from kinetic_prefect.caller import _prefect
    from kinetic_prefect.contract import JOB_OUTPUT_LOGGER, LOG_END_MARKER

    @flow(name=f"notice-order-{uuid.uuid4().hex[:6]}")
    def placeholder():
        pass

    def record(run_id, name: str, message: str, stamp: datetime.datetime) -> LogCreate:
        return LogCreate(name=name, level=logging.INFO, message=message, timestamp=stamp, flow_run_id=run_id)

    async def scenario() -> list[str]:
        async with get_client() as client:
            run = await client.create_flow_run(placeholder)
            t0 = datetime.datetime.now(datetime.UTC)
            stamp = [t0 + datetime.timedelta(seconds=s) for s in range(6)]
            shown: list[str] = []
            follower = asyncio.create_task(
                _prefect.wait_for_final_state(client, run.id, on_log=shown.append, poll_seconds=0.05)
            )
            await client.create_logs([record(run.id, JOB_OUTPUT_LOGGER, "line-0", stamp[0])])
            notice = "the Prefect API answers again after 12 s; the worker goes on"
            await client.create_logs([record(run.id, "prefect.flow_runs.worker", notice, stamp[3])])
            for _ in range(200):  # the caller has read the notice before the held-back output is stored
                if notice in shown:
                    break
                await asyncio.sleep(0.05)
            assert notice in shown
            await client.create_logs(
                [
                    record(run.id, JOB_OUTPUT_LOGGER, "line-1", stamp[1]),
                    record(run.id, JOB_OUTPUT_LOGGER, "line-2", stamp[2]),
                ]
            )
            await client.create_logs(
                [
                    record(run.id, JOB_OUTPUT_LOGGER, "line-3", stamp[4]),
                    record(run.id, JOB_OUTPUT_LOGGER, LOG_END_MARKER, stamp[5]),
                ]
            )
            await client.set_flow_run_state(run.id, Completed(), force=True)
            await asyncio.wait_for(follower, timeout=60)
            return shown

    shown = asyncio.run(scenario())
    assert [line for line in shown if line.startswith("line-")] == ["line-0", "line-1", "line-2", "line-3"], shown
