"""Threads the interpreter waits for at exit: a detached job run in this process, a batch's submitter."""

from __future__ import annotations

import threading

from kinetic_prefect.shared import exit_hooks

_waited_for_at_exit: list[threading.Thread] = []


def _join_at_exit() -> None:
    import logging

    # Prefect's events client cannot start during shutdown and logs each failed emit as an error; the job's
    # events are a nicety for automations, its states and logs still reach the API.
    logging.getLogger("prefect.events.utilities").setLevel(logging.CRITICAL)
    # A batch whose script ended right after ``run_async_map`` had all its task runs fail ("Finished in state
    # Pending()") while its flow waited for them, and the script never ended: the thread runs as if the main lived.
    with exit_hooks.as_if_running():
        for thread in list(_waited_for_at_exit):
            thread.join()


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
        exit_hooks.run_before_pools_shut_down(_join_at_exit)
    _waited_for_at_exit.append(thread)
    thread.start()


__all__ = ["start_waited_for_at_exit"]
