"""Caller side: package a call (function + arguments) for a job.

The **call payload** holds the function and each argument pickled separately with cloudpickle, so an
unpicklable argument is reported by name before anything is stored; the job checks its sha256 before
unpickling a byte of it. The project's code travels beside it, as the project archive
(:mod:`kinetic_prefect.caller.project_archive`; its names are importable from here too).

Fan-outs (``.map()``) build many payloads at once, from many threads:

* the project's modules are registered for cloudpickle's pickle-by-value with reference counts
  under one lock (the registry is process-wide), so concurrent calls never unregister a module
  another call is still pickling with;
* the pickled function is shared by the calls (:func:`pickled_function`): it is reused while the
  objects it is made from are the same objects (code, defaults, closure cells, the globals it
  reads, the flow run). Rebinding a captured variable gives a fresh pickle; mutating a captured
  object in place (``weights[:] = 0``) does not: the function is a snapshot taken at its first
  call in a flow run. Pass what changes between calls as an argument, call
  :func:`forget_function`, or set ``KINETIC_PAYLOAD_CACHE=0``.

A payload over ``KINETIC_PAYLOAD_WARN_BYTES`` (bytes; default 10 MiB; 0: never) warns once per
function, naming the large closure variable, global or argument: large inputs belong in
``kinetic_prefect.Data``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import pickle
import sys
import sysconfig
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

# The project archive's names, for callers that import them from here.
from kinetic_prefect.caller.project_archive import (
    ALWAYS_IGNORED as ALWAYS_IGNORED,
)
from kinetic_prefect.caller.project_archive import (
    LARGE_TREE_BYTES as LARGE_TREE_BYTES,
)
from kinetic_prefect.caller.project_archive import (
    LARGE_TREE_FILES as LARGE_TREE_FILES,
)
from kinetic_prefect.caller.project_archive import (
    PROJECT_MARKERS as PROJECT_MARKERS,
)
from kinetic_prefect.caller.project_archive import (
    SECRET_PATTERNS as SECRET_PATTERNS,
)
from kinetic_prefect.caller.project_archive import (
    SOURCE_SUFFIXES as SOURCE_SUFFIXES,
)
from kinetic_prefect.caller.project_archive import (
    ProjectArchive as ProjectArchive,
)
from kinetic_prefect.caller.project_archive import (
    archive_project as archive_project,
)
from kinetic_prefect.caller.project_archive import (
    cached_project_archive as cached_project_archive,
)
from kinetic_prefect.caller.project_archive import (
    collect_project_files as collect_project_files,
)
from kinetic_prefect.caller.project_archive import (
    find_project_dir as find_project_dir,
)
from kinetic_prefect.caller.project_archive import (
    sha256_hex as sha256_hex,
)
from kinetic_prefect.contract import PAYLOAD_FORMAT, Env, settings
from kinetic_prefect.errors import PayloadError

logger = logging.getLogger("kinetic_prefect.caller.payload")


# Python 3.11's sysconfig fills its config-vars dict on first use without a lock: a second thread
# reading it meanwhile fails with "dictionary changed size during iteration" (seen in CI when a
# .map() fanned out its first calls). The first computation is serialised here.
_library_roots_lock = threading.Lock()
_library_roots_value: tuple[Path, ...] | None = None


def _library_roots() -> tuple[Path, ...]:
    global _library_roots_value
    with _library_roots_lock:
        if _library_roots_value is None:
            paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
            _library_roots_value = tuple(Path(p).resolve() for p in paths if p)
        return _library_roots_value


@functools.lru_cache(maxsize=16384)
def _is_project_file(file: str, project_dir: Path) -> bool:
    """Whether a module file is the user's code under the project (not a library installed there)."""
    path = Path(file).resolve()
    return (
        path.is_relative_to(project_dir)
        and not any(path.is_relative_to(lib) for lib in _library_roots())
        and "site-packages" not in path.parts
    )


def project_module_names(project_dir: Path) -> list[str]:
    """Top-level modules imported from the project directory (the user's own code).

    They are pickled by value so the job needs neither the caller's sys.path nor the module
    attribute lookup (a decorated function's module attribute is the Task, not the function).
    ``__main__`` is left out (cloudpickle pickles it by value anyway), and so are aliases: a
    ``sys.modules`` key that is not the module's own name, such as ``__mp_main__``, which
    ``import multiprocessing`` points at ``__main__``.
    """
    project_dir = Path(project_dir).resolve()
    loaded = tuple(sys.modules.copy())  # a fan-out's calls ask with the same modules loaded: answered once
    with _module_names_lock:
        known = _module_names.get(project_dir)
        if known is not None and known[0] == loaded:
            return list(known[1])
    found = _scan_project_modules(project_dir)
    with _module_names_lock:
        _module_names[project_dir] = (loaded, found)
    return list(found)


_module_names_lock = threading.Lock()
_module_names: dict[Path, tuple[tuple[str, ...], list[str]]] = {}  # project -> (sys.modules' names, the answer)


def _scan_project_modules(project_dir: Path) -> list[str]:
    names: set[str] = set()
    modules = sys.modules.copy()  # one step under the GIL: other threads import meanwhile
    for name, module in modules.items():
        file = getattr(module, "__file__", None)
        if not file or not isinstance(file, str) or name == "__main__" or name.split(".")[0] == "kinetic_prefect":
            continue
        if getattr(module, "__name__", None) != name:  # an alias (__mp_main__ -> __main__)
            continue
        if _is_project_file(file, project_dir):
            names.add(name.split(".")[0])
    return sorted(n for n in names if getattr(sys.modules.get(n), "__name__", None) == n and n != "__main__")


# cloudpickle's pickle-by-value registry is process-wide, and .map() builds payloads from many
# threads at once: registrations are reference-counted under one lock, so a module stays
# registered while any call still pickles with it, and only the last one unregisters it.
# Modules the user registered themselves are never touched.
_registry_lock = threading.Lock()
_registry_refs: dict[str, int] = {}


@contextlib.contextmanager
def _pickled_by_value(names: Iterable[str]) -> Iterator[frozenset[str]]:
    """Register the named modules for pickle-by-value for the duration of the block (thread-safe).

    Yields the names pickled by value for this call: those registered here and the user's own.
    """
    held: list[types.ModuleType] = []
    with _registry_lock:
        registry = set(cloudpickle.list_registry_pickle_by_value())
        users = frozenset(registry - set(_registry_refs))  # registered by the user, not by a call
        for name in names:
            module = sys.modules.get(name)
            if module is None or getattr(module, "__name__", None) != name:
                continue
            if name in _registry_refs:
                _registry_refs[name] += 1
            elif name in registry:
                continue  # registered by the user: theirs to keep
            else:
                try:
                    cloudpickle.register_pickle_by_value(module)
                except ValueError:
                    continue
                _registry_refs[name] = 1
            held.append(module)
    try:
        yield frozenset(m.__name__ for m in held) | users
    finally:
        with _registry_lock:
            for module in held:
                name = module.__name__
                _registry_refs[name] -= 1
                if _registry_refs[name] == 0:
                    del _registry_refs[name]
                    if name in cloudpickle.list_registry_pickle_by_value():
                        cloudpickle.unregister_pickle_by_value(module)


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling raises many types: TypeError, PicklingError, AttributeError...
        raise PayloadError(
            f"{what} cannot be pickled: {type(exc).__name__}: {exc}. Pass a value that pickles "
            "(plain data, arrays, a file path or kinetic_prefect.Data), or create the object inside the task."
        ) from exc


# ----- the pickled function, shared by every call of a fan-out
#
# A .map() over 1,000 items used to pickle the same function 1,000 times (a closure capturing a
# 50 MB array: 50 GB of pickling). The pickle is now cached per function object and reused as
# long as everything it was made from is *the same object*: the code, the defaults, each closure
# cell's content, each global the code reads (and, recursively, those of the plain functions it
# reaches), the attributes of project modules pickled by value, the modules registered by value
# and the Prefect flow run. Rebinding any of them (``weights = new_weights``, ``SCALE = 5``,
# ``fn.__defaults__ = ...``) gives a fresh pickle; mutating an object in place
# (``weights[:] = 0``, ``config["lr"] = 1e-3``) does not: the function is a snapshot taken at its
# first call in the flow run, as Ray's remote functions are. Content checks were rejected: hashing
# a 50 MB array costs about as much as pickling it. Pass values that change as arguments (they are
# pickled on every call), or call ``forget_function(fn)`` after mutating what it captures;
# ``KINETIC_PAYLOAD_CACHE=0`` turns the cache off.

_FUNCTION_CACHE_ENTRIES = 64
_FUNCTION_CACHE_BYTES = 2 * 2**30
_MISSING = object()


@dataclass
class _FunctionEntry:
    context: tuple  # compared with ==
    refs: tuple  # compared by identity; held so their ids cannot be reused while cached
    data: bytes


_function_cache: OrderedDict[int, _FunctionEntry] = OrderedDict()
_function_lock = threading.RLock()  # guards the cache; held while a missing function is pickled


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """Every name the code (and the code nested in it) may read as a global."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_code_names(const))
    return tuple(sorted(names))


def _registered(module_name: str, by_value: frozenset[str]) -> bool:
    """Whether the module or a package above it is pickled by value (as cloudpickle checks it)."""
    parts = module_name.split(".")
    return any(".".join(parts[:i]) in by_value for i in range(1, len(parts) + 1))


def _by_reference(fn: types.FunctionType, by_value: frozenset[str]) -> bool:
    """Whether cloudpickle pickles this function as a reference (module + name), as it decides it."""
    module_name = getattr(fn, "__module__", None)
    if not isinstance(module_name, str):
        return False
    module = sys.modules.get(module_name)
    if module is None or module_name == "__main__" or _registered(module_name, by_value):
        return False
    obj: Any = module
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn  # a nested, decorated or replaced function is pickled by value


def _function_refs(fn: Any, by_value: frozenset[str]) -> tuple | None:
    """The objects a function's pickle is made from, for an identity comparison (None: too many)."""
    refs: list[Any] = []
    seen: set[int] = set()
    stack = [fn]
    while stack:
        if len(refs) > 100_000:
            return None  # not worth comparing: pickle afresh
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType):
            refs += [obj, obj.__self__]
            stack.append(obj.__func__)
            continue
        if isinstance(obj, functools.partial):
            refs += [obj, obj.func, obj.args, *obj.args, *obj.keywords.values()]
            stack.append(obj.func)
            continue
        if not isinstance(obj, types.FunctionType) or (obj is not fn and _by_reference(obj, by_value)):
            refs.append(obj)
            continue
        refs += [obj, obj.__code__, obj.__defaults__, obj.__kwdefaults__, *(obj.__defaults__ or ())]
        refs += list((obj.__kwdefaults__ or {}).values()) + list(vars(obj).values())
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                value = _MISSING
            refs.append(value)
            if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
                stack.append(value)
        module_globals = obj.__globals__
        for name in _code_names(obj.__code__):
            value = module_globals.get(name, _MISSING)
            refs.append(value)
            if isinstance(value, types.FunctionType):
                stack.append(value)
            elif isinstance(value, types.ModuleType) and _registered(value.__name__, by_value):
                refs += list(vars(value).values())  # pickled whole, by value
    return tuple(refs)


def _flow_run_scope() -> str | None:
    """The current Prefect flow run, so each flow run pickles a function afresh (None outside one)."""
    context = sys.modules.get("prefect.context")
    if context is None:
        return None
    try:
        run_context = context.FlowRunContext.get()
        run = getattr(run_context, "flow_run", None) if run_context is not None else None
        return str(run.id) if run is not None else None
    except Exception:  # a Prefect without FlowRunContext: process scope
        return None


def _function_cache_enabled() -> bool:
    return settings.PAYLOAD_CACHE.value()


def forget_function(fn: Callable[..., Any] | None = None) -> None:
    """Drop the cached pickle of ``fn`` (of every function when None): its next call pickles it afresh.

    Needed only after mutating in place something the function captures or reads as a global.
    """
    with _function_lock:
        if fn is None:
            _function_cache.clear()
        else:
            _function_cache.pop(id(fn), None)


def pickled_function(fn: Callable[..., Any], project_dir: Path | None = None) -> bytes:
    """``fn`` pickled with cloudpickle (project modules by value), cached across calls; see above."""
    names = tuple(project_module_names(project_dir)) if project_dir is not None else ()
    with _pickled_by_value(names) as by_value:
        return _pickled_function(fn, project_dir, by_value)


def _pickled_function(fn: Callable[..., Any], project_dir: Path | None, by_value: frozenset[str]) -> bytes:
    what = f"function {getattr(fn, '__qualname__', fn)!r}"
    if not _function_cache_enabled():
        return _dumps(fn, what)
    context = (str(project_dir), by_value, _flow_run_scope())
    refs = _function_refs(fn, by_value)
    if refs is None:
        return _dumps(fn, what)
    with _function_lock:
        entry = _function_cache.get(id(fn))
        if (
            entry is not None
            and entry.context == context
            and len(entry.refs) == len(refs)
            and all(a is b for a, b in zip(entry.refs, refs))
        ):
            _function_cache.move_to_end(id(fn))
            return entry.data
        data = _dumps(fn, what)
        if len(data) <= _FUNCTION_CACHE_BYTES:
            _function_cache[id(fn)] = _FunctionEntry(context, refs, data)
            _function_cache.move_to_end(id(fn))
            total = sum(len(e.data) for e in _function_cache.values())
            while len(_function_cache) > _FUNCTION_CACHE_ENTRIES or total > _FUNCTION_CACHE_BYTES:
                _, dropped = _function_cache.popitem(last=False)
                total -= len(dropped.data)
        return data


def build_call_payload(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], project_dir: Path | None) -> bytes:
    """Pickle ``fn(*args, **kwargs)`` as named pieces; raise :class:`PayloadError` naming the culprit.

    The function's pickle is shared by the calls of a fan-out (see :func:`pickled_function`); the
    arguments are pickled on every call.
    """
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(f"{fn.__name__}() called with arguments that do not match its signature: {exc}") from None
    names = project_module_names(project_dir) if project_dir is not None else []
    with _pickled_by_value(names) as by_value:
        fn_bytes = _pickled_function(fn, project_dir, by_value)
        arguments = {
            name: _dumps(value, f"argument {name!r} of {fn.__name__}() (a {type(value).__qualname__})")
            for name, value in bound.arguments.items()
        }
        threshold = payload_warn_bytes()
        total = len(fn_bytes) + sum(len(blob) for blob in arguments.values())
        if threshold and total > threshold:
            try:
                _warn_large_payload(fn, fn_bytes, arguments, bound.arguments, total, threshold)
            except Warning:
                raise  # warnings turned into errors by the user's filters
            except Exception:  # naming the culprit must never fail the call
                logger.debug("could not analyse a large payload", exc_info=True)
    envelope = {
        "format": PAYLOAD_FORMAT,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "function": fn_bytes,
        "arguments": arguments,
    }
    return pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)


# ----- large payloads: one warning per function, naming what is large

PAYLOAD_WARN_BYTES = settings.PAYLOAD_WARN_BYTES.default
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class PayloadSizeWarning(UserWarning):
    """A call's payload is over KINETIC_PAYLOAD_WARN_BYTES (default 10 MiB)."""


def payload_warn_bytes() -> int:
    """The size over which a payload warns: KINETIC_PAYLOAD_WARN_BYTES (bytes; 0 turns it off)."""
    return settings.PAYLOAD_WARN_BYTES.value()


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _size_of(value: Any) -> int | None:
    """Roughly what a value adds to a pickle: its buffer size for arrays, else its own pickle's size."""
    try:
        nbytes = None if isinstance(value, type) else getattr(value, "nbytes", None)
    except Exception:
        nbytes = None
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value)
    if isinstance(value, types.ModuleType) or value is _MISSING:
        return None
    try:
        return len(cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return None


def _captured(fn: Any) -> list[tuple[str, Any]]:
    """What a function's pickle carries besides its code: closure cells, globals it reads, defaults."""
    fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else fn
    if isinstance(fn, types.MethodType):
        return [(f"the bound object (a {type(fn.__self__).__qualname__})", fn.__self__)] + _captured(fn.__func__)
    if isinstance(fn, functools.partial):
        arguments = [(f"partial argument {i}", v) for i, v in enumerate(fn.args)]
        return arguments + [(f"partial argument {k!r}", v) for k, v in fn.keywords.items()] + _captured(fn.func)
    if not isinstance(fn, types.FunctionType):
        return []
    items: list[tuple[str, Any]] = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            items.append((f"closure variable {name!r}", cell.cell_contents))
    for name in _code_names(fn.__code__):
        if name in fn.__globals__:
            items.append((f"global {name!r}", fn.__globals__[name]))
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is not inspect.Parameter.empty]
    except (TypeError, ValueError):
        params = []
    items += [(f"default of parameter {p.name!r}", p.default) for p in params]
    return items


def _warn_large_payload(
    fn: Callable[..., Any],
    fn_bytes: bytes,
    arguments: dict[str, bytes],
    values: dict[str, Any],
    total: int,
    threshold: int,
) -> None:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    key = (str(getattr(fn, "__module__", None)), name)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    parts: list[tuple[int, str]] = [
        (len(blob), f"argument {arg!r} ({type(values[arg]).__qualname__}, {_mib(len(blob))})")
        for arg, blob in arguments.items()
    ]
    if len(fn_bytes) >= total // 10:
        found = False
        for what, value in _captured(fn):
            size = _size_of(value)
            if size is not None and size >= len(fn_bytes) // 10:
                parts.append((size, f"{what} of the function ({type(value).__qualname__}, {_mib(size)})"))
                found = True
        if not found:
            parts.append((len(fn_bytes), f"the pickled function itself ({_mib(len(fn_bytes))})"))
    large = sorted((p for p in parts if p[0] >= total // 10), reverse=True)[:4] or sorted(parts, reverse=True)[:3]
    warnings.warn(
        f"kinetic-prefect: a call of {name}() ships a {_mib(total)} payload ({Env.PAYLOAD_WARN_BYTES} is "
        f"{threshold}, 0 turns this warning off): {'; '.join(d for _, d in large)}. Every call uploads it "
        "and its job downloads it. Pass large inputs as kinetic_prefect.Data('path/to/file-or-folder') "
        "(uploaded once, content-addressed, cached on the node) or load them inside the task. "
        "(Warned once per function.)",
        PayloadSizeWarning,
        stacklevel=3,
    )
