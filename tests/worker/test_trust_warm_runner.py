"""Issue 54, finding 8, written as the attacker runs them: a kinetic-local warm runner's hand-overs and its own key.

* Replay: whoever can read and write a warm runner's control folder (another job of the same user, a local user
  with access to the cache) keeps a copy of a validly signed hand-over (``call.json``) and writes it back while the
  runner is idle. The record was signed under the runner's scope, under the same name for every call, so the runner
  ran the earlier call's code a second time, with that call's keys. Now every hand-over carries its number for that
  runner, signed, and the runner refuses one it is not past.
* The runner's own scope key (the key that checks its hand-overs and unwraps each call's keys) sat in the runner's
  process environment, which every call's code can read through ``/proc/self/environ``. Now the runner takes it out
  of its environment as it starts; a call's code finds only its own run's keys there.

Real calls through the in-process worker on a pool with warm runners and a signing key (a few seconds a call).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task, signing
from kinetic_prefect.contract import Env, RunLayout, WarmRunnerFiles
from kinetic_prefect.workers.local import warm

# One key for both tests: a warm runner left idle by the first may take the second's calls.
MASTER = "warm-trust-" + uuid.uuid4().hex


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


@pytest.fixture
def handovers(monkeypatch, tmp_path):
    """Every hand-over the launcher writes, as a watcher of the control folder copies it before the runner takes
    it, with the run's signed payload copied from the store: (control folder, the signed record and its signature,
    the copy of the run's store folder)."""
    seen: list[tuple[Path, dict, Path, Path]] = []
    signed_record = warm._signed_record
    copies = tmp_path / "attackers-copies"

    def copying(control, env, *args, **kwargs):
        record = signed_record(control, env, *args, **kwargs)
        run_folder = Path(env[Env.STORE]) / RunLayout(env[Env.RUN_ID]).prefix
        copy = copies / env[Env.RUN_ID]
        shutil.copytree(run_folder, copy)
        seen.append((control, dict(record), copy, run_folder))
        return record

    monkeypatch.setattr(warm, "_signed_record", copying)
    return seen


def _warm_task(name: str, pool: str):
    @kinetic_task(name=name, work_pool=pool, submission="in-process", job_variables={"keep_warm_seconds": 30})
    def call(marker: str) -> dict:
        import os as _os

        with open(marker, "a") as out:
            out.write(f"ran in {_os.getpid()}\n")
        with open("/proc/self/environ", "rb") as env:
            initial = [e.decode(errors="replace") for e in env.read().split(b"\0") if e]
        key_name = "KINETIC_SIGNING_KEY"
        return {
            "os_environ": _os.environ.get(key_name),
            "proc_environ": [e.split("=", 1)[1] for e in initial if e.startswith(key_name + "=")],
        }

    return call


def _scopes(value: str | None) -> set[str]:
    keys = signing.parse_keys(value) if value else None
    return set(keys.scoped) if keys is not None and keys.scoped else set()


@pytest.mark.slow
def test_a_replayed_hand_over_is_refused_and_the_earlier_call_does_not_run_again(
    monkeypatch, tmp_path, handovers
) -> None:
    """One signed call on a warm runner; its hand-over, copied as it was written, is put back into the idle
    runner's control folder: refused (the job log says so), and the call's code ran once."""
    monkeypatch.setenv(Env.SIGNING_KEY, MASTER)
    marker = tmp_path / "runs.txt"
    call = _warm_task(f"replay-{uuid.uuid4().hex[:6]}", new_pool("replay"))

    @flow
    def once() -> dict:
        return call(str(marker))

    once()
    assert marker.read_text().count("ran in") == 1
    [(control, record, copy, run_folder)] = handovers
    _wait_for((control / WarmRunnerFiles.IDLE).exists, 30, "the runner to be idle again")
    shutil.copytree(copy, run_folder, dirs_exist_ok=True)  # the signed payload back, as a store writer puts it
    job_dir = tmp_path / "replayed-job"
    job_dir.mkdir()
    replay = {"job_dir": str(job_dir), "log": "job.log", "keep_warm_seconds": 30, **record}
    (control / WarmRunnerFiles.CALL).write_text(json.dumps(replay))
    _wait_for((job_dir / WarmRunnerFiles.EXIT_STATUS).exists, 60, "the runner's answer to the replayed hand-over")
    assert marker.read_text().count("ran in") == 1, f"the replayed hand-over ran the call again: {marker.read_text()}"
    log = (job_dir / "job.log").read_text()
    assert "refused" in log and "already" in log, log


@pytest.mark.slow
def test_a_call_cannot_read_its_warm_runners_own_key(monkeypatch, tmp_path, handovers) -> None:
    """Two calls on one warm runner: neither finds the runner's own scope key (``warm/...``) in ``os.environ`` or
    in ``/proc/self/environ``, only its own run's keys."""
    monkeypatch.setenv(Env.SIGNING_KEY, MASTER)
    call = _warm_task(f"environ-{uuid.uuid4().hex[:6]}", new_pool("environ"))

    @flow
    def twice() -> list[dict]:
        return [call(str(tmp_path / "m")), call(str(tmp_path / "m"))]

    for seen in twice():
        found = _scopes(seen["os_environ"]) | {s for v in seen["proc_environ"] for s in _scopes(v)}
        assert found, f"the call got no keys of its own: {seen}"
        runner_scopes = {s for s in found if s.startswith("warm/")}
        assert not runner_scopes, f"a call read its warm runner's own key {runner_scopes} ({seen})"
    assert len({handed[0] for handed in handovers}) == 1, "the two calls did not share one warm runner"
