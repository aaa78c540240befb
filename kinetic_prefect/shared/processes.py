"""Processes on this machine, told apart across pid reuse by their start time (Linux ``/proc``)."""

from __future__ import annotations

from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (so a reused pid is not mistaken for it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


__all__ = ["process_start_ticks"]
