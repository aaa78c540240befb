"""Warm runners on kinetic-local: a runner process that finished a call takes the next call of the same environment.

A sweep then pays one process start (interpreter, third-party imports, JAX initialisation) per concurrent slot
instead of one per input. Every call is still its own job to the lifecycle: its own flow run, log file, exit
status, outputs, cancel and timeout; only the process is reused (see ``kinetic_prefect.pod.warm_runner`` for what a
call gets fresh and what is shared). Stopping a call stops its runner; the next call starts a new one.

The runners belong to the process that started them (a polling worker, or the caller for in-process submission)
and are matched by everything a call's process depends on: the command (the environment's interpreter), the
working directory, and every environment variable but the per-call ones (``contract.WarmRunnerFiles``). The pool
says how long an idle runner waits (``keep_warm_seconds``; 0 turns warm runners off) and how many stay ready
however long they wait (``min_warm``), until the process that started them ends, or for at most
``warm_floor_idle_seconds`` of idle time when the pool sets it. Each runner's folder says what it is
(``runner.json``: pid, pool, accelerator, since, floor) and whether it is idle (the IDLE file: its mtime is when,
its text how many calls it served), so ``kinetic-prefect warm list|down`` see and end them from another process.
A floor runner that leaves by its idle limit writes how long it waited (``WarmRunnerFiles.LEFT``); the process
that started it publishes that idle time as the pool's cost (``shared.warm_idle``), as ``warm down`` does for the
runners it ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinetic_prefect import signing
from kinetic_prefect.contract import WARM_RUNNER_MODULE, Env, WarmRunnerFiles
from kinetic_prefect.pod.warm_runner import local_call_key, process_alive
from kinetic_prefect.shared import warm_idle


@dataclass
class WarmRunner:
    process: subprocess.Popen
    control: Path
    key: str
    forever: bool  # one of the pool's min_warm runners: never leaves while its launcher lives
    retired: bool = False  # being stopped with its call: never claimed again
    pool: str | None = None
    accelerator: str = ""
    handed: int = 0  # hand-overs written to it: each record is signed with its number, which the runner checks

    def describe(self) -> None:
        """``runner.json``: what ``kinetic-prefect warm list`` shows of this runner."""
        record = {
            "pid": self.process.pid,
            "pool": self.pool,
            "accelerator": self.accelerator,
            "since": self.since,
            "floor": self.forever,
            "launcher_pid": os.getpid(),
        }
        _write(self.control / RUNNER_RECORD, json.dumps(record))

    @property
    def since(self) -> float:
        try:
            return json.loads((self.control / RUNNER_RECORD).read_text())["since"]
        except (OSError, ValueError, KeyError):
            return time.time()

    def alive(self) -> bool:
        return self.process.poll() is None

    def claim(self) -> bool:
        """Take this runner for one call, if it is idle (atomic against its own leaving)."""
        try:
            os.rename(self.control / WarmRunnerFiles.IDLE, self.control / WarmRunnerFiles.CLAIMED)
            return True
        except FileNotFoundError:
            return False


is_per_call = WarmRunnerFiles.is_per_call
RUNNER_RECORD = "runner.json"


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def environment_key(argv: list[str], cwd: str | None, env: dict[str, str]) -> str:
    # The signing keys are each run's own: they reach a runner through its signed hand-over, not its environment.
    shared = sorted((k, v) for k, v in env.items() if not is_per_call(k) and k != signing.KEY_ENV)
    return hashlib.sha256(json.dumps([argv, cwd, shared]).encode()).hexdigest()[:16]


def warm_argv(argv: list[str]) -> list[str]:
    """The runner command with the warm runner's module in place of the one-call runner's."""
    from kinetic_prefect.contract import RUNNER_MODULE

    if RUNNER_MODULE not in argv:
        raise ValueError(f"warm runners need the standard runner command; this pool runs {' '.join(argv)!r}")
    return [WARM_RUNNER_MODULE if part == RUNNER_MODULE else part for part in argv]


class WarmRunners:
    """This process's warm runners, by environment key."""

    def __init__(self, root: Path):
        self.root = root
        self._by_key: dict[str, list[WarmRunner]] = {}
        self._lock = threading.Lock()
        self.started = 0  # runner processes started by this process (the benchmarks count them)

    def _live(self, key: str) -> list[WarmRunner]:
        runners = [r for r in self._by_key.get(key, []) if r.alive()]
        self._by_key[key] = runners
        return runners

    def hand_over(
        self,
        argv: list[str],
        cwd: str | None,
        env: dict[str, str],
        job_dir: Path,
        log_name: str,
        keep_warm_seconds: float,
        min_warm: int,
        pool: str | None = None,
        accelerator: str = "",
        floor_idle_seconds: float | None = None,
        keys: signing.Keyring | None = None,
    ) -> subprocess.Popen:
        """Give one call to an idle runner of its environment, or to a new one; returns the runner's process.
        A floor runner (``min_warm``) waits for the next call for ``floor_idle_seconds`` at most (None: forever)."""
        key = environment_key(argv, cwd, env)
        with self._lock:
            live = self._live(key)
            runner = next((r for r in live if not r.retired and r.claim()), None)
            short_of_floor = sum(r.forever for r in live) < min_warm
            if runner is None:
                runner = self._start(key, argv, cwd, env, forever=short_of_floor, keys=keys)
                runner.pool, runner.accelerator = pool, accelerator
                self._by_key[key].append(runner)
                runner.describe()
            elif short_of_floor:  # an idle runner of a pool without min_warm joins this pool's floor
                runner.forever, runner.pool = True, pool
                runner.describe()
            runner.handed += 1
            number = runner.handed
        call = {
            "job_dir": str(job_dir),
            "log": log_name,
            "keep_warm_seconds": floor_idle_seconds if runner.forever else keep_warm_seconds,
            **_signed_record(runner.control, env, keys, number),
        }
        partial = runner.control / (WarmRunnerFiles.CALL + ".partial")
        partial.write_text(json.dumps(call))
        os.replace(partial, runner.control / WarmRunnerFiles.CALL)
        return runner.process

    def _start(
        self, key: str, argv: list[str], cwd: str | None, env: dict[str, str], forever: bool, keys: Any = None
    ) -> WarmRunner:
        control = self.root / key / uuid.uuid4().hex[:12]
        control.mkdir(parents=True)
        base = {k: v for k, v in env.items() if not is_per_call(k) and k != signing.KEY_ENV}
        if keys is not None:  # the runner's own scope only: it checks hand-overs, each call brings its run's keys
            base[signing.KEY_ENV] = keys.for_job(signing.scope_of(local_call_key(control))).to_env()
        base[Env.WARM_LAUNCHER_PID] = str(os.getpid())
        with open(control / "runner.log", "ab") as out:
            process = subprocess.Popen(
                [*warm_argv(argv), str(control)],
                cwd=cwd or None,
                env=base,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started += 1
        runner = WarmRunner(process, control, key, forever)
        threading.Thread(
            target=_bill_idle_floor_on_leaving, args=(runner,), name="kinetic-warm-watch", daemon=True
        ).start()
        return runner

    def retire_for(self, pid: int, job_dir: Path) -> bool:
        """Before a call is stopped: whether its runner is still on it (then it is retired, never to take another
        call, and may be killed); False once the call is over, when the runner may already serve another one."""
        with self._lock:
            if exit_status(job_dir) is not None:
                return False
            for runners in self._by_key.values():
                for runner in runners:
                    if runner.process.pid == pid:
                        runner.retired = True
            return True

    def stop_all(self) -> None:
        for runners in self._by_key.values():
            for runner in runners:
                if runner.alive():
                    runner.process.terminate()


def _signed_record(control: Path, env: dict[str, str], keys: signing.Keyring | None, number: int = 1) -> dict[str, Any]:
    """A call's per-call variables as a record signed under the runner's scope, with the call's run keys wrapped
    for that runner and that run only: a local user or job that writes the control folder cannot hand it a call.
    ``number`` counts this runner's hand-overs (1, 2...): the runner runs a record only past the last it ran, so a
    copy of an earlier, validly signed hand-over put back into the control folder is refused."""
    object_key = local_call_key(control)
    record: dict[str, Any] = {"env": {k: v for k, v in env.items() if is_per_call(k)}, "number": number}
    if keys is not None:
        run_id = env[Env.RUN_ID]
        scopes = signing.run_scopes(run_id, env.get(Env.CHECKPOINT_KEY))
        record["keys"] = keys.grant(scopes, under=signing.scope_of(object_key), nonce=f"{object_key}#{run_id}")
    blob = json.dumps(record)
    signature = signing.sign(keys, object_key, blob.encode())
    return {"record": blob, "signature": signature.decode() if signature else None}


def _bill_idle_floor_on_leaving(runner: WarmRunner) -> None:
    """Once ``runner`` has ended: if it was a floor runner that left by its idle limit, its idle time is the pool's
    cost (published here, in its launcher, which reaches Prefect). ``warm down`` publishes the ones it ends."""
    runner.process.wait()
    try:
        left: dict[str, Any] = json.loads((runner.control / WarmRunnerFiles.LEFT).read_text())
    except (OSError, ValueError):
        return  # stopped, killed, or ended with its call: no idle time of its own to bill
    if not runner.forever or left.get("why") != WarmRunnerFiles.LEFT_IDLE_LIMIT:
        return
    work_pool, prices = warm_idle.pool_prices(runner.pool)
    idle = warm_idle.idle_cost(runner.accelerator, float(left["idle_since"]), float(left["left_at"]), prices)
    who = warm_idle.IdleRunner(str(runner.process.pid), runner.pool, runner.accelerator, True, int(left["calls"]))
    warm_idle.publish_idle(who, idle, work_pool)


@dataclass
class RunnerInfo:
    """A warm runner as ``kinetic-prefect warm list`` sees it, from its folder (any process may look)."""

    control: Path
    pid: int
    pool: str | None
    accelerator: str
    since: float
    floor: bool
    idle_since: float | None  # None: busy with a call (or leaving)
    calls: int

    def idle_seconds(self, now: float) -> float:
        return 0.0 if self.idle_since is None else max(0.0, now - self.idle_since)


def list_runners(root: Path, pool: str | None = None) -> list[RunnerInfo]:
    """The live warm runners under ``root`` (every process's), of ``pool`` if given, oldest first."""
    found = []
    for record_path in root.glob(f"*/*/{RUNNER_RECORD}"):
        try:
            record: dict[str, Any] = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        control = record_path.parent
        if not process_alive(int(record["pid"])) or (control / WarmRunnerFiles.LEAVING).exists():
            continue
        if pool is not None and record.get("pool") != pool:
            continue
        idle = control / WarmRunnerFiles.IDLE
        try:
            idle_since, calls = idle.stat().st_mtime, int(idle.read_text() or 0)
        except (OSError, ValueError):
            idle_since, calls = None, -1  # busy: its count is written when the call ends
        info = RunnerInfo(
            control,
            int(record["pid"]),
            record.get("pool"),
            record.get("accelerator") or "",
            0.0,
            False,
            idle_since,
            calls,
        )
        info.since, info.floor = float(record.get("since") or 0.0), bool(record.get("floor"))
        found.append(info)
    return sorted(found, key=lambda r: r.since)


def stop_idle(info: RunnerInfo) -> bool:
    """End an idle runner: its IDLE file renamed to LEAVING first (a launcher's claim renames the same file, so
    no call can be handed to it meanwhile), then SIGTERM. False: it is busy with a call, left running."""
    try:
        os.rename(info.control / WarmRunnerFiles.IDLE, info.control / WarmRunnerFiles.LEAVING)
    except FileNotFoundError:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(info.pid, signal.SIGTERM)
    return True


_registries: dict[str, WarmRunners] = {}


def runners_for(root: Path) -> WarmRunners:
    """The process-wide registry under ``root`` (in-process submission makes a launcher per call; its runners
    must outlive each of them)."""
    registry = _registries.get(str(root))
    if registry is None:
        registry = _registries[str(root)] = WarmRunners(root)
    return registry


def exit_status(job_dir: Path) -> int | None:
    """The call's runner exit status once the warm runner has finished it, else None."""
    try:
        return int((job_dir / WarmRunnerFiles.EXIT_STATUS).read_text())
    except (OSError, ValueError):
        return None


__all__ = ["RunnerInfo", "WarmRunners", "exit_status", "list_runners", "runners_for", "stop_idle"]
