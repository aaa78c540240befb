"""Caller side: the project archive, the project's code as a job receives it.

The project directory is packed as a deterministic tar.gz, content-addressed so an unchanged project is
uploaded once and extracted once per node. The files in it are git's view of the project where there is a
repository (tracked and untracked-not-ignored), then the ``.gitignore`` and ``.kineticignore`` rules; never
:data:`ALWAYS_IGNORED` (VCS data, environments, caches).

The calls of a fan-out (``.map()``) share one archive: :func:`cached_project_archive` builds it once and
rebuilds it only when the tree's paths, sizes or mtimes change.

Secret-looking files (:data:`SECRET_PATTERNS`: ``.env``, ``*.pem``, ``id_rsa``, ``kaggle.json``...)
are left out of the archive, and a warning lists them. To ship one, un-ignore it in
``.kineticignore`` with a gitignore negation: a line ``!.env`` (or ``!certs/client.pem``).
Secret-looking Python source (``secrets.py``) is shipped, since the job may import it, with a
warning.

Nothing of Kinetic's or Prefect's own is ever shipped, whoever put it in the project and whatever the ignore files
say (:func:`own_state_paths`, :data:`NEVER_SHIPPED`, and any folder laid out as a Kinetic store): Prefect's home
(its database holds the key that decrypts every Secret block), its database file wherever its URL puts it, its
profiles and results, Kinetic's cache and every local store (one in the project would ship itself, earlier archives
included, with every call).

A symbolic link whose target is outside the project is left out, and a warning names it: the archive is what the
project holds, never what a committed link reaches on this machine (``key -> ~/.ssh/id_rsa``). A stray link must not
stop every call, so it is skipped (as secret-looking files are), not refused. Links inside the project ship their
target's content as today.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import inspect
import io
import os
import re
import subprocess
import tarfile
import threading
import time
import urllib.parse
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pathspec

from kinetic_prefect import config
from kinetic_prefect.contract import Env, RunLayout, code_key, data_key, data_manifest_key

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
# Never shipped, and no ignore file's "!pattern" brings them back: Prefect's home by its usual name, its database.
NEVER_SHIPPED = [".prefect/", "prefect.db", "prefect.db-*"]
LARGE_TREE_BYTES = 100 * 2**20
LARGE_TREE_FILES = 10_000
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def find_project_dir(fn: Callable[..., Any]) -> Path:
    """The nearest ancestor of the function's file that looks like a project root."""
    try:
        file = inspect.getfile(inspect.unwrap(fn))
    except (TypeError, OSError):
        return Path.cwd().resolve()
    found = _project_dir_of(file)
    return found if found is not None else Path.cwd().resolve()


@functools.lru_cache(maxsize=1024)
def _project_dir_of(file: str) -> Path | None:
    """The project root of a source file, looked for once per process and file (every call of a fan-out asks);
    None for a function defined in a REPL or notebook cell."""
    source = Path(file).resolve()
    if not source.exists():
        return None
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
_NEVER_SPEC = pathspec.GitIgnoreSpec.from_lines(NEVER_SHIPPED)


@functools.lru_cache(maxsize=65536)
def _never(rel: str) -> bool:
    """Prefect's own state by its name (``rel`` a file, or a folder ending in ``/``): never shipped."""
    return _NEVER_SPEC.match_file(rel)


def _store_object_pattern() -> re.Pattern[str]:
    """A path of an object only a Kinetic store holds (a code archive, a data manifest, a run's payload, result or
    outcome under its UUID, or the signature beside one), the folder above it captured: that folder is a store.
    Content hashes and UUIDs keep a project's own ``runs/exp1/result.pkl`` from reading as one."""
    sha, run = "0" * 64, "RUNID"
    layout = RunLayout(run)
    objects = [code_key(sha), data_manifest_key(data_key(sha)), layout.payload, layout.result, layout.outcome]
    uuid = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(?:-[0-9]+)?"  # a batch input: -<attempt>
    alternatives = "|".join(re.escape(key).replace(sha, "[0-9a-f]{64}").replace(run, uuid) for key in objects)
    return re.compile(rf"(?P<store>(?:[^/]+/)*?)(?:{alternatives})(?:\.sig)?")


_STORE_OBJECT = _store_object_pattern()
_warned_stores: set[str] = set()
_found_stores: dict[str, set[str]] = {}  # project root -> its folders found to be stores (relative, with "/")


def _stores_among(root: Path, candidates: list[str]) -> tuple[str, ...]:
    """The folders of the project laid out as a Kinetic store (whoever named it: ``KINETIC_STORE``, a pool's
    ``store``, an earlier run's), each as a relative path ending in ``/``; a store at the project's root gives its
    top folders. Each is named once per process in a warning."""
    found: set[str] = set()
    for rel in candidates:
        match = _STORE_OBJECT.fullmatch(rel)
        if match is not None:
            store = match["store"]
            found.add(store if store else rel.split("/", 1)[0] + "/")
    for store in sorted(found):
        if str(root / store) in _warned_stores:
            continue
        _warned_stores.add(str(root / store))
        warnings.warn(
            f"kinetic-prefect: left out of the project archive {root / store}: it holds a Kinetic store (code "
            "archives, payloads, results), which is never shipped. Move the store out of the project (the pool's "
            f"`store`, or {Env.STORE}) so calls need not walk it.",
            stacklevel=5,
        )
    if found:
        _found_stores.setdefault(str(root), set()).update(found)
    return tuple(sorted(found))


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
    outside: list[str]  # "link -> target" of the links out of the project: left out, warned about


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
            dirnames[:] = sorted(
                d for d in dirnames if not spec.match_file(rel_dir + d + "/") and not _never(rel_dir + d + "/")
            )
            candidates.extend(rel_dir + f for f in filenames)
    candidates = sorted(set(candidates))
    stores = _stores_among(root, candidates)
    files, secrets, secret_code, outside = [], [], [], []
    for rel in candidates:
        if spec.match_file(rel) or _never(rel) or rel.startswith(stores):
            continue
        path = root / rel
        real = path.resolve()
        if any(real.is_relative_to(e) for e in excluded):
            continue
        if not real.is_relative_to(root):  # a link out of the project: its target is not the project's
            if path.exists():
                outside.append(f"{rel} -> {real}")
            continue
        if not path.is_file():
            continue
        if _SECRET_SPEC.match_file(rel):
            if rel.endswith(SOURCE_SUFFIXES):
                secret_code.append(rel)
            elif secret_spec.match_file(rel):
                secrets.append(rel)
                continue
        files.append(rel)
    return _Selection(files, secrets, secret_code, outside)


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
    if selection.outside:
        warnings.warn(
            f"kinetic-prefect: left out of the project archive {len(selection.outside)} symbolic link(s) of {root} "
            f"pointing outside the project: {_shown(selection.outside)}. The job will not see them: copy what it "
            "needs into the project, or pass a dataset as kinetic_prefect.Data(path).",
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
        try:
            st = (root / rel).stat()
        except FileNotFoundError:  # removed since it was listed (an editor's temporary file): not in the project
            continue
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
            try:
                with open(root / rel, "rb") as fh:
                    tar.addfile(info, fh)
            except FileNotFoundError:  # removed since its stat: the archive is the tree as it is now
                continue
    data = gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)
    return ProjectArchive(root=root, sha256=sha256_hex(data), data=data, files=len(stats))


def own_state_paths(root: Path) -> list[Path]:
    """Kinetic's and Prefect's own files and folders, never shipped wherever they are: Kinetic's cache directory
    (environments, job folders, warm runners) and local store (in the project it would ship itself, earlier
    archives included, with every call); Prefect's home, its database file and journals wherever its URL puts
    them (the database holds the Fernet key of every Secret block, the signing key's included), its profiles (API
    keys) and its local results. Relative settings are read against the working directory, as Prefect reads them.
    Only those inside the project ``root`` count: a Prefect home the project is in (``PREFECT_HOME=~``) is not the
    whole project."""
    paths = [config.cache_dir()]
    store = config.default_store_url()
    if store.startswith("file://"):
        paths.append(Path(urllib.parse.unquote(urllib.parse.urlsplit(store).path)))
    elif "://" not in store:
        paths.append(Path(store))
    paths.extend(_prefect_state_paths())
    resolved = [path.expanduser().resolve() for path in paths]
    return [path for path in resolved if path.is_relative_to(root) and path != root]


def _prefect_state_paths() -> list[Path]:
    try:
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        paths = [Path(settings.home), Path(settings.profiles_path), Path(settings.results.local_storage_path)]
        url = settings.server.database.connection_url
        database = _sqlite_file(url.get_secret_value() if url is not None else "")
    except Exception:  # no Prefect settings to read: nothing of Prefect's to leave out
        return []
    if database is not None:
        paths.extend(Path(f"{database}{suffix}") for suffix in ("", "-wal", "-shm", "-journal"))
    return paths


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (``sqlite+aiosqlite:///relative.db``, ``sqlite:////absolute.db``); None otherwise."""
    scheme, sep, rest = url.partition(":///")
    path = urllib.parse.unquote(rest.split("?", 1)[0])
    if not sep or not scheme.startswith("sqlite") or not path or path == ":memory:":
        return None
    return Path(path)


def archive_project(root: Path, exclude: Iterable[Path] = ()) -> ProjectArchive:
    """A deterministic tar.gz of the project (same files and bytes → same sha256), memoized by file stats.

    Lists the project (``git ls-files``) on every call; a fan-out calls :func:`cached_project_archive`.
    """
    root = root.resolve()
    selection = _select_project_files(root, [*exclude, *own_state_paths(root)])
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
# (root, excluded) -> (when the last look at the tree began, monotonic ns; the archive it gave)
_archive_looked: dict[tuple, tuple[int, ProjectArchive]] = {}
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
                    if _never(rel + "/"):
                        continue
                    stack.append(rel + "/")
                    continue
                if prune and ignored(rel) or _never(rel):
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
    A call that waited for the lock takes the answer of a look at the tree that began after it arrived (as fresh
    as a look of its own): a burst of a fan-out's calls walks the tree twice, not once per call.
    """
    arrived = time.monotonic_ns()
    root = Path(project_dir).resolve()
    exclude = [Path(p).resolve() for p in (*exclude, *own_state_paths(root))]
    exclude.extend(root / store for store in sorted(_found_stores.get(str(root), ())))  # not walked again
    excluded = tuple(sorted({os.path.relpath(p, root) for p in exclude if p.is_relative_to(root) and p != root}))
    key = (str(root), excluded)
    with _archive_lock:
        looked = _archive_looked.get(key)
        if looked is not None and looked[0] >= arrived:
            return looked[1]
        began = time.monotonic_ns()
        archive = _current_archive(root, exclude, excluded, key)
        _archive_looked[key] = (began, archive)
        while len(_archive_looked) > _ARCHIVE_CACHE_ENTRIES:
            _archive_looked.pop(next(iter(_archive_looked)))
        return archive


def _current_archive(root: Path, exclude: list[Path], excluded: tuple[str, ...], key: tuple) -> ProjectArchive:
    """The archive of the tree as it is now: the cached one while the tree's signature has not changed (called
    under ``_archive_lock``)."""
    now = time.time_ns()  # before anything is read: a later write has a later mtime (± a clock tick)
    signature = _tree_signature(root, excluded)
    cached = _archive_cache.get(key)
    if cached is not None and cached[0] == signature and all(entry[2] < cached[1] - _RACY_NS for entry in signature):
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
