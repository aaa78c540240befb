"""Caller side: package a call (function + arguments) and the project's code for a job.

Two artifacts leave the caller:

* the **call payload**: the function and each argument pickled separately with cloudpickle,
  so an unpicklable argument is reported by name before anything is stored; the job checks
  its sha256 before unpickling a byte of it;
* the **project archive**: the project directory as a deterministic tar.gz, content-addressed
  so an unchanged project is uploaded once and extracted once per node.
"""

from __future__ import annotations

import fnmatch
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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import cloudpickle
import pathspec

from kinetic_prefect.errors import PayloadError

logger = logging.getLogger("kinetic_prefect.payload")

PAYLOAD_FORMAT = 1

# Never shipped, whatever the ignore files say: VCS data, environments and caches.
ALWAYS_IGNORED = [
    ".git/", ".hg/", ".venv/", "venv/", "__pycache__/", "*.pyc", "node_modules/", ".pytest_cache/",
    ".mypy_cache/", ".ruff_cache/", ".ipynb_checkpoints/", ".tox/", ".DS_Store",
]
SECRET_PATTERNS = [
    ".env", ".env.*", "*.pem", "*.key", "*.p12", "id_rsa*", "id_ed25519*", ".netrc", "kaggle.json",
    "*credentials*.json", "service-account*.json", "*secret*",
]
LARGE_TREE_BYTES = 100 * 2**20
LARGE_TREE_FILES = 10_000
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- the call payload


def _library_roots() -> list[Path]:
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return [Path(p).resolve() for p in paths if p]


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def project_module_names(project_dir: Path) -> list[str]:
    """Top-level modules imported from the project directory (the user's own code).

    They are pickled by value so the job needs neither the caller's sys.path nor the module
    attribute lookup (a decorated function's module attribute is the Task, not the function).
    """
    libs = _library_roots()
    names: set[str] = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name == "__main__" or name.split(".")[0] == "kinetic_prefect":
            continue
        path = Path(file).resolve()
        if _is_under(path, project_dir) and not any(_is_under(path, lib) for lib in libs):
            if "site-packages" not in path.parts:
                names.add(name.split(".")[0])
    return sorted(n for n in names if n in sys.modules)


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling raises many types: TypeError, PicklingError, AttributeError...
        raise PayloadError(
            f"{what} cannot be pickled: {type(exc).__name__}: {exc}. Pass a value that pickles "
            "(plain data, arrays, a file path or kinetic_prefect.Data), or create the object inside the task."
        ) from exc


def build_call_payload(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], project_dir: Path | None) -> bytes:
    """Pickle ``fn(*args, **kwargs)`` as named pieces; raise :class:`PayloadError` naming the culprit."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(f"{fn.__name__}() called with arguments that do not match its signature: {exc}") from None
    registered = []
    if project_dir is not None:
        for name in project_module_names(project_dir):
            module = sys.modules[name]
            if name not in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
    try:
        fn_bytes = _dumps(fn, f"function {fn.__qualname__!r}")
        arguments = {
            name: _dumps(value, f"argument {name!r} of {fn.__name__}() (a {type(value).__qualname__})")
            for name, value in bound.arguments.items()
        }
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)
    envelope = {
        "format": PAYLOAD_FORMAT,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "function": fn_bytes,
        "arguments": arguments,
    }
    return pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)


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


def _ignore_spec(root: Path) -> pathspec.PathSpec:
    lines = list(ALWAYS_IGNORED)
    for name in (".gitignore", ".kineticignore"):
        file = root / name
        if file.is_file():
            lines.extend(file.read_text().splitlines())
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _git_candidates(root: Path) -> list[str] | None:
    """Files git would keep (tracked + untracked-not-ignored, nested .gitignores honoured)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, check=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in out.decode().split("\0") if p]


def collect_project_files(root: Path, exclude: Iterable[Path] = ()) -> list[str]:
    """Relative paths to ship: git's view where available, then .gitignore/.kineticignore rules."""
    root = root.resolve()
    spec = _ignore_spec(root)
    excluded = [Path(p).resolve() for p in exclude]
    candidates = _git_candidates(root)
    if candidates is None:
        candidates = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(d for d in dirnames if not spec.match_file(rel_dir + d + "/"))
            candidates.extend(rel_dir + f for f in filenames)
    files = []
    for rel in sorted(set(candidates)):
        if spec.match_file(rel):
            continue
        path = root / rel
        if not path.is_file() or any(_is_under(path.resolve(), e) for e in excluded):
            continue
        files.append(rel)
    return files


def _warn_about(root: Path, files: list[str], total: int) -> None:
    secrets = [f for f in files if any(fnmatch.fnmatch(Path(f).name, p) for p in SECRET_PATTERNS)]
    if secrets:
        shown = ", ".join(secrets[:5]) + (" ..." if len(secrets) > 5 else "")
        warnings.warn(
            f"kinetic-prefect: the project directory {root} contains secret-looking files that would be "
            f"shipped with the job: {shown}. Add them to {root / '.kineticignore'} to keep them local.",
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
        return f"code/{self.sha256}.tar.gz"


_archive_memo: dict[tuple, ProjectArchive] = {}


def archive_project(root: Path, exclude: Iterable[Path] = ()) -> ProjectArchive:
    """A deterministic tar.gz of the project (same files and bytes → same sha256), memoized by file stats."""
    root = root.resolve()
    files = collect_project_files(root, exclude)
    stats = []
    for rel in files:
        st = (root / rel).stat()
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_mode & 0o111))
    signature = (str(root), tuple(stats))
    cached = _archive_memo.get(signature)
    if cached is not None:
        return cached
    _warn_about(root, files, sum(s[1] for s in stats))
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
    archive = ProjectArchive(root=root, sha256=sha256_hex(data), data=data, files=len(files))
    _archive_memo.clear()  # one project per process in practice; keep memory bounded
    _archive_memo[signature] = archive
    return archive
