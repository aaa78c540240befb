"""A garbage collection that imports a module, to test code that reads ``sys.modules`` while it changes.

A C-level walk of ``sys.modules`` (``list(sys.modules.items())``, ``tuple(sys.modules)``) allocates as it goes; an
allocation can start a collection, and a collection runs Python code (finalizers, weakref callbacks,
``gc.callbacks``) that may import a module itself or let the GIL go to a thread that imports one. The walk then
fails with "RuntimeError: dictionary changed size during iteration". Under this context manager every allocation of
a tracked object starts a collection, and each collection (up to ``limit``) imports a fresh module: the
interleaving a loaded process meets now and then, made certain.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def imports_during_collections(folder: Path, limit: int = 100) -> Iterator[list[str]]:
    """Yield the names imported so far; the modules are written to ``folder``, which goes on ``sys.path``."""
    imported: list[str] = []

    def import_one(phase: str, info: dict) -> None:
        if phase == "start" and len(imported) < limit:
            name = f"collected_{folder.name}_{len(imported)}".replace("-", "_")
            (folder / f"{name}.py").write_text("X = 1\n")
            imported.append(name)
            importlib.import_module(name)

    sys.path.insert(0, str(folder))
    threshold = gc.get_threshold()
    # Pairs come from CPython's free list before they cost an allocation: hold enough of them that a walk's own
    # pairs are allocated (and can start a collection), as they are in a process that has been running a while.
    held_pairs = [(i, -i) for i in range(len(sys.modules) + 4000)]
    gc.callbacks.append(import_one)
    gc.set_threshold(1)
    try:
        yield imported
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(import_one)
        del held_pairs
        sys.path.remove(str(folder))
        for name in imported:
            sys.modules.pop(name, None)
