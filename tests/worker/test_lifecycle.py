"""The fault matrix: every way a user can stop, kill, cancel or break a run, and what it ends as.

Each test asserts the final state of the task run and of the job's flow run, that the job's
process is gone (or, where documented, that it finished), and how long stopping took. The local
rows run on both submission paths: in-process (the caller runs the worker) and a polling worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from job_runs import calling_task_run
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.states import Cancelling
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_SECONDS = 10.0


# --------------------------------------------------------------------------- helpers


def job_runs(task_name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(interval)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process is dead too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def seconds_until_gone(pid: int, limit: float = 60.0) -> float:
    started = time.time()
    wait_for(lambda: not alive(pid), limit, f"job process {pid} to end")
    return time.time() - started


def final_job_run(task_name: str, timeout: float = 30.0):
    def final():
        runs = job_runs(task_name)
        return runs if runs and all(r.state is not None and r.state.is_final() for r in runs) else None

    return wait_for(final, timeout, f"the job runs of {task_name} to be final")


def task_run_of(job_run):
    return calling_task_run(job_run)


def read_pid(path: Path, timeout: float = 90.0) -> int:
    wait_for(lambda: path.exists() and path.read_text().strip(), timeout, "the job to start")
    return int(path.read_text())


@pytest.fixture(params=["in-process", "worker"])
def route(request):
    """(pool, submission) for one submission path; the polling path has a worker online (the session's shared one:
    no test of this fixture kills or reads its worker)."""
    if request.param == "worker":
        worker = request.getfixturevalue("shared_polling_worker")
        return worker.pool, "worker"
    return new_pool("inproc"), "in-process"


def sleeper(name: str, pool: str, submission: str, **options):
    @kinetic_task(name=name, work_pool=pool, submission=submission, **options)
    def sleepy(pid_path: str, seconds: float = 60) -> int:
        import os as _os
        import pathlib
        import time as _time

        pathlib.Path(pid_path).write_text(str(_os.getpid()))
        _time.sleep(seconds)
        return 42

    return sleepy


SCRIPT = textwrap.dedent("""
    import os, pathlib, sys, time
    from prefect import flow
    from kinetic_prefect import kinetic_task

    NAME, POOL, SUBMISSION, PID_FILE, MODE = sys.argv[1:6]

    @kinetic_task(name=NAME, work_pool=POOL, submission=SUBMISSION)
    def body(pid_path: str, mode: str) -> int:
        import os, pathlib, time
        pathlib.Path(pid_path).write_text(str(os.getpid()))
        if mode == "exit7":
            raise SystemExit(7)
        time.sleep(float(mode) if mode.replace(".", "").isdigit() else 60)
        return 42

    @flow(name=NAME + "-flow")
    def pipeline():
        return body(PID_FILE, MODE)

    if __name__ == "__main__":
        print("VALUE", pipeline(), flush=True)
""")


def start_script(
    tmp_path: Path, name: str, pool: str, submission: str, mode: str = "60"
) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "caller.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / f"{name}.pid"
    proc = subprocess.Popen(
        [sys.executable, str(script), name, pool, submission, str(pid_file), mode],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    return proc, pid_file


def _as_from_a_terminal() -> None:
    """Ctrl-C reaches the script as it does from a terminal, even when the test suite itself was started in the
    background (`cmd &` in a non-interactive shell ignores SIGINT, the ignore is inherited, and Python then
    installs no KeyboardInterrupt handler: the script would sleep through the signal and exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def in_thread(fn, *args):
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


# --------------------------------------------------------------------------- stopping from the caller


@pytest.mark.slow
def test_task_timeout_stops_the_job_and_cancels_its_run(route, tmp_path):
    pool, submission = route
    name = f"timeout-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, pool, submission, timeout_seconds=4)

    @flow
    def pipeline():
        return task(str(pid_file))

    thread, box = in_thread(pipeline)
    pid = read_pid(pid_file)
    thread.join(60)
    assert isinstance(box.get("error"), TimeoutError), box
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS
    [run] = final_job_run(name)
    assert run.state.is_cancelled(), run.state
    assert task_run_of(run).state.name == "TimedOut"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.slow
def test_stopping_the_calling_script_stops_the_job(route, tmp_path, sig):
    pool, submission = route
    name = f"interrupt-{uuid.uuid4().hex[:6]}"
    proc, pid_file = start_script(tmp_path, name, pool, submission)
    pid = read_pid(pid_file)
    proc.send_signal(sig)
    # Alone this takes 5-15 s; under a full suite at load 10+ the caller's cancel-and-wait took over 60 s once.
    proc.wait(150)
    assert proc.returncode != 0
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS, proc.stdout.read()[-3000:]
    [run] = final_job_run(name)
    assert run.state.is_cancelled(), run.state


@pytest.mark.slow
def test_killed_caller_in_process_the_job_stops_and_cancels_its_own_run(tmp_path):
    pool = new_pool("inproc")
    name = f"orphan-{uuid.uuid4().hex[:6]}"
    proc, pid_file = start_script(tmp_path, name, pool, "in-process")
    pid = read_pid(pid_file)
    proc.kill()
    proc.wait(30)
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS
    [run] = final_job_run(name)
    assert run.state.is_cancelled() and "died" in run.state.message, run.state


@pytest.mark.slow
def test_killed_caller_with_a_polling_worker_the_job_finishes_and_completes(worker_factory, tmp_path):
    worker = worker_factory().start()
    name = f"orphan-w-{uuid.uuid4().hex[:6]}"
    proc, pid_file = start_script(tmp_path, name, worker.pool, "worker", mode="3")
    pid = read_pid(pid_file)
    proc.kill()
    proc.wait(30)
    seconds_until_gone(pid, 60)
    [run] = final_job_run(name)
    assert run.state.is_completed(), run.state


# --------------------------------------------------------------------------- cancelling in Prefect


@pytest.mark.slow
def test_cancelling_the_job_run_is_not_undone_by_retries(route, tmp_path):
    pool, submission = route
    name = f"cancel-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, pool, submission, retries=2)

    @flow
    def pipeline():
        return task(str(pid_file))

    thread, box = in_thread(lambda: pipeline(return_state=True))
    pid = read_pid(pid_file)
    [run] = job_runs(name)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(message="stop it"), force=True)
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS
    thread.join(60)
    assert box["value"].is_failed(), box  # the call raised KineticJobCancelled, which the flow did not catch
    runs = final_job_run(name)
    assert len(runs) == 1, "a retry launched a new job after the cancel"
    assert runs[0].state.is_cancelled()
    assert task_run_of(runs[0]).state.is_cancelled()


@pytest.mark.slow
def test_cancelling_the_parent_flow_run_stops_the_job(route, tmp_path):
    pool, submission = route
    name = f"parent-{uuid.uuid4().hex[:6]}"
    proc, pid_file = start_script(tmp_path, name, pool, submission)
    pid = read_pid(pid_file)
    [job] = job_runs(name)
    parent_id = task_run_of(job).flow_run_id
    cancelled_at = time.time()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(parent_id, Cancelling(message="whole pipeline"), force=True)
    assert seconds_until_gone(pid) <= STOP_WITHIN_SECONDS
    proc.wait(60)
    [job] = final_job_run(name)
    assert job.state.is_cancelled(), job.state
    with get_client(sync_client=True) as client:
        parent = wait_for(lambda: (r := client.read_flow_run(parent_id)).state.is_final() and r, 30, "the parent run")
    assert parent.state.is_cancelled(), parent.state
    assert time.time() - cancelled_at < 30


# --------------------------------------------------------------------------- a polling worker dies


@pytest.mark.slow
def test_a_restarted_worker_reattaches_to_its_running_job(worker_factory, tmp_path):
    worker = worker_factory().start()
    name = f"reattach-{uuid.uuid4().hex[:6]}"
    pid_file = tmp_path / "pid"
    task = sleeper(name, worker.pool, "worker")

    @flow
    def pipeline():
        return task(str(pid_file), 12)

    thread, box = in_thread(pipeline)
    pid = read_pid(pid_file)
    worker.kill()
    time.sleep(1)
    assert alive(pid), "the job must survive its worker"
    worker.start()
    thread.join(90)
    assert box.get("value") == 42, box
    [run] = final_job_run(name)
    assert run.state.is_completed(), run.state
    assert "Reattach" in worker.log_path.read_text()
    assert not alive(pid)


# --------------------------------------------------------------------------- errors tell the truth


@pytest.mark.slow
def test_a_call_routed_to_a_worker_that_just_died_runs_in_process(worker_factory):
    """`submission="auto"` sends a call to a pool whose worker Prefect still shows ONLINE for up to 3 heartbeats
    after a `kill -9` (15 s here: the fixture's workers beat every 5 s, 90 s with Prefect's default). Such a call
    waited for good (a 16-input sweep hung 900 s). Once no worker is online and none claimed the run, the caller
    takes it back (an orchestrated Pending, so a worker that claimed it first wins) and runs it in-process. ≈ 20 s:
    a worker's start and Prefect's 15 s offline horizon, which the test cannot shorten without faking the server."""
    worker = worker_factory().start()
    worker.kill()
    name = f"dead-worker-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=worker.pool)
    def answer() -> int:
        return 42

    @flow
    def pipeline():
        return answer()

    started = time.time()
    assert pipeline() == 42
    assert time.time() - started < 120
    [run] = final_job_run(name)
    assert run.state.is_completed(), run.state
    with get_client(sync_client=True) as client:
        history = [(state.type.value, state.message) for state in client.read_flow_run_states(run.id)]
    assert history[0][0] == "SCHEDULED", history  # routed to the pool's (dead) worker first
    assert ("PENDING", "taken back by its caller") in history, history


@pytest.mark.slow
def test_system_exit_keeps_its_code(tmp_path):
    pool = new_pool("inproc")
    name = f"exit-{uuid.uuid4().hex[:6]}"
    proc, _ = start_script(tmp_path, name, pool, "in-process", mode="exit7")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 7, out[-3000:]


@pytest.mark.slow
def test_an_unpicklable_result_is_the_users_error_and_is_not_retried():
    from kinetic_prefect.errors import ResultNotPicklable

    name = f"gen-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, retries=2)
    def numbers(n: int):
        return (i for i in range(n))

    @flow
    def pipeline():
        return numbers(3)

    with pytest.raises(ResultNotPicklable, match="generator"):
        pipeline()
    runs = final_job_run(name)
    assert len(runs) == 1 and runs[0].state.is_failed()


@pytest.mark.slow
def test_a_body_that_leaves_a_thread_running_still_returns_its_value():
    """A non-daemon thread the body started kept the interpreter from ending after the outcome was written: the
    job hung until its timeout, and the value was lost (TimedOut). The runner now leaves without such threads
    10 s after recording the outcome (pod.runner.STRAY_THREAD_GRACE_SECONDS), saying so in the job's log. ≈ 15 s:
    that grace period."""
    name = f"stray-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, timeout_seconds=120)
    def leaves_a_thread() -> int:
        import threading
        import time as _time

        threading.Thread(target=_time.sleep, args=(3600,), name="forgotten-poller").start()
        return 7

    @flow
    def pipeline():
        return leaves_a_thread()

    started = time.time()
    assert pipeline() == 7
    assert time.time() - started < 60
    [run] = final_job_run(name)
    assert run.state.is_completed(), run.state


def test_keyboard_interrupt_in_the_job_fails_the_task_not_the_caller():
    from kinetic_prefect.errors import KineticJobInterrupted

    name = f"kbi-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def interrupted():
        raise KeyboardInterrupt

    @flow
    def pipeline():
        state = interrupted(return_state=True)
        return state, "the flow went on"

    state, went_on = pipeline()
    assert state.is_failed() and went_on
    with pytest.raises(KineticJobInterrupted):
        state.result()


# --------------------------------------------------------------------------- nothing left behind


def test_no_temporary_directories_payloads_or_results_are_left(tmp_path, monkeypatch, store_dir):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    name = f"tidy-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def writes(fail: bool) -> int:
        import os as _os
        import pathlib

        (pathlib.Path(_os.environ["KINETIC_OUTPUT_DIR"]) / "model.txt").write_text("weights")
        if fail:
            raise ValueError("bad")
        return 1

    @flow
    def pipeline():
        return writes(False), writes(True, return_state=True)

    value, failed = pipeline()
    assert value == 1 and failed.is_failed()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("kinetic-")]
    for run in job_runs(name):
        run_id = run.job_variables["env"]["KINETIC_RUN_ID"]
        left = sorted(p.name for p in (store_dir / "runs" / run_id).iterdir())
        # the payload and the result are gone; the two small records stay (the outcome, and the worker's
        # record of where the job ran, which the caller reports)
        assert left in (["outcome.json"], ["capacity.json", "outcome.json"]), left
        assert (store_dir / "outputs" / run_id / "model.txt").read_text() == "weights"
    jobs_dir = Path(os.environ["KINETIC_CACHE_DIR"]) / "jobs"
    assert not [run.id for run in job_runs(name) if (jobs_dir / str(run.id)).exists()], "job folders left"


@pytest.mark.slow
def test_a_corrupted_project_archive_is_replaced(store_dir, tmp_path, monkeypatch):
    name = f"code-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name)
    def one() -> int:
        return 1

    @flow
    def pipeline():
        return one()

    assert pipeline() == 1
    [run] = job_runs(name)
    key = run.job_variables["env"]["KINETIC_CODE_KEY"]
    (store_dir / key).write_bytes(b"not a tar.gz")
    monkeypatch.setenv("KINETIC_NODE_CACHE", str(tmp_path / "another-node"))  # a node that never unpacked it
    assert pipeline() == 1, "the damaged archive was used instead of being replaced"
    assert pipeline() == 1


def test_a_flow_reaches_a_jobs_outputs_through_the_public_api(tmp_path):
    from kinetic_prefect import JobOutputs

    @kinetic_task(name=f"outputs-{uuid.uuid4().hex[:6]}")
    def writes() -> JobOutputs:
        import os as _os
        import pathlib

        out = pathlib.Path(_os.environ["KINETIC_OUTPUT_DIR"])
        (out / "plots").mkdir()
        (out / "plots" / "curve.txt").write_text("0.9")
        (out / "model.bin").write_bytes(b"\x00weights")
        return JobOutputs.current()

    @flow
    def pipeline():
        return writes()

    outputs = pipeline()
    assert outputs.names() == ["model.bin", "plots/curve.txt"]
    assert outputs.download("plots/curve.txt", tmp_path).read_text() == "0.9"
    assert sorted(p.name for p in outputs.download_all(tmp_path / "all")) == ["curve.txt", "model.bin"]
    assert outputs.url("model.bin").endswith("model.bin")
