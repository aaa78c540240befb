"""Processes on this machine: told apart across pid reuse by their start time (Linux ``/proc``), and a command run
with its output streamed line by line (a docker build or push) and its last lines kept for the error."""

from __future__ import annotations

import collections
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (so a reused pid is not mistaken for it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def run_streamed(
    args: list[str], log: Callable[[str], None], tail_lines: int, stop: threading.Event | None = None
) -> tuple[int, str]:
    """Run ``args``, passing each line of its output (stdout and stderr together) to ``log``; (its exit status, its
    last ``tail_lines`` lines) for the caller's error. A set ``stop`` terminates the command (then kills it)."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
    )
    if stop is not None:
        threading.Thread(target=_end_on_stop, args=(proc, stop), name="kinetic-build-stop", daemon=True).start()
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            log(line)
    return proc.returncode, "\n".join(tail)


def _end_on_stop(proc: subprocess.Popen[str], stop: threading.Event) -> None:
    while proc.poll() is None:
        if stop.wait(0.2):
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
            return


__all__ = ["process_start_ticks", "run_streamed"]
