"""Code that runs when the main thread ends, before the interpreter shuts down the thread pools of
concurrent.futures and Prefect's event and log senders.

Python has no public door for this moment: ``atexit`` hooks run after those pools are gone, when no thread can be
started ("cannot schedule new futures after interpreter shutdown"). CPython's ``threading`` module keeps the hooks
that run before them (``threading._register_atexit``, what concurrent.futures itself uses: last-registered first)
and a flag that refuses new ones once the interpreter is ending. This module is the one place the package touches
them; the callers (a sweep's slots closing, a detached job's or a batch's thread being waited for) use its names.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


def run_before_pools_shut_down(hook: Callable[[], Any]) -> None:
    """Run ``hook`` when the main thread ends, before the thread pools and Prefect's senders shut down (hooks
    registered later run earlier). On a Python without threading's exit hooks, ``atexit`` runs it instead.

    Raises RuntimeError once the interpreter is ending (no hook can be added any more)."""
    register = getattr(threading, "_register_atexit", None)  # CPython's; absent on other Pythons
    if register is None:
        atexit.register(hook)
        return
    register(hook)


@contextlib.contextmanager
def as_if_running() -> Iterator[None]:
    """While the interpreter waits for a thread at exit, that thread runs as it would while the main thread lived.

    Python marks itself as shutting down before it calls threading's exit hooks, and from then on no thread can
    register one: each of Prefect's services (a tag's concurrency slots, a new client's senders) fails to start
    ("can't register atexit after shutdown"). The flag is lowered for the wait, and the hooks registered meanwhile
    run after it, as the interpreter would have run them."""
    shutting_down = getattr(threading, "_SHUTTING_DOWN", False)
    hooks: list[Any] = getattr(threading, "_threading_atexits", [])
    before = len(hooks)
    _set_shutting_down(False)
    try:
        yield
    finally:
        _set_shutting_down(shutting_down)
        if shutting_down:  # the interpreter's loop over its hooks has passed the point where these were added
            added = hooks[before:]
            del hooks[before:]
            for hook in reversed(added):
                with contextlib.suppress(Exception):
                    hook()


def _set_shutting_down(value: bool) -> None:
    if hasattr(threading, "_SHUTTING_DOWN"):  # CPython's flag; another Python has none to lower
        threading._SHUTTING_DOWN = value  # noqa: SLF001 - CPython's flag, no public setter


__all__ = ["as_if_running", "run_before_pools_shut_down"]
