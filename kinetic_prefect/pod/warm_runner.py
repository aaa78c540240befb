"""Job side of a warm runner (kinetic-local): one process that runs call after call of one environment.

``python -m kinetic_prefect.pod.warm_runner CONTROL_DIR`` runs ``runner.main`` once per call the launcher hands it,
then waits up to the call's keep-warm time for the next, and leaves. What it keeps between calls: the interpreter,
third-party imports and what they cache (JAX/XLA compilation caches, a loaded CUDA context), the node cache
(``Data`` and project archives already unpacked). What each call gets fresh: its environment variables (exactly
the call's), its own log file as stdout/stderr, a new working directory, and the user's project modules imported
again (those under the restored project folder are dropped from ``sys.modules`` after every call).

The hand-over is a few files in the control folder (names in ``contract.WarmRunnerFiles``), each written whole
and renamed into place, so either side may die at any moment without the other misreading it:

* the launcher claims an idle runner by renaming ``idle`` to ``claimed`` (the runner leaving renames ``idle``
  to ``leaving``: of two renames of one file, one wins), then writes ``call.json``;
* the runner takes ``call.json``, runs it, writes the call's exit status into the call's own job folder
  (``exit_status``), and writes ``idle`` again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kinetic_prefect.contract import EXIT_NO_OUTCOME, Env, WarmRunnerFiles

POLL_SECONDS = 0.02


def _launcher_alive(pid: int | None) -> bool:
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
            call = json.loads(call_file.read_text())
            call_file.unlink()
            (control / WarmRunnerFiles.CLAIMED).unlink(missing_ok=True)
            return call
        expired = deadline is not None and time.monotonic() > deadline
        if expired or not _launcher_alive(launcher_pid):
            try:
                os.rename(control / WarmRunnerFiles.IDLE, control / WarmRunnerFiles.LEAVING)
                return None
            except FileNotFoundError:  # claimed a moment ago: its call is on the way
                pass
        time.sleep(POLL_SECONDS)


def _project_modules(code_dirs: set[str]) -> list[str]:
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.split(".")[0] == "kinetic_prefect":
            continue  # the runner's own modules, even where the project ships a copy of them
        if path and any(path.startswith(d + os.sep) for d in code_dirs):
            names.append(name)
    return names


def _run_call(call: dict[str, Any], base_environ: dict[str, str]) -> int:
    from kinetic_prefect.pod import runner

    job_dir = Path(call["job_dir"])
    env = {k: v for k, v in call["env"].items() if k != Env.OWNER_PID}  # watched once, by this process
    os.environ.clear()
    os.environ.update(env)
    path_before = list(sys.path)
    workdir = tempfile.mkdtemp(prefix="kinetic-call-")
    os.chdir(workdir)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(job_dir / call["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
        _remove_tree(workdir)
        os.environ.clear()
        os.environ.update(base_environ)
    return code


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(control_dir: str) -> int:
    from kinetic_prefect.pod import runner

    control = Path(control_dir)
    base_environ = dict(os.environ)
    launcher_pid = int(base_environ[Env.WARM_LAUNCHER_PID]) if base_environ.get(Env.WARM_LAUNCHER_PID) else None
    stopped: list[int] = []
    unwind = runner._on_sigterm  # noqa: SLF001

    def on_sigterm(signum: int, frame: Any) -> None:
        stopped.append(signum)
        unwind(signum, frame)  # the call unwinds as in a cold job

    runner._on_sigterm = on_sigterm  # noqa: SLF001 - what runner.main installs for each call

    if os.environ.get(Env.OWNER_PID):
        runner._watch_owner(int(os.environ[Env.OWNER_PID]))  # noqa: SLF001
    deadline: float | None = None
    served = 0
    try:
        while True:
            signal.signal(signal.SIGTERM, on_sigterm)  # runner.main installs its own for the call
            call = _next_call(control, deadline, launcher_pid)
            if call is None:
                print(f"kinetic warm runner: leaving after {served} call(s)", flush=True)
                return 0
            code = _run_call(call, base_environ)
            served += 1
            _write_whole(Path(call["job_dir"]) / WarmRunnerFiles.EXIT_STATUS, str(code))
            if stopped:  # a stopped call stops its runner: the launcher starts a fresh one for the next call
                return 0
            keep_warm = call.get("keep_warm_seconds")
            deadline = None if keep_warm is None else time.monotonic() + float(keep_warm)
            _write_whole(control / WarmRunnerFiles.IDLE, str(served))
    except runner.JobTerminated:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
