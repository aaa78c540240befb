"""Caller side: package a call (function + arguments) and the project's code for a job.

Two artifacts leave the caller:

* the **call payload**: the function and each argument pickled separately with cloudpickle,
  so an unpicklable argument is reported by name before anything is stored; the job checks
  its sha256 before unpickling a byte of it;
* the **project archive**: the project directory as a deterministic tar.gz, content-addressed
  so an unchanged project is uploaded once and extracted once per node.

Fan-outs (``.map()``) build many payloads at once, from many threads:

* the project's modules are registered for cloudpickle's pickle-by-value with reference counts
  under one lock (the registry is process-wide), so concurrent calls never unregister a module
  another call is still pickling with;
* the pickled function is shared by the calls (:func:`pickled_function`): it is reused while the
  objects it is made from are the same objects (code, defaults, closure cells, the globals it
  reads, the flow run). Rebinding a captured variable gives a fresh pickle; mutating a captured
  object in place (``weights[:] = 0``) does not: the function is a snapshot taken at its first
  call in a flow run. Pass what changes between calls as an argument, call
  :func:`forget_function`, or set ``KINETIC_PAYLOAD_CACHE=0``;
* the project archive is built once (:func:`cached_project_archive`) and rebuilt only when the
  tree's paths, sizes or mtimes change.

A payload over ``KINETIC_PAYLOAD_WARN_BYTES`` (bytes; default 10 MiB; 0: never) warns once per
function, naming the large closure variable, global or argument: large inputs belong in
``kinetic_prefect.Data``.

Secret-looking files (:data:`SECRET_PATTERNS`: ``.env``, ``*.pem``, ``id_rsa``, ``kaggle.json``...)
are left out of the archive, and a warning lists them. To ship one, un-ignore it in
``.kineticignore`` with a gitignore negation: a line ``!.env`` (or ``!certs/client.pem``).
Secret-looking Python source (``secrets.py``) is shipped, since the job may import it, with a
warning.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import inspect
import io
import logging
import os
import pickle
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import cloudpickle
import pathspec

from kinetic_prefect.contract import PAYLOAD_FORMAT, Env, code_key
from kinetic_prefect.errors import PayloadError

logger = logging.getLogger("kinetic_prefect.payload")


# Never shipped, whatever the ignore files say: VCS data, environments and caches.
ALWAYS_IGNORED = [
    ".git/",
    ".hg/",
    ".venv/",
    "venv/",
    "__pycache__/",
    "*.pyc",
    "node_modules/",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".ipynb_checkpoints/",
    ".tox/",
    ".DS_Store",
]
SECRET_PATTERNS = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "id_rsa*",
    "id_ed25519*",
    ".netrc",
    "kaggle.json",
    "*credentials*.json",
    "service-account*.json",
    "*secret*",
]
LARGE_TREE_BYTES = 100 * 2**20
LARGE_TREE_FILES = 10_000
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- the call payload


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
    names: set[str] = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or not isinstance(file, str) or name == "__main__" or name.split(".")[0] == "kinetic_prefect":
            continue
        if getattr(module, "__name__", None) != name:  # an alias (__mp_main__ -> __main__)
            continue
        if _is_project_file(file, project_dir):
            names.add(name.split(".")[0])
    return sorted(
        n for n in names if n in sys.modules and getattr(sys.modules[n], "__name__", None) == n and n != "__main__"
    )


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
    return os.environ.get(Env.PAYLOAD_CACHE, "1").strip().lower() not in ("0", "false", "no", "off")


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

PAYLOAD_WARN_BYTES = 10 * 2**20
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class PayloadSizeWarning(UserWarning):
    """A call's payload is over KINETIC_PAYLOAD_WARN_BYTES (default 10 MiB)."""


def payload_warn_bytes() -> int:
    """The size over which a payload warns: KINETIC_PAYLOAD_WARN_BYTES (bytes; 0 turns it off)."""
    raw = os.environ.get(Env.PAYLOAD_WARN_BYTES, "").strip().replace("_", "")
    if not raw:
        return PAYLOAD_WARN_BYTES
    try:
        return max(int(raw), 0)
    except ValueError:
        logger.warning(f"{Env.PAYLOAD_WARN_BYTES}={raw!r} is not a number of bytes; using {PAYLOAD_WARN_BYTES}")
        return PAYLOAD_WARN_BYTES


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
        try:
            items.append((f"closure variable {name!r}", cell.cell_contents))
        except ValueError:
            pass
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


# --------------------------------------------------------------------------- the project archive


def find_project_dir(fn: Callable[..., Any]) -> Path:
    """The nearest ancestor of the function's file that looks like a project root."""
    try:
        source = Path(inspect.getfile(inspect.unwrap(fn))).resolve()
    except (TypeError, OSError):
        return Path.cwd().resolve()
    if not source.exists():  # defined in a REPL / notebook cell
        return Path.cwd().resolve()
    for parent in source.parents:
        if any((parent / marker).exists() for marker in PROJECT_MARKERS):
            return parent
    return source.parent


def _ignore_lines(root: Path, name: str) -> list[str]:
    file = root / name
    return file.read_text().splitlines() if file.is_file() else []


def _ignore_spec(root: Path) -> pathspec.PathSpec:
    lines = list(ALWAYS_IGNORED) + _ignore_lines(root, ".gitignore") + _ignore_lines(root, ".kineticignore")
    return pathspec.GitIgnoreSpec.from_lines(lines)


_SECRET_SPEC = pathspec.GitIgnoreSpec.from_lines(SECRET_PATTERNS)
SOURCE_SUFFIXES = (".py", ".pyi")


def _git_candidates(root: Path) -> list[str] | None:
    """Files git would keep (tracked + untracked-not-ignored, nested .gitignores honoured)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in out.decode().split("\0") if p]


@dataclass(frozen=True)
class _Selection:
    files: list[str]  # shipped
    secrets: list[str]  # secret-looking, left out
    secret_code: list[str]  # secret-looking Python source: shipped (the job may import it), warned about


def _select_project_files(root: Path, exclude: Iterable[Path] = ()) -> _Selection:
    root = root.resolve()
    spec = _ignore_spec(root)
    # SECRET_PATTERNS then .kineticignore: a "!pattern" line there opts a secret-looking file back in
    secret_spec = pathspec.GitIgnoreSpec.from_lines(SECRET_PATTERNS + _ignore_lines(root, ".kineticignore"))
    excluded = [Path(p).resolve() for p in exclude]
    candidates = _git_candidates(root)
    if candidates is None:
        candidates = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(d for d in dirnames if not spec.match_file(rel_dir + d + "/"))
            candidates.extend(rel_dir + f for f in filenames)
    files, secrets, secret_code = [], [], []
    for rel in sorted(set(candidates)):
        if spec.match_file(rel):
            continue
        path = root / rel
        if not path.is_file() or any(path.resolve().is_relative_to(e) for e in excluded):
            continue
        if _SECRET_SPEC.match_file(rel):
            if rel.endswith(SOURCE_SUFFIXES):
                secret_code.append(rel)
            elif secret_spec.match_file(rel):
                secrets.append(rel)
                continue
        files.append(rel)
    return _Selection(files, secrets, secret_code)


def collect_project_files(root: Path, exclude: Iterable[Path] = ()) -> list[str]:
    """Relative paths to ship: git's view where available, then .gitignore/.kineticignore rules,
    without secret-looking files (SECRET_PATTERNS) unless a ``!pattern`` line of .kineticignore opts them in."""
    return _select_project_files(root, exclude).files


def _shown(paths: list[str], limit: int = 20) -> str:
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _warn_about(root: Path, selection: _Selection, total: int) -> None:
    files = selection.files
    if selection.secrets:
        example = selection.secrets[0]
        warnings.warn(
            f"kinetic-prefect: left out of the project archive {len(selection.secrets)} secret-looking "
            f"file(s) of {root}: {_shown(selection.secrets)}. The job will not see them; pass credentials "
            "through the environment or a secret store. To ship one anyway, add a line such as "
            f"'!{example}' to {root / '.kineticignore'}.",
            stacklevel=4,
        )
    if selection.secret_code:
        warnings.warn(
            f"kinetic-prefect: shipping secret-looking source files of {root} (code the job may import): "
            f"{_shown(selection.secret_code)}. If they hold credentials, move these out of the code or list "
            f"them in {root / '.kineticignore'}.",
            stacklevel=4,
        )
    if total > LARGE_TREE_BYTES or len(files) > LARGE_TREE_FILES:
        warnings.warn(
            f"kinetic-prefect: shipping {len(files)} files ({total / 2**20:.0f} MiB) from {root}. "
            "Pass datasets as kinetic_prefect.Data and list bulky folders in .kineticignore.",
            stacklevel=4,
        )


@dataclass(frozen=True)
class ProjectArchive:
    root: Path
    sha256: str
    data: bytes
    files: int

    @property
    def key(self) -> str:
        return code_key(self.sha256)


_archive_memo: dict[tuple, ProjectArchive] = {}


def _file_stats(root: Path, files: list[str]) -> list[tuple[str, int, int, int]]:
    stats = []
    for rel in files:
        st = (root / rel).stat()
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_mode & 0o111))
    return stats


def _tar_gz(root: Path, stats: list[tuple[str, int, int, int]]) -> ProjectArchive:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, size, _mtime, exec_bits in stats:
            info = tarfile.TarInfo(rel)
            info.size = size
            info.mode = 0o755 if exec_bits else 0o644
            info.mtime = 0  # determinism: the hash depends on content only
            with open(root / rel, "rb") as fh:
                tar.addfile(info, fh)
    data = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    return ProjectArchive(root=root, sha256=sha256_hex(data), data=data, files=len(stats))


def archive_project(root: Path, exclude: Iterable[Path] = ()) -> ProjectArchive:
    """A deterministic tar.gz of the project (same files and bytes → same sha256), memoized by file stats.

    Lists the project (``git ls-files``) on every call; a fan-out calls :func:`cached_project_archive`.
    """
    root = root.resolve()
    selection = _select_project_files(root, exclude)
    stats = _file_stats(root, selection.files)
    signature = (str(root), tuple(stats))
    cached = _archive_memo.get(signature)
    if cached is not None:
        return cached
    _warn_about(root, selection, sum(s[1] for s in stats))
    archive = _tar_gz(root, stats)
    _archive_memo.clear()  # one project per process in practice; keep memory bounded
    _archive_memo[signature] = archive
    return archive


# ----- the archive, shared by every call of a fan-out
#
# cached_project_archive() skips listing (git ls-files, ignore rules) and tarring when a cheap
# signature of the tree is unchanged: the path, size, mtime and exec bit of every file under the
# root (not descending into ALWAYS_IGNORED folders, folders the root's ignore files exclude, nor
# the excluded Data paths) and the stats of .git/index and .git/info/exclude. A file whose mtime
# is within _RACY_NS of the build could have been rewritten with the same size and mtime tick
# after it was read (as git's "racily clean" entries): such an archive is rebuilt at its next use.

_archive_cache: OrderedDict[tuple, tuple[tuple, int, ProjectArchive]] = OrderedDict()
_archive_lock = threading.Lock()  # one build at a time: a fan-out's calls wait for the first one's
_ARCHIVE_CACHE_ENTRIES = 4
_RACY_NS = 2 * 10**9
_ALWAYS_SPEC = pathspec.GitIgnoreSpec.from_lines(ALWAYS_IGNORED)


_ignored_memo: dict[str, tuple[tuple, bool, Callable[[str], bool]]] = {}


def _ignored_matcher(root: Path) -> tuple[bool, Callable[[str], bool]]:
    """(whether ignored folders may be skipped, a memoized "is this path ignored" test) for the root.

    Matching every path against the ignore rules is most of a signature's cost: the answers are
    kept while .gitignore and .kineticignore keep their stats.
    """
    stats: list[tuple[int, int, int] | None] = []
    for name in (".gitignore", ".kineticignore"):
        try:
            st = (root / name).stat()
            stats.append((st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            stats.append(None)
    key = tuple(stats)
    cached = _ignored_memo.get(str(root))
    if cached is None or cached[0] != key or any(s is not None and s[1] >= time.time_ns() - _RACY_NS for s in stats):
        spec = _ignore_spec(root)
        # a negation (!pattern) may re-include a file under an ignored folder: then walk everything
        prune = not any(getattr(p, "include", None) is False for p in spec.patterns)
        answers: dict[str, bool] = {}

        def ignored(rel: str, spec: pathspec.PathSpec = spec, answers: dict[str, bool] = answers) -> bool:
            answer = answers.get(rel)
            if answer is None:
                answer = answers[rel] = spec.match_file(rel)  # the spec includes ALWAYS_IGNORED
            return answer

        cached = (key, prune, ignored)
        if len(_ignored_memo) > 16:
            _ignored_memo.clear()
        _ignored_memo[str(root)] = cached
    return cached[1], cached[2]


def _tree_signature(root: Path, excluded: tuple[str, ...]) -> tuple:
    prune, ignored = _ignored_matcher(root)
    entries: list[tuple] = []
    for name in (".git/index", ".git/info/exclude"):
        try:
            st = (root / name).stat()
            entries.append((name, st.st_size, st.st_mtime_ns, 0))
        except OSError:
            pass
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            iterator = os.scandir(root / rel_dir if rel_dir else root)
        except OSError:
            continue
        with iterator:
            for entry in iterator:
                rel = rel_dir + entry.name
                if rel in excluded:
                    continue
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if is_dir:
                    if prune and ignored(rel + "/") or not prune and _ALWAYS_SPEC.match_file(rel + "/"):
                        continue
                    stack.append(rel + "/")
                    continue
                if prune and ignored(rel):
                    continue
                try:
                    st = entry.stat()
                    entries.append((rel, st.st_size, st.st_mtime_ns, st.st_mode & 0o111))
                except OSError:
                    entries.append((rel, -1, 0, 0))
    entries.sort()
    return tuple(entries)


def cached_project_archive(project_dir: Path, exclude: Iterable[Path] = ()) -> ProjectArchive:
    """:func:`archive_project`, built once and reused while the project tree is unchanged.

    Thread-safe: the calls of a fan-out share one archive object (and one build); a changed,
    added or removed file gives a new archive. Excluded paths (Data folders) are part of the key.
    """
    root = Path(project_dir).resolve()
    exclude = [Path(p).resolve() for p in exclude]
    excluded = tuple(sorted(os.path.relpath(p, root) for p in exclude if p.is_relative_to(root) and p != root))
    key = (str(root), excluded)
    with _archive_lock:
        now = time.time_ns()  # before anything is read: a later write has a later mtime (± a clock tick)
        signature = _tree_signature(root, excluded)
        cached = _archive_cache.get(key)
        if cached is not None and cached[0] == signature:
            if all(entry[2] < cached[1] - _RACY_NS for entry in signature):
                _archive_cache.move_to_end(key)
                return cached[2]
        selection = _select_project_files(root, exclude)
        stats = _file_stats(root, selection.files)
        _warn_about(root, selection, sum(s[1] for s in stats))
        archive = _tar_gz(root, stats)
        if cached is not None and cached[2].sha256 == archive.sha256:
            archive = cached[2]  # unchanged content: keep handing out the same object
        # the signature taken before reading: a file changed since makes the next call rebuild
        _archive_cache[key] = (signature, now, archive)
        _archive_cache.move_to_end(key)
        while len(_archive_cache) > _ARCHIVE_CACHE_ENTRIES:
            _archive_cache.popitem(last=False)
        return archive
