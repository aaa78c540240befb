"""shared/sweeps.py: how a sweep's waiting calls notice the caller's Ctrl-C / SIGTERM, and what that costs."""

import sys
import threading
import time

import pytest

from kinetic_prefect.shared import sweeps

pytestmark = pytest.mark.no_server


def test_many_waiting_calls_share_one_reading_of_the_main_thread(monkeypatch):
    """400 calls polling 5 times a second, as a 400-input map's waiting calls do (about 1 s): the threads are read
    a few times per 0.1 s in all, not once per call per poll (each reading walks every thread: O(calls²))."""
    readings = []
    real = sys._current_exceptions

    def counted():
        readings.append(1)
        return real()

    monkeypatch.setattr(sys, "_current_exceptions", counted)
    stop = threading.Event()
    seen: list[bool] = []

    def waiting_call():
        while not stop.is_set():
            seen.append(sweeps.caller_interrupted())
            stop.wait(0.2)

    threads = [threading.Thread(target=waiting_call) for _ in range(400)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    assert len(seen) >= 400 * 4 and not any(seen)
    assert len(readings) <= elapsed / 0.1 + 5, (len(readings), len(seen))  # one reading per 0.1 s at most


def test_a_waiting_call_still_sees_the_main_threads_interrupt_within_the_snapshot_age():
    noticed = threading.Event()
    stop = threading.Event()

    def waiting_call():
        while not stop.is_set():
            if sweeps.caller_interrupted():
                noticed.set()
                return
            stop.wait(0.05)

    thread = threading.Thread(target=waiting_call)
    thread.start()
    try:
        time.sleep(0.2)
        assert not noticed.is_set()
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:  # the main thread unwinding, as a flow does on Ctrl-C
            assert noticed.wait(1.0), "the interrupt was not noticed"
    finally:
        stop.set()
        thread.join()
