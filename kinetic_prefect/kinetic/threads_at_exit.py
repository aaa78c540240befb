"""Threads the interpreter waits for at exit: a detached job run in this process, a batch's submitter."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_waited_for_at_exit: list[threading.Thread] = []


def _join_at_exit() -> None:
    import logging

    # Prefect's events client cannot start during shutdown and logs each failed emit as an error; the job's
    # events are a nicety for automations, its states and logs still reach the API.
    logging.getLogger("prefect.events.utilities").setLevel(logging.CRITICAL)
    with as_if_running():
        for thread in list(_waited_for_at_exit):
            thread.join()


@contextlib.contextmanager
def as_if_running() -> Iterator[None]:
    """While the interpreter waits for a thread at exit, that thread runs as it would while the main thread lived.

    Python marks itself as shutting down before it calls threading's exit hooks, and from then on no thread can
    register one: each of Prefect's services (a tag's concurrency slots, a new client's senders) fails to start
    ("can't register atexit after shutdown"). A batch whose script ended right after ``run_async_map`` had all its
    task runs fail so ("Finished in state Pending()") while its flow waited for them: the script never ended. The
    hooks registered meanwhile run after the wait, as the interpreter would have run them."""
    shutting_down = getattr(threading, "_SHUTTING_DOWN", False)
    hooks: list[Any] = getattr(threading, "_threading_atexits", [])
    before = len(hooks)
    threading._SHUTTING_DOWN = False  # type: ignore[attr-defined]  # noqa: SLF001
    try:
        yield
    finally:
        threading._SHUTTING_DOWN = shutting_down  # type: ignore[attr-defined]  # noqa: SLF001
        if shutting_down:  # the interpreter's loop over its hooks has passed the point where these were added
            added = hooks[before:]
            del hooks[before:]
            for hook in reversed(added):
                with contextlib.suppress(Exception):
                    hook()


def start_waited_for_at_exit(thread: threading.Thread) -> None:
    """Start ``thread`` and have the interpreter wait for it when the main thread ends, *before* it shuts down the
    thread pools of concurrent.futures (threading's own exit hooks run last-registered first): a plain non-daemon
    thread is joined only after that, when the job's worker can no longer start a thread ("cannot schedule new
    futures after interpreter shutdown")."""
    if not _waited_for_at_exit:
        # Prefect's log and event senders register their own exit hooks when they first start; started during
        # shutdown (the job's last log lines, a batch's first task runs) they cannot: each line printed a "Logging
        # error" traceback, and each task run of a batch whose script had already ended failed to record its
        # states ("Finished in state Pending()") and was never run. Started now, their hooks are registered before
        # this one, so they run after this join and send what the thread left.
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.instance()
        EventsWorker.instance()
        threading._register_atexit(_join_at_exit)  # type: ignore[attr-defined]  # noqa: SLF001 - the hook that runs before the pools' shutdown
    _waited_for_at_exit.append(thread)
    thread.start()


__all__ = ["as_if_running", "start_waited_for_at_exit"]
