"""Job side of a slot job: one process that takes a sweep's inputs one after another (``contract.SweepKeys``).

``python -m kinetic_prefect.pod.slot_runner`` runs where the one-call runner would (kinetic-local swaps the module
when a job's environment names a sweep, ``Env.SWEEP_ID``). It claims the oldest input of the sweep's queue that
nobody has claimed (create-if-absent of ``claims/<run id>``: of two slots, one wins), runs ``runner.main`` for it in
this process with the input's own per-call variables (its ``RunLayout``: payload, result, outcome), ships the
input's output in chunks of whole lines while it runs (the caller forwards them to the input's task run as they
come), and writes its ``done`` record (outcome, seconds) after the last chunk. Then the next, until the queue has
been empty for the slot's idle time or the caller closed the sweep. It prints one line per input it serves, and
the caller publishes the table of them (``SLOT_INPUTS_ARTIFACT_KEY``) on the slot's own job run.

Stopping: a ``stop/<run id>`` record for the input it runs (the caller stopped waiting for it: a timeout, an
interrupt, ``fail_fast``) or a SIGTERM (the slot's job run cancelled) stops the input as a cold job is stopped, and
the slot leaves after it: what the input left in the process (threads, signal handlers) must not reach another
input. A slot leaving this way, or idle, records a Completed outcome of its own run; a cancelled one is Cancelled
by its worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kinetic_prefect.contract import (
    COMPLETED,
    EXIT_NO_OUTCOME,
    EXIT_OUTCOME_RECORDED,
    Env,
    Outcome,
    RunLayout,
    SweepKeys,
    WarmRunnerFiles,
)
from kinetic_prefect.pod import warm_runner

POLL_SECONDS = 0.1  # how often an idle slot looks for the next input
STOP_POLL_SECONDS = 0.25  # how often a busy slot looks for its input's stop record
LOG_CHUNK_SECONDS = 0.5  # how often a busy slot ships its input's new output lines
LOG_CHUNK_MAX_BYTES = 4 * 1024 * 1024  # at most this much output in one chunk
WATCH_JOIN_SECONDS = 5.0  # a watcher caught in a slow store write: the last chunk and the done record go on


def _claim_next(store: Any, keys: SweepKeys, slot_id: str, seen: set[str]) -> str | None:
    """The key of the oldest queued input no slot has taken, now this slot's; None when there is none."""
    for queued in store.list(keys.queue):
        if queued in seen or not queued.endswith(SweepKeys.QUEUED_SUFFIX):  # (its signature beside it)
            continue
        seen.add(queued)  # claimed by this slot or another, or withdrawn: never looked at again
        if store.put_bytes(keys.claim(SweepKeys.run_id_of(queued)), slot_id.encode(), if_absent=True):
            return str(queued)
    return None


def _read_item(store: Any, queued: str) -> dict[str, Any]:
    """The queued input's record, verified with the signing key when the store is signed: it names the payload
    and code the slot runs."""
    from kinetic_prefect import signing

    record: dict[str, Any] = json.loads(signing.get(store, queued, signing.key_from_env()))
    return record


class _LogShipper:
    """The input's output, to ``logs/<run id>/<n>`` in chunks of whole lines while it runs (the caller forwards
    each chunk to the input's task run as it appears), and the rest once it has ended."""

    def __init__(self, store: Any, keys: SweepKeys, run_id: str, log_path: Path) -> None:
        self.store, self.keys, self.run_id, self.log_path = store, keys, run_id, log_path
        self.offset = self.chunks = 0
        self.lock = threading.Lock()
        self.served = threading.Event()  # set once the input has ended: the watcher stops

    def ship(self, final: bool = False) -> None:
        with self.lock:
            try:
                with open(self.log_path, "rb") as log:
                    log.seek(self.offset)
                    data = log.read(LOG_CHUNK_MAX_BYTES if not final else -1)
            except FileNotFoundError:
                return
            if not final:
                data = data[: data.rfind(b"\n") + 1]  # whole lines only; a line still being written waits
            if data:
                self.store.put_bytes(self.keys.log_chunk(self.run_id, self.chunks), data)
                self.offset += len(data)
                self.chunks += 1


def _watch_input(store: Any, keys: SweepKeys, run_id: str, asked: list[str], log: _LogShipper) -> threading.Thread:
    """While the input runs: ship its new output every LOG_CHUNK_SECONDS, and SIGTERM this process (the runner
    unwinds the input as a cold job) once the caller asks to stop the input. Ends when ``log.served`` is set."""
    ticks_per_chunk = max(1, round(LOG_CHUNK_SECONDS / STOP_POLL_SECONDS))

    def watch() -> None:
        tick = 0
        while not log.served.wait(STOP_POLL_SECONDS):
            tick += 1
            try:
                if store.exists(keys.stop(run_id)):
                    asked.append(run_id)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                if tick % ticks_per_chunk == 0:
                    log.ship()
            except Exception:  # a store hiccup: look again
                pass

    thread = threading.Thread(target=watch, name="kinetic-slot-input-watch", daemon=True)
    thread.start()
    return thread


def _input_env(base_environ: dict[str, str], item: dict[str, Any], queued: str) -> dict[str, str]:
    """The slot's environment with the input's per-call variables (only those: a queued record cannot set any
    other variable of the process) and the input's own signing keys, which the record carries wrapped for this
    sweep's slots: the input's code holds its run's keys, never the sweep's."""
    from kinetic_prefect import signing

    per_call = {str(k): str(v) for k, v in item["env"].items() if WarmRunnerFiles.is_per_call(str(k))}
    env = {k: v for k, v in base_environ.items() if k != Env.OWNER_PID}  # watched once, by the slot itself
    slot_keys = signing.parse_keys(base_environ.get(signing.KEY_ENV))
    if slot_keys is not None:
        if not item.get("keys"):
            raise signing.TamperedObject(f"{queued} hands over no signing keys for input {item.get('run_id')}")
        granted = slot_keys.accept(item["keys"], under=signing.scope_of(queued), nonce=queued)
        env[signing.KEY_ENV] = granted.to_env()
    return {**env, **per_call}


def _refuse(store: Any, keys: SweepKeys, slot_id: str, queued: str, exc: Exception) -> None:
    """A queued record that fails its signature (or cannot be read) is not run; its caller is told why."""
    message = f"{type(exc).__name__}: {exc}"
    print(f"kinetic slot: refused {queued}: {message}", file=sys.stderr, flush=True)
    record = {"exit_code": EXIT_NO_OUTCOME, "slot": slot_id, "stopped": False, "refused": message}
    store.put_bytes(keys.done(SweepKeys.run_id_of(queued)), json.dumps(record).encode())


def _outcome_of(store: Any, run_id: str) -> dict[str, Any]:
    """The input's outcome as the slot's table shows it (read back unverified: this process just wrote it)."""
    try:
        outcome = Outcome.from_json(store.get_bytes(RunLayout(run_id).outcome))
    except Exception:  # no outcome: the done record's exit code says why
        return {}
    return {"status": outcome.status, "error_type": outcome.error_type}


def _serve(
    store: Any, keys: SweepKeys, slot_id: str, item: dict[str, Any], queued: str, base_environ: dict[str, str]
) -> bool:
    """Run one input; its log and done record written whatever way it ends. True: the input was stopped."""
    run_id = item["run_id"]
    print(f"kinetic slot: input {item.get('name') or run_id} (task run {item.get('task_run_id')})", flush=True)
    log_dir = tempfile.mkdtemp(prefix="kinetic-slot-")
    log = _LogShipper(store, keys, run_id, Path(log_dir) / "input.log")
    asked: list[str] = []
    watcher = _watch_input(store, keys, run_id, asked, log)
    code, stopped, started = EXIT_NO_OUTCOME, False, time.perf_counter()
    try:
        code = warm_runner.run_in_place(_input_env(base_environ, item, queued), base_environ, log.log_path)
    except BaseException:  # noqa: BLE001 - JobTerminated: the input was stopped (recorded below)
        stopped = True
    finally:
        log.served.set()
        signal.signal(signal.SIGTERM, lambda signum, frame: _STOPPED.append(signum))  # the records come first
        stopped = stopped or bool(asked) or bool(_STOPPED)
        try:
            watcher.join(WATCH_JOIN_SECONDS)
            log.ship(final=True)  # the last chunk before the done record: the caller forwards every line first
            record = {"exit_code": code, "slot": slot_id, "stopped": stopped, **_outcome_of(store, run_id)}
            record["seconds"] = round(time.perf_counter() - started, 3)
            store.put_bytes(keys.done(run_id), json.dumps(record).encode())
        finally:
            warm_runner.remove_tree(log_dir)
    return stopped


def _record_own_outcome(store: Any, slot_id: str, served: int, started: float) -> None:
    """The slot's own run ends Completed: it served its inputs (each input's failure is that input's)."""
    from kinetic_prefect import signing

    outcome = Outcome(status=COMPLETED, pid=os.getpid(), duration_s=round(time.perf_counter() - started, 4))
    signing.put(store, RunLayout(slot_id).outcome, outcome.to_json(), signing.key_from_env())


_STOPPED: list[int] = []  # SIGTERMs received (a cancel of the slot's run, or a stop this slot asked itself)


def _take_inputs(store: Any, keys: SweepKeys, slot_id: str, base_environ: dict[str, str]) -> int:
    """Serve inputs until none comes for the idle time, the sweep is closed, or an input was stopped."""
    from kinetic_prefect.pod import runner

    idle_seconds = float(base_environ.get(Env.SLOT_IDLE_SECONDS) or 0)
    seen: set[str] = set()
    served = 0
    deadline = time.monotonic() + idle_seconds
    while not _STOPPED:
        runner.install_sigterm_handler()  # runner.main installs its own per input
        queued = _claim_next(store, keys, slot_id, seen)
        if queued is None:
            if time.monotonic() > deadline or store.exists(keys.closed):
                break
            time.sleep(POLL_SECONDS)
            continue
        try:
            item = _read_item(store, queued)
            _input_env(base_environ, item, queued)  # its keys unwrap, or it is refused before it runs
        except Exception as exc:
            _refuse(store, keys, slot_id, queued, exc)
            continue
        served += 1
        if _serve(store, keys, slot_id, item, queued, base_environ) or warm_runner.stray_threads():
            break  # a stopped input, or threads an input left behind, end the slot: the next slot is fresh
        deadline = time.monotonic() + idle_seconds
    return served


def main() -> int:
    from kinetic_prefect.pod import runner
    from kinetic_prefect.storage import open_store

    started = time.perf_counter()
    base_environ = dict(os.environ)
    keys = SweepKeys(base_environ[Env.SWEEP_ID])
    slot_id = base_environ[Env.RUN_ID]
    store = open_store(base_environ[Env.STORE])
    global _STOPPED
    _STOPPED = runner.record_sigterm()  # and what runner.main installs for each input records it too
    if base_environ.get(Env.OWNER_PID):
        runner.watch_owner(int(base_environ[Env.OWNER_PID]))
    served = 0
    with contextlib.suppress(runner.JobTerminated):
        served = _take_inputs(store, keys, slot_id, base_environ)
    print(f"kinetic slot: leaving after {served} input(s)", flush=True)
    try:
        _record_own_outcome(store, slot_id, served, started)
    except Exception as exc:
        print(f"kinetic slot: could not record its outcome: {exc!r}", file=sys.stderr, flush=True)
        return EXIT_NO_OUTCOME
    return EXIT_OUTCOME_RECORDED


if __name__ == "__main__":
    code = main()
    from kinetic_prefect.pod import working_copy

    working_copy.remove_kept()  # os._exit below runs no atexit hook
    sys.stdout.flush()
    os._exit(code)  # threads an input left behind are not waited for
