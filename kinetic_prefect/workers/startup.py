"""A job's start-up timeline: when it was submitted, its image ready, its node asked for and ready, its image pulled,
its container started, its first line seen and its end — in the run's logs, as a table artifact on the job's run
(``STARTUP_ARTIFACT_KEY``) and in ``kinetic-prefect jobs status``.

A launcher fills a :class:`Timeline` as it goes (``mark``) and from what the cluster recorded (pod conditions,
container states, events); the lifecycle publishes it once the run is final. A step the job did not go through (no
scale-up: a node was free; a warm pod reused: no pull) has no time and says why in its note.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kinetic_prefect.contract import STARTUP_ARTIFACT_KEY, STARTUP_STEPS, STARTUP_SUBMITTED


@dataclass
class Timeline:
    """Wall-clock times (epoch seconds) of the steps of ``STARTUP_STEPS``, and a note per step."""

    at: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def mark(self, step: str, at: float | None = None, note: str | None = None, first: bool = True) -> None:
        """``step`` happened at ``at`` (now when None); with ``first``, an earlier mark of it is kept."""
        if not (first and step in self.at):
            self.at[step] = time.time() if at is None else at
        if note:
            self.notes[step] = note

    def note(self, step: str, text: str) -> None:
        """A note alone: why a step has no time (it did not happen for this job)."""
        self.notes.setdefault(step, text)

    def rows(self) -> list[dict[str, str]]:
        """One row per step, in order: its UTC time, seconds since submission, the note."""
        start = self.at.get(STARTUP_SUBMITTED)
        rows = []
        for step in STARTUP_STEPS:
            at = self.at.get(step)
            rows.append(
                {
                    "step": step,
                    "at": datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S.%f")[:-4] if at is not None else "—",
                    "after": f"+{at - start:.1f} s" if at is not None and start is not None else "—",
                    "note": self.notes.get(step, ""),
                }
            )
        return rows

    def line(self) -> str:
        """The timeline in one log line: ``start-up: image ready +12.1 s (built in 12.0 s), ...``."""
        parts = []
        for row in self.rows()[1:]:
            if row["after"] == "—" and not row["note"]:
                continue
            note = f" ({row['note']})" if row["note"] else ""
            parts.append(f"{row['step']} {row['after']}{note}")
        return "start-up: " + ", ".join(parts)

    def markdown(self) -> str:
        lines = ["| step | at (UTC) | after submission | note |", "|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['at']} | {r['after']} | {r['note']} |" for r in self.rows()]
        return "\n".join(lines)


async def publish(client: Any, flow_run: Any, logger: Any, timeline: Timeline) -> None:
    """The timeline as a log line and a table artifact on the job's run; a failure to publish never fails a job."""
    from prefect.client.schemas.actions import ArtifactCreate

    logger.info(timeline.line())
    try:
        await client.create_artifact(
            ArtifactCreate(
                key=STARTUP_ARTIFACT_KEY,
                type="table",
                data=timeline.rows(),
                description=f"Start-up of kinetic job {flow_run.name}: where its time went (submission to first line)",
                flow_run_id=flow_run.id,
            )
        )
    except Exception as exc:  # a nicety: the job's own state is already set
        logger.warning(f"Could not publish the start-up timeline: {type(exc).__name__}: {exc}")
