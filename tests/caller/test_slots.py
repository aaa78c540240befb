"""Sweeps in slots: the calls of a fan-out on kinetic-local share a few slot jobs, not a job run each.

Each input stays its own Prefect task run (value, exception, logs, retries, timeout); the slot jobs are job runs
tagged ``kinetic-slot`` whose logs name the inputs they served. The stop rows: a Ctrl-C or SIGTERM of the calling
script stops every slot within 10 s; a cancelled slot ends its input Cancelled (not retried) and its queued inputs go
to a new slot; a slot killed with SIGKILL ends its input Crashed, retried, and no other input is lost or run twice; a
per-input timeout stops that input only; ``fail_fast`` stops the rest. Both submission paths where it applies. Each
slot's run carries a table (a markdown artifact) of the inputs it served; an input's lines reach its task run while
it runs; the claim protocol and the queued records' signatures hold on a local store and on GCS (fake-gcs-server).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTaskRunId,
    LogFilterTextSearch,
)
from prefect.states import Cancelling
from test_lifecycle import STOP_WITHIN_SECONDS, _as_from_a_terminal, alive, route, wait_for
from test_spine import job_runs

from kinetic_prefect import kinetic_task

__all__ = ["route"]  # the fixture: both submission paths

SLOT_TAG = "kinetic-slot"


def slot_task(name: str, pool: str, submission: str, keep_warm: bool = True, **options):
    variables = {"keep_warm_seconds": 20} if keep_warm else {}

    @kinetic_task(name=name, work_pool=pool, submission=submission, job_variables=variables, **options)
    def probe(i: int, marker_dir: str, sleep: float = 0.0) -> tuple[int, int]:
        import os as _os
        import pathlib
        import time as _time

        folder = pathlib.Path(marker_dir)
        print(f"slot input {i} in {_os.getpid()}", flush=True)
        (folder / f"ran-{i}-{_time.time_ns()}").write_text(str(_os.getpid()))
        if sleep and _os.environ.get("KINETIC_SWEEP_ID"):  # the first input a slot runs sleeps; the others do not
            try:
                fd = _os.open(folder / "first", _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                _os.write(fd, json.dumps([i, _os.getpid(), _os.environ["KINETIC_FLOW_RUN_ID"]]).encode())
                _os.close(fd)
                _time.sleep(sleep)
        return i, _os.getpid()

    return probe


def ran(marker_dir: Path) -> dict[int, int]:
    """How often each input's body ran."""
    counts: dict[int, int] = {}
    for path in marker_dir.glob("ran-*"):
        i = int(path.name.split("-")[1])
        counts[i] = counts.get(i, 0) + 1
    return counts


def slot_runs(name: str) -> list:
    return [run for run in job_runs(name) if SLOT_TAG in (run.tags or [])]


def task_logs(task_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
    return [log.message for log in logs]


def run_logs(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def logs_with(text: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(text=LogFilterTextSearch(query=text)))


def slot_table(flow_run_id) -> list[dict[str, str]] | None:
    """The rows of a slot job run's table of the inputs it served (its markdown artifact), None before it exists."""
    from kinetic_prefect.contract import SLOT_INPUTS_ARTIFACT_KEY

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                key=ArtifactFilterKey(any_=[SLOT_INPUTS_ARTIFACT_KEY]),
            )
        )
    if not found:
        return None
    assert len(found) == 1, found
    header, _, *rows = [line for line in found[0].data.splitlines() if line.startswith("|")]
    names = [cell.strip() for cell in header.strip("|").split("|")]
    return [dict(zip(names, (cell.strip() for cell in row.strip("|").split("|")), strict=True)) for row in rows]


def sweep_flow(task, n: int, marker_dir: Path, sleep: float = 0.0):
    @flow
    def sweep():
        futures = task.map(range(n), marker_dir=str(marker_dir), sleep=sleep)
        futures.wait()
        return [(f.task_run_id, f.state.name, f.result(raise_on_failure=False)) for f in futures]

    return sweep


# --------------------------------------------------------------------------- the hand-over, no server


def _store_of(kind: str, tmp_path, request):
    from kinetic_prefect.storage import LocalStore, open_store

    if kind == "local":
        return LocalStore(tmp_path)
    return open_store(f"{request.getfixturevalue('gcs_bucket')}/kinetic")  # fake-gcs-server: ifGenerationMatch=0


@pytest.mark.no_server
@pytest.mark.parametrize("kind", ["local", "gcs"])
def test_two_slots_claiming_at_once_never_take_the_same_input_and_a_forged_record_is_refused(
    kind, tmp_path, monkeypatch, request
):
    from kinetic_prefect import signing
    from kinetic_prefect.contract import SweepKeys
    from kinetic_prefect.pod import slot_runner

    store, keys = _store_of(kind, tmp_path, request), SweepKeys("s1")
    count = 200 if kind == "local" else 60  # on the emulator every claim is an HTTP request and every look a listing
    for seq in range(count):  # signed, as on a signed store: a signature object lies beside each record
        blob = json.dumps({"run_id": f"run{seq}-x", "env": {}}).encode()
        signing.put(store, keys.queued(seq, f"run{seq}-x"), blob, b"k" * 32)
    store.put_bytes(keys.claim("run7-x"), SweepKeys.WITHDRAWN, if_absent=True)  # a caller took its input back
    taken: dict[str, list[str]] = {"a": [], "b": []}
    go = threading.Barrier(2)

    def slot(slot_id: str) -> None:
        seen: set[str] = set()
        go.wait()  # both claim at once
        while (queued := slot_runner._claim_next(store, keys, slot_id, seen)) is not None:
            taken[slot_id].append(SweepKeys.run_id_of(queued))
            time.sleep(0.001)  # as a slot runs its input: without it one thread can take all 200 within one GIL turn

    threads = [threading.Thread(target=slot, args=(s,)) for s in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = taken["a"] + taken["b"]
    assert sorted(everything) == sorted(f"run{i}-x" for i in range(count) if i != 7)  # each once, the withdrawn never
    assert taken["a"] and taken["b"], taken  # both slots took inputs: they did race
    assert {store.get_bytes(keys.claim(r)).decode() for r in taken["a"]} == {"a"}  # the claim names its slot
    assert SweepKeys.run_id_of(keys.queued(12, "abc-def")) == "abc-def"
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "k" * 32)  # the slot's key: a signed record reads
    assert slot_runner._read_item(store, keys.queued(3, "run3-x"))["run_id"] == "run3-x"
    store.put_bytes(keys.queued(4, "run4-x"), json.dumps({"run_id": "run4-x", "env": {"PATH": "/x"}}).encode())
    with pytest.raises(signing.TamperedObject, match="does not match its signature"):  # changed after it was signed
        slot_runner._read_item(store, keys.queued(4, "run4-x"))
    store.put_bytes(keys.queued(999, "forged-x"), b'{"run_id": "forged-x", "env": {}}')
    with pytest.raises(signing.TamperedObject, match="has no signature"):  # written without the key
        slot_runner._read_item(store, keys.queued(999, "forged-x"))
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "another key")  # a record the slot's key does not sign is refused
    with pytest.raises(signing.KeyMismatch):
        slot_runner._read_item(store, keys.queued(3, "run3-x"))
    assert keys.prefix == "sweeps/s1" and keys.done("r").startswith(keys.done_prefix)


@pytest.mark.no_server
def test_a_queued_input_sets_only_per_call_variables_of_the_slot():
    from kinetic_prefect.pod import slot_runner

    base = {"KINETIC_STORE": "/s", "PATH": "/bin", "KINETIC_OWNER_PID": "1", "KINETIC_RUN_ID": "slot"}
    item = {"env": {"KINETIC_RUN_ID": "input", "PATH": "/evil", "LD_PRELOAD": "x.so", "KINETIC_PAYLOAD_SHA256": "ab"}}
    env = slot_runner._input_env(base, item, "sweeps/s/queue/000001-input.json")
    assert env == {"KINETIC_STORE": "/s", "PATH": "/bin", "KINETIC_RUN_ID": "input", "KINETIC_PAYLOAD_SHA256": "ab"}


@pytest.mark.no_server
def test_an_inputs_output_is_shipped_in_whole_lines_and_forwarded_once_each_in_order(tmp_path):
    import asyncio

    from kinetic_prefect.caller import slots
    from kinetic_prefect.contract import USAGE_PREFIX, SweepKeys
    from kinetic_prefect.pod import slot_runner
    from kinetic_prefect.storage import LocalStore

    store, keys, log_path = LocalStore(tmp_path / "store"), SweepKeys("s2"), tmp_path / "input.log"
    shipper = slot_runner._LogShipper(store, keys, "r1", log_path)
    forwarded: list[str] = []

    class TaskRunLogger:
        def info(self, line: str) -> None:
            forwarded.append(line)

    def write(data: bytes) -> None:
        with open(log_path, "ab") as log:
            log.write(data)

    async def sweep_side() -> None:
        sweep = slots.Sweep(("flow run", "task"), None, store, None, False, {"env": {}}, "task", 0.0, keys=keys)
        sweep.waiting["r1"] = (None, asyncio.get_running_loop().create_future())
        sweep.loggers["r1"] = TaskRunLogger()
        shipper.ship()  # nothing written yet: no chunk
        write(b"one\ntw")
        shipper.ship()  # "tw" is a line still being written: it waits
        await sweep._stream_logs()
        assert forwarded == ["one"]
        write(f"o\n{USAGE_PREFIX}cpu 3%\nthree".encode())
        shipper.ship()
        await sweep._stream_logs()
        await sweep._stream_logs()  # a listing that finds nothing new forwards nothing
        assert forwarded == ["one", "two"]
        shipper.ship(final=True)  # the input ended: the rest, also without a newline
        await sweep.forward_log("r1", TaskRunLogger())
        await sweep._stream_logs()  # the watcher's listing after the last forward
        assert forwarded == ["one", "two", "three"]  # the usage sampler's line is not the body's

    asyncio.run(sweep_side())
    chunks = [store.get_bytes(k) for k in store.list(keys.log_prefix("r1"))]
    assert chunks == [b"one\n", f"two\n{USAGE_PREFIX}cpu 3%\n".encode(), b"three"]


# --------------------------------------------------------------------------- a sweep in slots


@pytest.mark.slow
def test_a_map_on_a_warm_pool_runs_in_slots_and_every_input_keeps_its_task_run_and_logs(route, tmp_path, monkeypatch):
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    pool, submission = route
    name = f"slots-{uuid.uuid4().hex[:6]}"
    results = sweep_flow(slot_task(name, pool, submission), 8, tmp_path)()
    assert [value for _, _, value in results] == [(i, value[1]) for i, (_, _, value) in enumerate(results)], results
    assert {state for _, state, _ in results} == {"Completed"}
    assert ran(tmp_path) == dict.fromkeys(range(8), 1)
    runs = wait_for(lambda: (rs := job_runs(name)) and all(r.state.is_final() for r in rs) and rs, 60, "final runs")
    slots = [run for run in runs if SLOT_TAG in (run.tags or [])]
    # at most 2 slots, and one job run of its own for a call that started before any sibling: not one per input
    assert 1 <= len(slots) <= 2 and len(runs) - len(slots) <= 1, [(r.name, r.tags) for r in runs]
    assert all(run.state.is_completed() for run in runs), [(r.name, r.state.name) for r in runs]
    served = [
        line
        for run in slots
        for message in run_logs(run.id)
        for line in message.splitlines()
        if line.startswith("kinetic slot: input ")
    ]
    assert len(served) == 8 - (len(runs) - len(slots)), served  # each slot's run names the inputs it served
    names = {str(task_run_id) for task_run_id, _, _ in results}
    in_slots: set[str] = set()
    for run in slots:  # and its table (an artifact) has a row per input it served: the same inputs, Completed
        rows = wait_for(lambda run=run: (table := slot_table(run.id)) is not None and [table], 30, run.name)[0]
        logged = {
            line.rsplit("(task run ", 1)[1].rstrip(")")
            for message in run_logs(run.id)
            for line in message.splitlines()
            if line.startswith("kinetic slot: input ")
        }
        assert {row["task run id"] for row in rows} == logged and logged <= names, (rows, logged)
        assert all(row["outcome"] == "Completed" and float(row["seconds"]) >= 0 for row in rows), rows
        in_slots |= logged
    for task_run_id, _, (i, _) in results:  # each input's own output reached its own task run, and only its own
        if str(task_run_id) not in in_slots:  # the call that started before any sibling: its job run's log
            continue
        mine = [line for line in task_logs(task_run_id) if line.startswith("slot input")]
        assert len(mine) == 1 and mine[0].startswith(f"slot input {i} "), (i, mine)


@pytest.mark.slow
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_map_on_a_pool_with_nothing_set_runs_in_slots(tmp_path, monkeypatch, signed):
    """A newcomer's pool (no warm runners, no setting): the map's 6 inputs ride in slots, each slot a process
    that takes inputs until the sweep has none; before, each input paid a job run and a process. Signed: each
    input runs with its own run's keys, unwrapped from its queued record (the slot holds the sweep's)."""
    from worker_fixture import new_pool

    if signed:
        monkeypatch.setenv("KINETIC_SIGNING_KEY", "slots-" + uuid.uuid4().hex)

    name = f"slots-default-{uuid.uuid4().hex[:6]}"
    results = sweep_flow(slot_task(name, new_pool("slots"), "in-process", keep_warm=False), 6, tmp_path)()
    assert [value[0] for _, _, value in results] == list(range(6)), results
    runs = wait_for(lambda: (rs := job_runs(name)) and all(r.state.is_final() for r in rs) and rs, 60, "final runs")
    slots = [run for run in runs if SLOT_TAG in (run.tags or [])]
    assert slots and len(runs) - len(slots) <= 1, [(r.name, r.tags) for r in runs]
    assert all(run.state.is_completed() for run in runs), [(r.name, r.state.name) for r in runs]
    assert len({pid for _, _, (_, pid) in results}) <= len(runs)  # a process per job run, not per input


@pytest.mark.slow
def test_inputs_sharing_a_slot_each_start_from_the_project_as_shipped(tmp_path, monkeypatch):
    """One slot serves 4 inputs in one process and one working copy, kept between inputs instead of copied anew:
    each input rewrites a module of the project and leaves junk, and the next one still sees neither."""
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "1")
    module = f"helper_{uuid.uuid4().hex[:8]}"
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'vandal'\nversion = '0'\n")
    (project / f"{module}.py").write_text("VALUE = 'original'\n")
    name = f"slots-vandal-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=new_pool("slots"), project_dir=project, submission="in-process")
    def vandal(i: int) -> dict:
        import importlib
        import os as _os
        import pathlib

        helper = importlib.import_module(module)
        seen = {"value": helper.VALUE, "junk": pathlib.Path("junk.txt").exists(), "cwd": _os.getcwd()}
        pathlib.Path(f"{module}.py").write_text("VALUE = 'rewritten'\n")
        pathlib.Path("junk.txt").write_text("junk")
        return {**seen, "pid": _os.getpid()}

    @flow
    def sweep():
        return vandal.map(range(4)).result()

    seen = sweep()
    assert len({s["pid"] for s in seen}) == 1, "one slot served the inputs"
    assert all(s["value"] == "original" and not s["junk"] for s in seen), seen
    assert len({s["cwd"] for s in seen}) == 1, "the slot kept one working copy"
    # The values are back once each input's result is written; the slot removes its copy as it leaves, just after.
    wait_for(lambda: not Path(seen[0]["cwd"]).exists(), 30, "the slot to remove its working copy as it leaves")


@pytest.mark.no_server
def test_a_pool_running_its_own_command_keeps_a_job_run_per_call():
    """A slot swaps the runner's module for the slot runner's: a pool whose ``command`` is not the runner's cannot
    carry slots, so its fan-outs keep a job run per call instead of failing at launch."""
    from types import SimpleNamespace

    from kinetic_prefect.caller.sweep_calls import pool_carries_slots
    from kinetic_prefect.contract import GKE_WORKER_TYPE, LOCAL_WORKER_TYPE, RUNNER_COMMAND

    def pool(command: str | None) -> SimpleNamespace:
        template = {"variables": {"properties": {"command": {"default": command}}}}
        return SimpleNamespace(type=LOCAL_WORKER_TYPE, base_job_template=template)

    assert pool_carries_slots(pool(None), {}, 0)
    assert pool_carries_slots(pool(RUNNER_COMMAND), {}, 0)
    assert not pool_carries_slots(pool("bash -c 'my-launcher'"), {}, 0)
    assert not pool_carries_slots(pool(None), {"command": "my-launcher --job"}, 0)
    assert not pool_carries_slots(SimpleNamespace(type="process", base_job_template={}), {}, 60)
    gke = SimpleNamespace(type=GKE_WORKER_TYPE, base_job_template={})
    assert pool_carries_slots(gke, {}, 60) and not pool_carries_slots(gke, {}, 0)  # warm pods only


@pytest.mark.slow
def test_a_single_call_on_a_warm_pool_keeps_its_own_job_run(tmp_path):
    name = f"slots-one-{uuid.uuid4().hex[:6]}"
    from worker_fixture import new_pool

    probe = slot_task(name, new_pool("slots"), "in-process")

    @flow
    def one():
        return probe(3, str(tmp_path))

    assert one()[0] == 3
    [run] = job_runs(name)
    assert SLOT_TAG not in (run.tags or [])


@pytest.mark.slow
def test_cancelling_a_slot_ends_its_input_cancelled_and_its_queued_inputs_go_to_a_new_slot(
    route, tmp_path, monkeypatch
):
    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "1")
    pool, submission = route
    name = f"slots-cancel-{uuid.uuid4().hex[:6]}"
    sweep = sweep_flow(slot_task(name, pool, submission, retries=1), 4, tmp_path, sleep=60)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=sweep(return_state=True)), daemon=True)
    thread.start()
    first = wait_for(lambda: (tmp_path / "first").exists() and (tmp_path / "first").read_text(), 120, "a slot input")
    sleeper, _, slot_run = json.loads(first)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(slot_run), Cancelling(message="cancel this slot"), force=True)
    thread.join(90)
    assert not thread.is_alive(), "the sweep did not end after its slot was cancelled"
    results = box["value"].result(raise_on_failure=False)
    states = {i: state for i, (_, state, _) in enumerate(results)}
    assert states[sleeper] == "Cancelled", states  # not retried, whatever retries= says
    assert all(state == "Completed" for i, state in states.items() if i != sleeper), states
    assert ran(tmp_path) == dict.fromkeys(range(4), 1)  # the queued inputs ran once each, on a new slot
    cancelled = [run for run in slot_runs(name) if str(run.id) == slot_run]
    assert cancelled and cancelled[0].state.is_cancelled(), cancelled
    assert len(slot_runs(name)) >= 2  # a new slot took the queued inputs


@pytest.mark.slow
def test_a_killed_slot_ends_its_input_crashed_and_retried_and_no_other_input_is_lost_or_run_twice(
    tmp_path, monkeypatch
):
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    name = f"slots-kill-{uuid.uuid4().hex[:6]}"
    sweep = sweep_flow(slot_task(name, new_pool("slots"), "in-process", retries=1), 6, tmp_path, sleep=60)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=sweep()), daemon=True)
    thread.start()
    first = wait_for(lambda: (tmp_path / "first").exists() and (tmp_path / "first").read_text(), 120, "a slot input")
    victim, pid, slot_run = json.loads(first)
    os.kill(pid, signal.SIGKILL)
    thread.join(90)
    assert not thread.is_alive(), "the sweep did not end after its slot was killed"
    results = box["value"]
    assert [state for _, state, _ in results] == ["Completed"] * 6, results  # the killed input's retry completed
    assert [value[0] for _, _, value in results] == list(range(6))
    counts = ran(tmp_path)
    assert counts == {i: 2 if i == victim else 1 for i in range(6)}, counts  # only the killed input ran again
    killed = [run for run in slot_runs(name) if str(run.id) == slot_run]
    assert killed and killed[0].state.name == "Crashed", [(r.name, r.state.name) for r in killed]


@pytest.mark.slow
def test_a_worker_restarted_mid_sweep_reattaches_to_its_slots_and_no_input_is_lost_or_run_twice(
    worker_factory, tmp_path, monkeypatch
):
    """A polling worker killed while its slot jobs run a sweep, then started again: the slot processes go on (they
    take their inputs from the store, not from the worker), the new worker reattaches to their job runs, and every
    input ends Completed with its value, each run once. About 45 s: the inputs sleep 10 s each so that the worker is
    killed and restarted while both slots are inside an input, and two slots take three inputs each."""
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    worker = worker_factory(new_pool("slots")).start()
    name = f"slots-restart-{uuid.uuid4().hex[:6]}"
    sweep = sweep_flow(slot_task(name, worker.pool, "worker"), 6, tmp_path, sleep=10)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=sweep()), daemon=True)
    thread.start()
    first = wait_for(lambda: (tmp_path / "first").exists() and (tmp_path / "first").read_text(), 120, "a slot input")
    _, pid, _ = json.loads(first)
    worker.kill()
    time.sleep(1)
    assert alive(pid), "a slot must survive its worker"
    worker.start()
    thread.join(120)
    assert not thread.is_alive(), "the sweep did not end after its worker was restarted"
    results = box["value"]
    assert [state for _, state, _ in results] == ["Completed"] * 6, results
    assert [value[0] for _, _, value in results] == list(range(6))
    assert ran(tmp_path) == {i: 1 for i in range(6)}, ran(tmp_path)
    runs = wait_for(
        lambda: (rs := slot_runs(name)) and all(r.state.is_final() for r in rs) and rs, 60, "the slot runs to end"
    )
    assert all(run.state.is_completed() for run in runs), [(r.name, r.state.name) for r in runs]
    assert re.search(r"Reattached to [1-9]\d* running kinetic job", worker.log_path.read_text()), "no reattach logged"


@pytest.mark.slow
def test_a_per_input_timeout_stops_that_input_only(tmp_path, monkeypatch):
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    name = f"slots-timeout-{uuid.uuid4().hex[:6]}"
    probe = slot_task(name, new_pool("slots"), "in-process", timeout_seconds=15)
    started = time.time()
    results = sweep_flow(probe, 4, tmp_path, sleep=60)()
    took = time.time() - started
    sleeper, pid, _ = json.loads((tmp_path / "first").read_text())
    states = {i: state for i, (_, state, _) in enumerate(results)}
    assert states[sleeper] == "TimedOut", states
    assert all(state == "Completed" for i, state in states.items() if i != sleeper), states
    assert took < 45, f"the sweep took {took:.0f}s: the timed-out input was not stopped"
    wait_for(lambda: not alive(pid) or None, STOP_WITHIN_SECONDS, "the timed-out input's slot to stop it")


@pytest.mark.slow
def test_fail_fast_stops_the_rest_of_a_sweep_in_slots(tmp_path, monkeypatch):
    from worker_fixture import new_pool

    from kinetic_prefect import fail_fast

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "4")
    name = f"slots-fail-fast-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=new_pool("slots"), job_variables={"keep_warm_seconds": 20}, retries=1)
    def trial(i: int, pid_dir: str) -> int:
        import os as _os
        import pathlib
        import time as _time

        folder = pathlib.Path(pid_dir)
        if i == 0:
            deadline = _time.time() + 60
            while len(list(folder.glob("*.pid"))) < 2 and _time.time() < deadline:
                _time.sleep(0.1)
            raise ValueError("trial 0 diverged")
        (folder / f"{i}.pid").write_text(str(_os.getpid()))
        _time.sleep(120)
        return i

    @flow
    def sweep():
        return fail_fast(trial.map(range(4), pid_dir=str(tmp_path)))

    started = time.time()
    with pytest.raises(ValueError, match="trial 0 diverged"):
        sweep()
    assert time.time() - started < 100, "the rest of the sweep was not stopped (each sleeps 120 s)"
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    wait_for(lambda: not [p for p in pids if alive(p)] or None, STOP_WITHIN_SECONDS, "the rest's slots to stop")


@pytest.mark.slow
def test_cancelling_the_parent_flow_run_stops_every_slot_and_cancels_the_waiting_inputs(route, tmp_path, monkeypatch):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    pool, submission = route
    name = f"slots-parent-{uuid.uuid4().hex[:6]}"
    probe = slot_task(name, pool, submission)

    @flow(name=f"{name}-flow")
    def sweep():
        return [f.result() for f in probe.map(range(4), marker_dir=str(tmp_path), sleep=60)]

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=sweep(return_state=True)), daemon=True)
    thread.start()
    first = wait_for(lambda: (tmp_path / "first").exists() and (tmp_path / "first").read_text(), 120, "a slot input")
    _, pid, _ = json.loads(first)
    with get_client(sync_client=True) as client:
        [parent] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[f"{name}-flow"])))
        cancelled_at = time.time()
        client.set_flow_run_state(parent.id, Cancelling(message="whole pipeline"), force=True)
    wait_for(lambda: not alive(pid) or None, STOP_WITHIN_SECONDS, "the slot to stop")
    thread.join(60)
    assert not thread.is_alive() and time.time() - cancelled_at < 60
    assert "KineticJobCancelled" in str(box["value"].message), box["value"]  # `.result()` raises the cancel
    runs = wait_for(lambda: (rs := slot_runs(name)) and all(r.state.is_final() for r in rs) and rs, 30, "final slots")
    assert all(run.state.is_cancelled() for run in runs), [(r.name, r.state.name) for r in runs]


SLOT_SWEEP_SCRIPT = textwrap.dedent("""
    import faulthandler, pathlib, signal, sys
    faulthandler.register(signal.SIGUSR1)  # a script that does not end: the test asks for its threads' stacks
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, POOL, SUBMISSION, PID_DIR, INPUTS = sys.argv[1:6]

    @kinetic_task(name=NAME, work_pool=POOL, submission=SUBMISSION, job_variables={"keep_warm_seconds": 20})
    def sleepy(i: int) -> int:
        import os, pathlib, time
        (pathlib.Path(PID_DIR) / f"{i}.pid").write_text(str(os.getpid()))
        time.sleep(60)
        return i

    @flow(name=NAME + "-flow")
    def sweep():
        return [f.result() for f in sleepy.map(range(int(INPUTS)))]

    if __name__ == "__main__":
        print("VALUES", sweep(), flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.slow
def test_stopping_the_calling_script_stops_every_slot(route, tmp_path, sig):
    pool, submission = route
    _stop_a_sweep_script(pool, submission, tmp_path, sig, inputs=4)


@pytest.mark.slow_tier  # ≈ 2 min: 1,000 task runs made before the signal
@pytest.mark.timeout(900)
def test_ctrl_c_stops_a_1000_input_sweep_in_slots_within_10_s(tmp_path):
    """Issue 33: the caller's cost stays O(inputs) with 1,000 task threads waiting, so a Ctrl-C still stops every
    slot within 10 s, and the script ends."""
    from worker_fixture import new_pool

    took, ended = _stop_a_sweep_script(new_pool("slots"), "in-process", tmp_path, signal.SIGINT, inputs=1000)
    print(f"1,000 inputs: slots gone {took:.1f} s after Ctrl-C, the script ended after {ended:.1f} s")


def _stop_a_sweep_script(pool: str, submission: str, tmp_path: Path, sig: int, inputs: int) -> tuple[float, float]:
    """Run SLOT_SWEEP_SCRIPT over ``inputs`` sleeps on 2 slots, signal it once both slots run an input (a large
    sweep: 20 s later, its calls waiting in their threads); every slot process gone within STOP_WITHIN_SECONDS,
    every job run Cancelled. Returns the seconds until the slots were gone and until the script ended."""
    name = f"slots-stop-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "sweep.py"
    script.write_text(SLOT_SWEEP_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # A file, not a pipe: nobody reads a pipe while the script runs, and a large sweep's log lines fill its 64 KiB,
    # after which every print and log line of the script blocks — it then never ends, whatever it was asked.
    output_file = tmp_path / "script-output.txt"
    with output_file.open("w") as output_stream:
        proc = subprocess.Popen(
            [sys.executable, str(script), name, pool, submission, str(pid_dir), str(inputs)],
            cwd=tmp_path,
            stdout=output_stream,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_as_from_a_terminal,
            env={**os.environ, "KINETIC_SWEEP_SLOTS": "2"},
        )
    try:
        wait_for(lambda: len(list(pid_dir.glob("*.pid"))) >= 2 or None, 120 + inputs / 5, "two inputs to run")
        wait_for(lambda: slot_runs(name) or None, 30, "a slot job run")
        if inputs > 100:
            time.sleep(20)
        pids = {int(p.read_text()) for p in pid_dir.glob("*.pid")}
        signalled = time.time()
        proc.send_signal(sig)
        while any(alive(pid) for pid in pids) and time.time() < signalled + STOP_WITHIN_SECONDS:
            time.sleep(0.2)
        left = [pid for pid in pids if alive(pid)]
        took = time.time() - signalled
        try:
            proc.wait(60 if inputs <= 100 else 120)  # 1,000 task runs to end (9 s on a quiet machine)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
        ended = time.time() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    output = output_file.read_text()
    assert proc.returncode is not None, f"the script still ran {ended:.0f} s after the signal:\n{output[-20000:]}"
    assert not left, f"{len(left)} slot processes still ran {took:.1f}s after the signal:\n{output[-3000:]}"
    assert proc.returncode != 0, output[-3000:]
    deadline = time.time() + 30
    while not all(run.state.is_final() for run in job_runs(name)) and time.time() < deadline:
        time.sleep(0.5)
    runs = job_runs(name)
    assert all(run.state.is_cancelled() for run in runs), [(run.name, run.state.name) for run in runs]
    return took, ended


@pytest.mark.slow
def test_an_inputs_log_lines_reach_its_task_run_while_it_runs(tmp_path, monkeypatch):
    """The line is in the input's task run (through the API) before the input ends: the body waits for the test to
    have seen it (40 s at most, then it returns False: the lines came only at the end)."""
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "2")
    name = f"slots-stream-{uuid.uuid4().hex[:6]}"
    token = f"streamed-{uuid.uuid4().hex}"

    @kinetic_task(name=name, work_pool=new_pool("slots"), job_variables={"keep_warm_seconds": 20})
    def talk(i: int, folder: str, token: str) -> str:
        import os as _os
        import pathlib
        import time as _time

        if not _os.environ.get("KINETIC_SWEEP_ID"):
            return "own job"  # a call that started before any sibling: not in a slot
        try:
            _os.close(_os.open(pathlib.Path(folder) / "first", _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY))
        except FileExistsError:
            return "another input"
        print(f"{token} from a running input", flush=True)
        deadline = _time.time() + 40
        while _time.time() < deadline:
            if (pathlib.Path(folder) / "seen").exists():
                return "seen while running"
            _time.sleep(0.1)
        return "not seen while running"

    @flow
    def sweep():
        futures = talk.map(range(3), folder=str(tmp_path), token=token)
        return [(f.task_run_id, f.result()) for f in futures]

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=sweep()), daemon=True)
    thread.start()
    found = wait_for(lambda: logs_with(token) or None, 60, "the running input's line in the API")
    (tmp_path / "seen").write_text("")
    thread.join(60)
    assert not thread.is_alive()
    [talker] = [task_run_id for task_run_id, value in box["value"] if value.endswith("while running")]
    assert dict(box["value"])[talker] == "seen while running", box["value"]
    assert [log.task_run_id for log in found] == [talker]  # its own task run's
    time.sleep(3)  # the API log handler's batch interval: a line forwarded again at the end would be there now
    assert len(logs_with(token)) == 1  # forwarded once
