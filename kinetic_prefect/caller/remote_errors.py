"""Caller side: turn a failed job's outcome and traceback into the exception the call raises.

The job runner records a failure in its outcome record (``contract.Outcome``: the error's type, message and
traceback, and the phase it failed in) and, in the result object, the exception itself. The caller raises the
function's own exception where it can be rebuilt, with the job's traceback (its frames mapped back to the
caller's files) as its cause; a kinetic error where the job failed around the function (a budget, a full store,
a setup phase); a ``RemoteError`` where the exception's type exists on the job side only.
"""

from __future__ import annotations

import contextlib
import linecache
import re
from collections.abc import Callable
from typing import Any

import cloudpickle

from kinetic_prefect.contract import BUDGET_ERROR_TYPE, STORE_FULL_ERROR, Outcome
from kinetic_prefect.errors import (
    BudgetExceeded,
    KineticJobInterrupted,
    KineticJobSetupError,
    RemoteError,
    RemoteTraceback,
    StoreFull,
)

_DYNAMIC_FRAME = re.compile(r'File "<dynamic-code>", line (\d+), in (\S+)\n')
_NO_MODULE = re.compile(r"No module named '([^']+)'")


def missing_module_hint(message: str) -> str | None:
    """The line that says what to do when the job failed on an import of a module its environment lacks (a
    module installed here, or nowhere); None for other errors, and for a module of the project itself (found here
    outside site-packages: it is shipped with the project, not installed)."""
    found = _NO_MODULE.search(message or "")
    if found is None:
        return None
    module = found.group(1)
    with contextlib.suppress(Exception):
        import importlib.util

        spec = importlib.util.find_spec(module.partition(".")[0])
        origin = (spec.origin or "") if spec is not None else ""
        if spec is not None and origin not in ("", "built-in", "frozen") and "-packages" not in origin:
            return None
    return (
        f"the job's environment has no module {module!r}: add it to requirements= of @kinetic_task "
        "(or the pool's requirements)"
    )


def readable_traceback(traceback_text: str, fn: Callable[..., Any]) -> str:
    """Put file names and source lines back into frames of functions that were pickled by value.

    cloudpickle blanks ``co_filename`` to ``<dynamic-code>``; line numbers survive, and the
    caller still has the code, so frames of the task function and its module's functions can
    be mapped back to the caller's files.
    """
    candidates = [fn] + [getattr(v, "user_fn", v) for v in getattr(fn, "__globals__", {}).values()]
    codes: dict[str, list[Any]] = {}
    for candidate in candidates:
        code = getattr(candidate, "__code__", None)
        if code is not None:
            codes.setdefault(code.co_name, []).append(code)

    def replace(match: re.Match) -> str:
        line, name = int(match.group(1)), match.group(2)
        for code in codes.get(name, []):
            last = max((ln for _, _, ln in code.co_lines() if ln), default=code.co_firstlineno)
            if code.co_firstlineno <= line <= last:
                source = linecache.getline(code.co_filename, line).strip()
                return f'File "{code.co_filename}", line {line}, in {name}\n' + (f"    {source}\n" if source else "")
        return match.group(0)

    return _DYNAMIC_FRAME.sub(replace, traceback_text)


def rebuild_exception(exc_type: type, exc_args: tuple, exc_state: dict[str, Any]) -> BaseException:
    """The remote exception, rebuilt without calling its own ``__init__`` (see
    runner._pickle_exception), but with its built-in base's ``__init__``: that is what sets
    ``SystemExit.code``, ``OSError.errno`` and the like from ``args``."""
    exc: BaseException = BaseException.__new__(exc_type)
    builtin = next(c for c in exc_type.__mro__ if c.__module__ == "builtins")
    with contextlib.suppress(Exception):
        builtin.__init__(exc, *exc_args)  # type: ignore[misc]  # the base's own __init__, on purpose
    exc.args = exc_args
    exc.__dict__.update(exc_state)
    return exc


def raise_remote(outcome: Outcome, result_blob: bytes | None, run_name: str, fn: Callable[..., Any]) -> None:
    """Raise what the failed job's ``outcome`` stands for: the function's own exception (``result_blob``, the
    pickled record the runner wrote) with the remote traceback as its cause, or the kinetic error that names
    why the job failed around the function (a budget, a full store, a setup phase)."""
    if outcome.error_type == BUDGET_ERROR_TYPE:
        raise BudgetExceeded(f"job {run_name}: {outcome.message} (its checkpoints and outputs are kept)")
    traceback_text = readable_traceback(outcome.traceback, fn)
    if outcome.error_type == STORE_FULL_ERROR:
        raise StoreFull(outcome.message) from RemoteTraceback(traceback_text)
    if not outcome.user_error:
        hint = missing_module_hint(outcome.message)
        raise KineticJobSetupError(
            outcome.phase or "?", f"{outcome.error_type}: {outcome.message}" + (f"\n{hint}" if hint else "")
        ) from RemoteTraceback(traceback_text)
    exc: BaseException | None = None
    if result_blob is not None:
        try:
            record = cloudpickle.loads(result_blob)
            if record[0] == "exception-object":  # the exception pickled as itself (runner._pickle_whole_exception)
                exc = record[1]
            else:
                _tag, exc_type, exc_args, exc_state = record
                exc = rebuild_exception(exc_type, exc_args, exc_state)
        except Exception:  # the type exists remotely only (e.g. a module the caller lacks)
            exc = None
    if isinstance(exc, KeyboardInterrupt) or (exc is None and outcome.error_type == "builtins.KeyboardInterrupt"):
        # Raised as is, it would look like Ctrl-C in the caller and crash the flow instead of failing the task.
        exc = KineticJobInterrupted(f"the job's function raised KeyboardInterrupt {outcome.message!r}".rstrip())
    if not isinstance(exc, BaseException):
        exc = RemoteError(outcome.error_type or "Exception", outcome.message)
    hint = missing_module_hint(outcome.message)
    if hint and isinstance(exc, ImportError) and isinstance(exc.msg, str):
        exc.msg = f"{exc.msg}\n{hint}"  # in str(exc), so in the task run's state message too
        exc.args = (exc.msg, *exc.args[1:])
    elif hint:
        exc.add_note(hint)
    exc.add_note(f"(raised in kinetic job {run_name}; the remote traceback is shown above)")
    exc.remote_traceback = traceback_text  # type: ignore[attr-defined]
    raise exc.with_traceback(None) from RemoteTraceback(traceback_text)
