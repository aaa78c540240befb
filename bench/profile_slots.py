"""Where a ``.map()`` in slots spends its time: one timeline per input, phases summed over the inputs.

    KINETIC_SWEEP_SLOTS=16 uv run python bench/profile_slots.py [--inputs 64] [--database sqlite] [--out FILE]

In-process submission, warm runners (keep_warm_seconds=60), a dedicated server (bench/server.py). The caller's own
functions are wrapped (in this process only) to stamp each input's phases, relative to the flow's start:

- ``before_upload``: the flow's start until the call uploads its payload: Prefect creating and starting the
  input's task run, the pool read and the call's checks (the caller side of Prefect's bookkeeping);
- ``upload``: the payload and its signature to the store;
- ``queued_to_done``: from the input's queued record until the caller sees its done record; of it,
  ``in_slot`` is the input's seconds in its slot (the done record's), the rest is the wait for a slot (launch,
  the slots busy with earlier inputs) plus the claim and poll latency;
- ``collect``: reading the outcome and the result;
- ``after``: until the flow has the input's value (Prefect finishing the task run, the future's result).

Prints the median and the total of each phase and when the last input was queued; ``--out`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("KINETIC_UNSIGNED_OK", "1")
os.environ.setdefault("KINETIC_IN_PROCESS_CONCURRENCY", "16")

from bench.server import prefect_server  # noqa: E402

stamps: dict[str, dict[str, float]] = {}
t0 = [0.0]


def now() -> float:
    return time.perf_counter() - t0[0]


def install_stamps() -> None:
    from kinetic_prefect.caller import slots, submission, sweep_calls

    upload, collect, run_input = submission.upload_inputs, sweep_calls.collect, slots.Sweep.run_input

    def stamped_upload(store, call, *args, **kwargs):
        mine = stamps.setdefault(call.layout.run_id, {})
        mine["upload_start"] = now()
        try:
            return upload(store, call, *args, **kwargs)
        finally:
            mine["upload_end"] = now()

    async def stamped_collect(store, call, *args, **kwargs):
        mine = stamps.setdefault(call.layout.run_id, {})
        mine["collect_start"] = now()
        try:
            return await collect(store, call, *args, **kwargs)
        finally:
            mine["collect_end"] = now()

    async def stamped_run_input(self, run_id, *args, **kwargs):
        mine = stamps.setdefault(run_id, {})
        mine["queued"] = now()
        how, detail = await run_input(self, run_id, *args, **kwargs)
        mine["done_seen"] = now()
        if how == "done" and isinstance(detail, dict) and detail.get("seconds") is not None:
            mine["in_slot"] = float(detail["seconds"])
        return how, detail

    submission.upload_inputs = stamped_upload  # stamps in this process only
    sweep_calls.collect = stamped_collect
    slots.Sweep.run_input = stamped_run_input


def phases(flow_end: float) -> dict:
    rows = [s for s in stamps.values() if {"upload_start", "queued", "done_seen", "collect_end"} <= s.keys()]
    by_phase: dict[str, list[float]] = {
        "before_upload": [s["upload_start"] for s in rows],
        "upload": [s["upload_end"] - s["upload_start"] for s in rows],
        "queued_to_done": [s["done_seen"] - s["queued"] for s in rows],
        "in_slot": [s.get("in_slot", 0.0) for s in rows],
        "wait_claim_poll": [s["done_seen"] - s["queued"] - s.get("in_slot", 0.0) for s in rows],
        "collect": [s["collect_end"] - s["collect_start"] for s in rows],
    }
    return {
        "inputs_in_slots": len(rows),
        "flow_s": round(flow_end, 3),
        "last_queued_s": round(max(s["queued"] for s in rows), 3) if rows else None,
        "last_done_seen_s": round(max(s["done_seen"] for s in rows), 3) if rows else None,
        "last_collect_end_s": round(max(s["collect_end"] for s in rows), 3) if rows else None,
        "median_s": {k: round(statistics.median(v), 4) for k, v in by_phase.items() if v},
        "sum_s": {k: round(sum(v), 3) for k, v in by_phase.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with prefect_server(database=args.database):
        from prefect import flow

        from kinetic_prefect import kinetic_task

        @kinetic_task(name="noop-profile", submission="in-process", job_variables={"keep_warm_seconds": 60})
        def noop(i: int) -> int:
            return i

        @flow
        def one():
            return noop(0)

        @flow
        def fan_out():
            t0[0] = time.perf_counter()
            return noop.map(range(args.inputs)).result()

        one()  # warm: the pool, the project archive, the environment
        install_stamps()
        started = time.perf_counter()
        values = fan_out()
        report = {"database": args.database, "values_ok": values == list(range(args.inputs))}
        report["wall_s"] = round(time.perf_counter() - started, 3)
        report.update(phases(time.perf_counter() - t0[0]))
        print(json.dumps(report, indent=2), flush=True)  # before the server stops under the closing slots
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
