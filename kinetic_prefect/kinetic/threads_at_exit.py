"""Threads the interpreter waits for at exit: a detached job run in this process, a batch's submitter."""

from __future__ import annotations

import threading

_waited_for_at_exit: list[threading.Thread] = []


def _join_at_exit() -> None:
    import logging

    # Prefect's events client cannot start during shutdown and logs each failed emit as an error; the job's
    # events are a nicety for automations, its states and logs still reach the API.
    logging.getLogger("prefect.events.utilities").setLevel(logging.CRITICAL)
    for thread in list(_waited_for_at_exit):
        thread.join()


def start_waited_for_at_exit(thread: threading.Thread) -> None:
    """Start ``thread`` and have the interpreter wait for it when the main thread ends, *before* it shuts down the
    thread pools of concurrent.futures (threading's own exit hooks run last-registered first): a plain non-daemon
    thread is joined only after that, when the job's worker can no longer start a thread ("cannot schedule new
    futures after interpreter shutdown")."""
    if not _waited_for_at_exit:
        # Prefect's log sender registers its own exit hook when it first starts; started during shutdown (the job's
        # last log lines) it cannot, and each line printed a "Logging error" traceback. Started now, its hook is
        # registered before this one, so it runs after this join and sends those lines.
        from prefect.logging.handlers import APILogWorker

        APILogWorker.instance()
        threading._register_atexit(_join_at_exit)  # type: ignore[attr-defined]  # noqa: SLF001 - the hook that runs before the pools' shutdown
    _waited_for_at_exit.append(thread)
    thread.start()


__all__ = ["start_waited_for_at_exit"]
