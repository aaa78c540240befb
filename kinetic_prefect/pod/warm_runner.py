"""Job side of a warm runner: one process that runs call after call of one environment.

``python -m kinetic_prefect.pod.warm_runner CONTROL_DIR`` (kinetic-local) runs ``runner.main`` once per call the
launcher hands it, then waits up to the call's keep-warm time for the next, and leaves. What it keeps between
calls: the interpreter, third-party imports and what they cache (JAX/XLA compilation caches, a loaded CUDA
context), the node cache (``Data`` and project archives already unpacked). What each call gets fresh: its
environment variables (exactly the call's), its own log file as stdout/stderr, a new working directory, and the
user's project modules imported again (those under the restored project folder are dropped from ``sys.modules``
after every call).

The hand-over is a few files in the control folder (names in ``contract.WarmRunnerFiles``), each written whole
and renamed into place, so either side may die at any moment without the other misreading it:

* the launcher claims an idle runner by renaming ``idle`` to ``claimed`` (the runner leaving renames ``idle``
  to ``leaving``: of two renames of one file, one wins), then writes ``call.json``;
* the runner takes ``call.json``, runs it, writes the call's exit status into the call's own job folder
  (``exit_status``), and writes ``idle`` again;
* a runner that leaves by itself, idle, writes ``left.json`` (since when it waited, when it left, why): its
  launcher bills a floor runner's idle time to the pool from it.

``python -m kinetic_prefect.pod.warm_runner`` with no argument is a warm pod (kinetic-gke): its first call is the
pod's own environment, and the next ones come through the store (``contract.WarmPodKeys``); each call's output is
the pod's log between the call's two markers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kinetic_prefect.contract import (
    CALL_BEGIN_MARKER,
    CALL_END_MARKER,
    EXIT_NO_OUTCOME,
    Env,
    RunLayout,
    WarmPodKeys,
    WarmRunnerFiles,
)

POLL_SECONDS = 0.02
STORE_POLL_SECONDS = 0.25  # a warm pod asks the store for its next call this often
CLAIMED_CALL_SECONDS = 60.0  # a claim with no call after this long: the launcher died in between; the pod leaves


def process_alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists (None: no process to watch, so yes)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _write_whole(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _next_call(control: Path, deadline: float | None, launcher_pid: int | None) -> dict[str, Any] | None:
    """The next call handed over, or None once the runner has left (keep-warm time over, or its launcher gone)."""
    call_file = control / WarmRunnerFiles.CALL
    while True:
        if call_file.exists():
            call: dict[str, Any] = json.loads(call_file.read_text())
            call_file.unlink()
            (control / WarmRunnerFiles.CLAIMED).unlink(missing_ok=True)
            return call
        expired = deadline is not None and time.monotonic() > deadline
        if expired or not process_alive(launcher_pid):
            try:
                os.rename(control / WarmRunnerFiles.IDLE, control / WarmRunnerFiles.LEAVING)
                return None
            except FileNotFoundError:  # claimed a moment ago: its call is on the way
                pass
        time.sleep(POLL_SECONDS)


def _record_leaving(control: Path, idle_since: float, served: int, launcher_pid: int | None) -> None:
    """``WarmRunnerFiles.LEFT``: how long this runner waited idle before it left by itself, and why; its launcher
    bills a floor runner's idle time to the pool from it (this process may not reach Prefect)."""
    why = WarmRunnerFiles.LEFT_IDLE_LIMIT if process_alive(launcher_pid) else WarmRunnerFiles.LEFT_LAUNCHER_GONE
    record = {"idle_since": idle_since, "left_at": time.time(), "calls": served, "why": why}
    _write_whole(control / WarmRunnerFiles.LEFT, json.dumps(record))


def _project_modules(code_dirs: set[str]) -> list[str]:
    names = []
    # dict.copy() is one step under the GIL; a list of the items allocates as it walks, and an allocation can start a
    # collection whose finalizers import, or let a thread the last call left running import, mid-walk.
    for name, module in sys.modules.copy().items():
        path = getattr(module, "__file__", None) or ""
        if name.split(".")[0] == "kinetic_prefect":
            continue  # the runner's own modules, even where the project ships a copy of them
        if path and any(path.startswith(d + os.sep) for d in code_dirs):
            names.append(name)
    return names


def local_call_key(control: Path) -> str:
    """The name a kinetic-local runner's hand-over is signed under: the runner's own scope (``warm/<environment
    key>/<runner>``), which only the launcher that started it and the runner itself hold a key for."""
    return f"{WarmPodKeys.control(control.parent.name, control.name)}/{WarmRunnerFiles.CALL}"


class _HandOvers:
    """What this runner remembers of its hand-overs: the number of the last one it ran (signed in each record)."""

    last = 0


def _run_call(call: dict[str, Any], base_environ: dict[str, str], control: Path, runner_keys: Any) -> int:
    job_dir = Path(call["job_dir"])
    object_key = local_call_key(control)
    shared = {k: v for k, v in base_environ.items() if k not in (Env.OWNER_PID, Env.WARM_LAUNCHER_PID)}
    try:  # the record's own signature, its number, then the keys it carries for this call
        record = read_call(
            call["record"].encode(),
            (call.get("signature") or "").encode() or None,
            object_key,
            str(control / WarmRunnerFiles.CALL),
            runner_keys,
        )
        number = record.get("number")
        if not isinstance(number, int) or number <= _HandOvers.last:
            raise RefusedCall(
                f"{control / WarmRunnerFiles.CALL} is hand-over {number!r}, and this runner has already run "
                f"hand-over {_HandOvers.last}: a copy of an earlier call put back, refusing it"
            )
        _HandOvers.last = number
        env = call_environment(record, f"{object_key}#{record['env'].get(Env.RUN_ID, '')}", runner_keys, shared)
    except (RefusedCall, KeyError, ValueError) as exc:
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / call["log"]).write_text(f"kinetic warm runner: refused the call: {exc}\n")
        print(f"kinetic warm runner: refused a call: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_OUTCOME
    return run_in_place(env, base_environ, job_dir / call["log"])


def run_in_place(env: dict[str, str], base_environ: dict[str, str], log_path: Path | None) -> int:
    """``runner.main`` once, in this process, with exactly ``env``; its output goes to ``log_path`` (None: this
    process's own stdout and stderr, a pod's log); the user's project modules are dropped afterwards."""
    from kinetic_prefect.pod import runner, working_copy

    working_copy.reuse_between_calls()  # the project's working copy is restored for the next call, not copied anew
    os.environ.clear()
    os.environ.update(env)
    path_before = list(sys.path)
    threads_before = set(threading.enumerate())
    recursion_limit = sys.getrecursionlimit()
    workdir = tempfile.mkdtemp(prefix="kinetic-call-")
    os.chdir(workdir)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    if log_path is not None:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    code = EXIT_NO_OUTCOME
    try:
        code = runner.main()
    except BaseException as exc:  # noqa: BLE001 - runner.main records its own failures; this is a last word
        print(f"kinetic warm runner: the call ended with {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, runner.JobTerminated):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        code_dirs = {p for p in sys.path if p not in path_before}
        for name in _project_modules(code_dirs):
            del sys.modules[name]  # the next call imports the user's project modules afresh
        sys.path[:] = path_before
        os.chdir(base_environ.get("HOME") or "/")
        remove_tree(workdir)
        os.environ.clear()
        os.environ.update(base_environ)
        sys.setrecursionlimit(recursion_limit)
        _STRAY_THREADS[:] = [t.name for t in _threads_left(threads_before)]
    return code


def _threads_left(before: set[threading.Thread], grace: float = 1.0) -> list[threading.Thread]:
    """Threads the call started (not the runner's own ``kinetic-*`` ones) still running ``grace`` s after it."""
    deadline = time.monotonic() + grace
    left = [t for t in threading.enumerate() if t not in before and not t.name.startswith("kinetic-")]
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))  # one that is just ending is not a stray
    return [t for t in left if t.is_alive()]


# Threads the last call started and left running. Their output would land in the next calls' logs (this process's
# stdout is the next call's log), so a runner whose call left any is not reused: it leaves after that call.
_STRAY_THREADS: list[str] = []


def stray_threads() -> list[str]:
    """The names of the threads the last call left running (empty when it left none)."""
    return list(_STRAY_THREADS)


def _leave_if_threads_left(served: int) -> None:
    """End this runner at once (without waiting for the threads) if the last call left threads running."""
    if not _STRAY_THREADS:
        return
    print(
        f"kinetic warm runner: leaving after {served} call(s): the last call left {len(_STRAY_THREADS)} thread(s) "
        f"running ({', '.join(_STRAY_THREADS[:5])}); the next call gets a fresh runner",
        flush=True,
    )
    sys.stderr.flush()
    os._exit(0)


def remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(control_dir: str) -> int:
    from kinetic_prefect import signing
    from kinetic_prefect.pod import runner

    control = Path(control_dir)
    base_environ = dict(os.environ)
    runner_keys = signing.parse_keys(base_environ.pop(signing.KEY_ENV, None))
    hide_from_environment(signing.KEY_ENV)  # kept in memory only: every call's code can read the environment
    launcher_pid = int(base_environ[Env.WARM_LAUNCHER_PID]) if base_environ.get(Env.WARM_LAUNCHER_PID) else None
    stopped = runner.record_sigterm()
    if os.environ.get(Env.OWNER_PID):
        runner.watch_owner(int(os.environ[Env.OWNER_PID]))
    deadline: float | None = None
    served = 0
    idle_since = time.time()
    try:
        while True:
            runner.install_sigterm_handler()  # a call may have installed its own
            call = _next_call(control, deadline, launcher_pid)
            if call is None:
                _record_leaving(control, idle_since, served, launcher_pid)
                print(f"kinetic warm runner: leaving after {served} call(s)", flush=True)
                return 0
            code = _run_call(call, base_environ, control, runner_keys)
            served += 1
            _write_whole(Path(call["job_dir"]) / WarmRunnerFiles.EXIT_STATUS, str(code))
            if stopped:  # a stopped call stops its runner: the launcher starts a fresh one for the next call
                return 0
            _leave_if_threads_left(served)
            keep_warm = call.get("keep_warm_seconds")
            deadline = None if keep_warm is None else time.monotonic() + float(keep_warm)
            idle_since = time.time()
            _write_whole(control / WarmRunnerFiles.IDLE, str(served))
    except runner.JobTerminated:
        return 0


def hide_from_environment(name: str) -> None:
    """Take ``name`` out of this process's environment: ``os.environ`` and the C environment, and the environment
    block the process started with, which ``/proc/self/environ`` shows whatever ``unsetenv`` did (its bytes are
    zeroed in place, after checking they are where the kernel says). Linux; elsewhere only ``os.environ``."""
    import ctypes

    os.environ.pop(name, None)
    try:
        with open("/proc/self/stat", "rb") as stat_file:
            stat = stat_file.read()
        with open("/proc/self/environ", "rb") as environ_file:
            block = environ_file.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # from field 3 (state); env_start is field 50
        env_start, env_end = int(fields[47]), int(fields[48])
    except (OSError, ValueError, IndexError):
        return
    if not block or env_end - env_start < len(block) or ctypes.string_at(env_start, len(block)) != block:
        return
    offset, prefix = 0, name.encode() + b"="
    for entry in block.split(b"\0"):
        if entry.startswith(prefix):
            ctypes.memset(env_start + offset, 0, len(entry))
        offset += len(entry) + 1


class RefusedCall(Exception):
    """A hand-over record that fails its signature, or hands a signed runner no keys: never run."""


def call_environment(
    record: dict[str, Any], object_key: str, runner_keys: Any, shared: dict[str, str]
) -> dict[str, str]:
    """The environment one handed-over call runs with: this runner's shared variables, the record's per-call
    variables (only those: a record cannot set the signing key, the store, the command's interpreter...) and,
    for a signed runner, the call's own run keys unwrapped from the record (never the runner's own keys)."""
    from kinetic_prefect import signing

    env = {k: v for k, v in shared.items() if k != signing.KEY_ENV}
    env.update({str(k): str(v) for k, v in record["env"].items() if WarmRunnerFiles.is_per_call(str(k))})
    if runner_keys is not None:
        if not record.get("keys"):
            raise RefusedCall(f"{object_key} hands over no signing keys: refusing the call")
        try:
            granted = runner_keys.accept(record["keys"], under=signing.scope_of(object_key), nonce=object_key)
        except signing.TamperedObject as exc:
            raise RefusedCall(str(exc)) from None
        env[signing.KEY_ENV] = granted.to_env()
    return env


def read_call(blob: bytes, signature: bytes | None, object_key: str, where: str, runner_keys: Any) -> dict[str, Any]:
    """A hand-over record, verified with the runner's own scope key when the runner is signed."""
    from kinetic_prefect import signing

    try:
        signing.check(runner_keys, object_key, blob, signature, where)
    except signing.TamperedObject as exc:
        raise RefusedCall(str(exc)) from None
    record: dict[str, Any] = json.loads(blob)
    return record


def _next_pod_call(store: Any, control: str, n: int, keep_warm_seconds: float) -> tuple[str, bytes] | None:
    """Call ``n``'s record (its store key and bytes) once a launcher hands it over, or None once the pod has
    left."""
    from kinetic_prefect.storage import ObjectNotFound

    deadline = time.monotonic() + keep_warm_seconds
    claimed_at: float | None = None
    while True:
        object_key = f"{control}/{WarmPodKeys.call(n)}"
        try:
            blob = store.get_bytes(object_key)
        except ObjectNotFound:
            pass
        else:
            return object_key, blob
        now = time.monotonic()
        if claimed_at is None and now > deadline:
            if store.put_bytes(f"{control}/{WarmPodKeys.claim(n)}", WarmPodKeys.LEAVING, if_absent=True):
                return None
            claimed_at = now  # a launcher won call n a moment ago: its call is on the way
        if claimed_at is not None and now - claimed_at > CLAIMED_CALL_SECONDS:
            return None
        time.sleep(STORE_POLL_SECONDS)


def _take_pod_call(store: Any, handed: tuple[str, bytes], pod_keys: Any, shared: dict[str, str]) -> dict[str, str]:
    """The per-call variables of a handed-over call, checked; the record is deleted either way."""
    from kinetic_prefect import signing

    object_key, blob = handed
    try:
        signature: bytes | None = store.get_bytes(object_key + signing.SUFFIX)
    except Exception:
        signature = None
    signing.delete(store, object_key)
    record = read_call(blob, signature, object_key, store.url_for(object_key), pod_keys)
    env = call_environment(record, object_key, pod_keys, shared)
    return {k: v for k, v in env.items() if WarmRunnerFiles.is_per_call(k) or k == signing.KEY_ENV}


def _record_floor_leaving(store: Any, environ: dict[str, str], idle_since: float, served: int) -> None:
    """A floor pod leaving idle: its idle time into the store (``WarmPodKeys.left``), for whoever reaches Prefect to
    bill to its pool (a pod may not reach Prefect)."""
    floor = environ.get(Env.WARM_FLOOR)
    if not floor:
        return
    record = {**json.loads(floor), "idle_since": idle_since, "left_at": time.time(), "calls": served}
    job_name = environ[Env.WARM_CONTROL].rstrip("/").rsplit("/", 1)[-1]
    store.put_bytes(WarmPodKeys.left(job_name), json.dumps(record).encode())


def pod_main() -> int:
    """A warm pod: the pod's own environment is its first call; the next ones come through the store."""
    from kinetic_prefect import signing
    from kinetic_prefect.pod import runner
    from kinetic_prefect.storage import open_store

    base_environ = dict(os.environ)
    pod_keys = signing.parse_keys(base_environ.pop(signing.KEY_ENV, None))
    hide_from_environment(signing.KEY_ENV)  # the pod's own key, in memory only: each call gets its run's keys
    control = base_environ[Env.WARM_CONTROL]
    keep_warm_seconds = float(base_environ.get(Env.WARM_KEEP_SECONDS) or 0)
    shared = {k: v for k, v in base_environ.items() if not WarmRunnerFiles.is_per_call(k)}
    call_env = {k: v for k, v in base_environ.items() if WarmRunnerFiles.is_per_call(k)}
    if pod_keys is not None:  # the first call: its run's keys, without the pod's own (those check hand-overs)
        call_env[signing.KEY_ENV] = signing.Keyring(
            scoped={s: k for s, k in pod_keys.scoped.items() if s != signing.scope_of_prefix(control)},
            master_id=pod_keys.master_id,
        ).to_env()
    store = open_store(base_environ[Env.STORE])
    stopped = runner.record_sigterm()
    served = 0
    try:
        while True:
            runner.install_sigterm_handler()
            run_id = call_env.get(Env.RUN_ID, "")
            started = time.time()
            print(CALL_BEGIN_MARKER + run_id, flush=True)
            code = run_in_place({**shared, **call_env}, base_environ, None)
            print(CALL_END_MARKER + run_id, flush=True)
            served += 1
            record = {"exit_code": code, "started": started, "ended": time.time()}
            store.put_bytes(RunLayout(run_id).warm_exit, json.dumps(record).encode())
            if stopped:
                return 0
            if _STRAY_THREADS:
                store.delete_prefix(control)  # as a pod leaving idle: no launcher hands it another call
                _leave_if_threads_left(served)
            # Ready only after the exit record: a stop that finds no record may delete this pod, and must not
            # take a call handed to it meanwhile. (The next call is submitted once the worker has read the
            # record and Prefect has freed the slot, well after this write.)
            idle = {"idle_since": time.time()}  # what `kinetic-prefect warm list` bills a floor pod's idle time from
            store.put_bytes(f"{control}/{WarmPodKeys.ready(served)}", json.dumps(idle).encode())
            handed = _next_pod_call(store, control, served, keep_warm_seconds)
            if handed is None:
                _record_floor_leaving(store, base_environ, idle["idle_since"], served)
                print(f"kinetic warm pod: leaving after {served} call(s)", flush=True)
                store.delete_prefix(control)
                return 0
            try:
                call_env = _take_pod_call(store, handed, pod_keys, shared)
            except RefusedCall as exc:  # a forged hand-over: nothing of it runs, and the pod takes no other call
                print(f"kinetic warm pod: refused call {served + 1}: {exc}", file=sys.stderr, flush=True)
                store.delete_prefix(control)
                return 0
    except runner.JobTerminated:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) > 1 else pod_main())
