"""Pod side: debug mode (``debug=True``). Before the function runs, the job starts a debugpy server, records where
it listens (``RunLayout.debugger``) and waits for a client; ``kinetic-prefect jobs debug JOB --port P`` makes that
server reachable on the caller's machine and prints the editor's attach configuration.

Only the coordinator (host 0) of a group waits for a debugger: it is the host whose value comes back, and one
debugger per group is what an editor can drive. debugpy is imported here only, so a job without debug mode never
needs it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from types import CodeType, FunctionType
from typing import Any

from kinetic_prefect import signing
from kinetic_prefect.contract import DEBUG_PORT, DEBUGPY_REQUIREMENT, Env, RunLayout, settings

LISTEN_HOST = "127.0.0.1"  # a port-forward (kinetic-gke) and a local forward (kinetic-local) both reach localhost


class DebuggerNotAttached(RuntimeError):
    """Nobody attached a debugger within the wait (``KINETIC_DEBUG_WAIT_SECONDS``); the function never ran."""


def wanted(host_index: int) -> bool:
    return os.environ.get(Env.DEBUG) == "1" and host_index == 0


def wait_seconds() -> float:
    return settings.DEBUG_WAIT_SECONDS.value()


def _import_debugpy() -> Any:
    # Set before debugpy starts its adapter, which inherits it: debugpy's frozen-module warning would otherwise
    # open every debug job's log with four lines about a flag the job cannot pass.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    try:
        import debugpy
    except ImportError:
        raise RuntimeError(
            f"debug=True needs debugpy in the job's environment and it is not installed there: with requirements= "
            f"it is added for you ({DEBUGPY_REQUIREMENT}); without requirements the job runs on the worker's "
            f"interpreter, so install debugpy there (uv pip install '{DEBUGPY_REQUIREMENT}' --python "
            f"{sys.executable}) or pass requirements="
        ) from None
    return debugpy


DYNAMIC_CODE = "<dynamic-code>"  # cloudpickle's file name for the code of a function it pickles by value


def _moved_code(code: CodeType, filename: str) -> CodeType:
    consts = tuple(_moved_code(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _job_file(fn: FunctionType, old_root: str, new_root: str, sources: dict[str, str]) -> str | None:
    filename = fn.__code__.co_filename
    if filename == DYNAMIC_CODE:
        relative = sources.get(fn.__module__)
        return os.path.join(new_root, relative) if relative else None
    if filename.startswith(old_root + os.sep):
        return new_root + filename[len(old_root) :]
    return None


def relocate(obj: Any, old_root: str, new_root: str, sources: dict[str, str], seen: set[int] | None = None) -> None:
    """Point the code of ``obj`` (and of the project's functions and classes it reaches) at the job's working copy.

    A function of the caller's project travels by value, and cloudpickle names its file ``<dynamic-code>``, which
    no editor can set a breakpoint in. ``sources`` (module name -> file relative to the project root, sent by the
    caller) says which file each came from; the editor maps its project root to the working copy
    (``pathMappings``), where the modules the job imports itself come from too."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, FunctionType):
        filename = _job_file(obj, old_root, new_root, sources)
        if filename is None:
            return
        obj.__code__ = _moved_code(obj.__code__, filename)
        reachable = [*obj.__globals__.values(), *(c.cell_contents for c in obj.__closure__ or () if _filled(c))]
        for value in reachable:
            relocate(value, old_root, new_root, sources, seen)
    elif isinstance(obj, type):
        for value in vars(obj).values():
            relocate(getattr(value, "__func__", value), old_root, new_root, sources, seen)


def _filled(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _EMPTY
    except ValueError:  # a closure variable not assigned yet
        return False


_EMPTY = object()


def _record(store: Any, layout: RunLayout, host: str, port: int, work_dir: str | None) -> None:
    record = {
        "host": host,
        "port": port,
        "pod": os.environ.get(Env.POD_NAME),
        "namespace": os.environ.get(Env.POD_NAMESPACE),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "remote_root": work_dir or os.environ.get(Env.DEBUG_CALLER_ROOT) or os.getcwd(),
        "caller_root": os.environ.get(Env.DEBUG_CALLER_ROOT),
    }
    signing.put(store, layout.debugger, json.dumps(record).encode(), signing.key_from_env())


def _say(text: str) -> None:
    print(f"kinetic runner: {text}", file=sys.stderr, flush=True)


def wait_for_client(store: Any, layout: RunLayout, work_path: Any, fn: Any) -> None:
    """Listen, record where, and block until a debugger attaches (or fail naming that nobody did). ``work_path``:
    the job's working copy of the project (None when the call ships no project)."""
    work_dir = str(work_path) if work_path else None
    debugpy = _import_debugpy()
    timeout = wait_seconds()
    caller_root = os.environ.get(Env.DEBUG_CALLER_ROOT)
    if work_dir and caller_root:
        relocate(fn, caller_root, work_dir, json.loads(os.environ.get(Env.DEBUG_SOURCES) or "{}"))
    os.environ["PYTHONBREAKPOINT"] = "debugpy.breakpoint"  # breakpoint() in the function pauses in the editor
    host, port = debugpy.listen((LISTEN_HOST, int(os.environ.get(Env.DEBUG_PORT) or 0)))
    _record(store, layout, host, port, work_dir)
    job = os.environ.get(Env.FLOW_RUN_ID) or layout.run_id
    _say(
        f"debugpy listens on {host}:{port} ({socket.gethostname()}, pid {os.getpid()}); waiting up to "
        f"{timeout:.0f} s for a debugger. Attach: `kinetic-prefect jobs debug {job} --port {DEBUG_PORT}`, "
        f"then attach your editor to 127.0.0.1:{DEBUG_PORT} (the command prints a launch.json entry)"
    )
    attached = threading.Event()

    def wait() -> None:
        debugpy.wait_for_client()
        attached.set()

    threading.Thread(target=wait, name="kinetic-debugger-wait", daemon=True).start()
    deadline = time.monotonic() + timeout
    while not attached.wait(0.2):  # short waits: a SIGTERM (cancel) is handled between them
        if time.monotonic() > deadline:
            debugpy.wait_for_client.cancel()
            raise DebuggerNotAttached(
                f"nobody attached a debugger within {timeout:.0f} s, so the function did not run. Attach with "
                f"`kinetic-prefect jobs debug {job} --port {DEBUG_PORT}` while the job waits, or give it longer: "
                f"{Env.DEBUG_WAIT_SECONDS} in the caller's environment (seconds)"
            )
    _say("a debugger attached")
    global _attached
    _attached = debugpy


_attached: Any = None  # debugpy, once a debugger attached to this job (wait_for_client)


def attached_debugpy(fn: Any) -> Any:
    """debugpy when a debugger attached to this job, else None. The runner then calls ``debugpy.breakpoint()``
    itself, on the line just before the function (Kinetic's pause: the editor stops there even with no
    breakpoint set, and Step Into enters the function; issue 48, defect 9)."""
    if _attached is None:
        return None
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "the function")
    _say(
        f"paused just before {name} in the debugger: press Step Into to enter your function, or Continue to run "
        "it (a breakpoint() in it stops there too)"
    )
    return _attached
