"""A job's private working copy of the project: its cwd and the first entry of ``sys.path``.

A cold job copies the node's shared project copy (content-addressed, never written to) into a folder of its own and
removes it at the end. A process that runs call after call (a warm runner, a warm pod, a sweep's slot) keeps its copy
instead, and before each later call puts it back exactly as shipped: files the last call added are removed, files it
changed, removed or re-moded are copied again, found by ``lstat`` against the shipped copy (size, mtime, mode, link
target). Copying the whole tree anew per input was three quarters of a slot's time per no-op input (358 files,
5.8 MB here); the comparison reads the metadata of the same files and copies only what differs. ``__pycache__``
folders are left in place: Python checks them against their source's size and mtime itself.

A write that keeps a file's size and mtime (an ``os.utime`` back to the shipped time) is not seen; nothing else is
missed.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

_SKIPPED = frozenset({".kinetic-complete", "__pycache__"})

# What a listing holds per relative path: ("d",), ("l", target) or ("f", size, mtime_ns, mode).
Listing = dict[str, tuple[object, ...]]

_reuse = False  # set by the processes that run call after call
_kept: dict[str, tuple[Path, Listing]] = {}  # shipped copy -> (this process's working copy, the shipped listing)


def reuse_between_calls() -> None:
    """This process runs calls one after another: keep the working copy and restore it before each later call."""
    global _reuse
    if not _reuse:
        atexit.register(remove_kept)
    _reuse = True


def _listing(root: Path) -> Listing:
    entries: Listing = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(root / rel_dir if rel_dir else root) as iterator:
            for entry in iterator:
                if entry.name in _SKIPPED:
                    continue
                rel = rel_dir + entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    entries[rel] = ("l", os.readlink(entry.path))
                elif stat.S_ISDIR(st.st_mode):
                    entries[rel] = ("d",)
                    stack.append(rel + "/")
                else:
                    entries[rel] = ("f", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
    return entries


def _remove(path: Path, kind: str) -> None:
    if kind == "d":
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _restore(shipped: Path, work: Path, wanted: Listing) -> None:
    """``work`` made equal to ``shipped`` (whose listing is ``wanted``) by removing and copying only what differs."""
    found = _listing(work)
    for rel in sorted(found, reverse=True):  # children before their folders
        if rel not in wanted or found[rel][0] != wanted[rel][0]:
            if (work / rel).parent.exists():
                _remove(work / rel, str(found[rel][0]))
            found.pop(rel)
    for rel in sorted(wanted):  # folders before their children
        entry = wanted[rel]
        if found.get(rel) == entry:
            continue
        target = work / rel
        if entry[0] == "d":
            target.mkdir(exist_ok=True)
        elif entry[0] == "l":
            target.unlink(missing_ok=True)
            target.symlink_to(str(entry[1]))
        else:
            target.unlink(missing_ok=True)
            shutil.copy2(shipped / rel, target, follow_symlinks=False)


def _fresh_copy(shipped: Path, scratch: Path | None) -> Path:
    work = Path(tempfile.mkdtemp(prefix="kinetic-work-", dir=scratch))
    shutil.copytree(shipped, work, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(*_SKIPPED))
    return work


def working_copy(shipped: Path, scratch: Path | None) -> Path:
    """The copy of ``shipped`` this call runs in, made in ``scratch`` (None: TMPDIR); restored from the last call's
    when this process keeps it."""
    if not _reuse:
        return _fresh_copy(shipped, scratch)
    kept = _kept.get(str(shipped))
    if kept is not None and kept[0].is_dir():
        _restore(shipped, kept[0], kept[1])
        importlib.invalidate_caches()  # the finders' cached folder listings may predate what was just removed
        return kept[0]
    work = _fresh_copy(shipped, scratch)
    _kept[str(shipped)] = (work, _listing(shipped))
    return work


def release(work: Path) -> None:
    """The call is over: its copy is removed, unless this process keeps it for the next call."""
    if _reuse and any(kept[0] == work for kept in _kept.values()):
        return
    shutil.rmtree(work, ignore_errors=True)


def remove_kept() -> None:
    """The process is leaving: the copies it kept are removed."""
    for work, _ in _kept.values():
        shutil.rmtree(work, ignore_errors=True)
    _kept.clear()
