"""How a sweep in slots ends, seen from the script that ran it (issue 48, defects 2 and 7).

A small ``.map()`` script run as a user runs it (a subprocess, in-process submission on a priced kinetic-local
pool), once in slots (the default) and once with ``KINETIC_SWEEP_SLOTS=0`` (a job run per input): the script ends
with no traceback on its output, every slot job run has its table of inputs and its cost event on the server when the
script has ended, and the flow run's cost counts the slots as it counts the single jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from test_cost import artifacts, events, priced_pool, table
from test_slots import SLOT_TAG, slot_table
from test_spine import job_runs

from kinetic_prefect.contract import EVENT_EXITED, FLOW_COST_ARTIFACT_KEY, JOB_COST_EVENT, JOB_EVENT_PREFIX

MAP_SCRIPT = textwrap.dedent("""
    import sys
    from prefect import flow
    from prefect.runtime import flow_run
    from kinetic_prefect import kinetic_task

    NAME, POOL = sys.argv[1:3]

    @kinetic_task(name=NAME, work_pool=POOL, submission="in-process", accelerator="cpu")
    def square(i: int) -> int:
        import time
        time.sleep(0.2)
        return i * i

    @flow(name=NAME + "-flow")
    def sweep():
        print("FLOW_RUN", flow_run.id, flush=True)
        return [f.result() for f in square.map(range(8))]

    if __name__ == "__main__":
        print("VALUES", sweep(), flush=True)
""")


def run_map_script(tmp_path, pool: str, slots: int) -> tuple[str, str, str]:
    """Run MAP_SCRIPT to its end (90 s at most): (the task's name, the flow run's id, the script's stderr)."""
    name = f"endings-{uuid.uuid4().hex[:6]}"
    script = tmp_path / f"map_{slots}.py"
    script.write_text(MAP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), name, pool],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "KINETIC_SWEEP_SLOTS": str(slots)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "VALUES [0, 1, 4, 9, 16, 25, 36, 49]" in proc.stdout, proc.stdout[-3000:]
    flow_run_id = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FLOW_RUN "))
    return name, flow_run_id, proc.stderr


def flow_total(flow_run_id: str) -> float | None:
    found = artifacts(flow_run_id, FLOW_COST_ARTIFACT_KEY)
    return table(found[-1])[-1]["usd"] if found else None


def cli_total(flow_run_id: str) -> float:
    proc = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.cli", "cost", "--flow-run", flow_run_id, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["runs"][0]["total_usd"]


@pytest.mark.slow
def test_a_map_in_slots_ends_with_its_artifacts_and_events_and_no_traceback(tmp_path):
    """Defect 7: once the script has ended, with nothing on its stderr but log lines, every slot's run is final with
    its table of inputs, and its cost and exit events reached the server."""
    name, _, stderr = run_map_script(tmp_path, priced_pool(), slots=4)
    assert "Traceback" not in stderr and "Error emitting event" not in stderr, stderr[-6000:]
    assert "can't register atexit" not in stderr, stderr[-6000:]
    slots = [run for run in job_runs(name) if SLOT_TAG in (run.tags or [])]
    assert slots, [(run.name, run.tags) for run in job_runs(name)]
    assert all(run.state.is_completed() for run in slots), [(run.name, run.state.name) for run in slots]
    tables = {run.name: slot_table(run.id) for run in slots}  # read at once: the script has ended
    assert all(rows is not None for rows in tables.values()), tables
    assert sum(len(rows) for rows in tables.values()) + len(job_runs(name)) - len(slots) == 8, tables
    for run in slots:
        for event in (JOB_COST_EVENT, JOB_EVENT_PREFIX + EVENT_EXITED):
            assert events(event, f"prefect.flow-run.{run.id}", timeout=10), (run.name, event)


@pytest.mark.slow
def test_a_map_in_slots_costs_its_flow_run_as_a_job_per_input_does(tmp_path):
    """Defect 2: the flow run's cost artifact and ``kinetic-prefect cost`` count the slot jobs (before: no artifact
    and $0.00 in slots, the cost of the 4 jobs with slots off). Both paths bill process time at the pool's price,
    so the two totals are of one order of magnitude. About 30 s: two scripts, each with its own flow run and 8
    inputs (slots on, then off), since the comparison is the point."""
    pool = priced_pool()
    _, in_slots, _ = run_map_script(tmp_path, pool, slots=2)
    _, one_each, _ = run_map_script(tmp_path, pool, slots=0)
    slots_total, singles_total = flow_total(in_slots), flow_total(one_each)
    assert singles_total and singles_total > 0, artifacts(one_each)
    assert slots_total and slots_total > 0, artifacts(in_slots)
    assert singles_total / 10 < slots_total < singles_total * 10, (slots_total, singles_total)
    assert cli_total(in_slots) == pytest.approx(slots_total, abs=1e-5)
    assert cli_total(one_each) == pytest.approx(singles_total, abs=1e-5)


BATCH_SCRIPT = textwrap.dedent("""
    import sys
    from kinetic_prefect import kinetic

    NAME, POOL = sys.argv[1:3]

    @kinetic.run(accelerator="cpu", work_pool=POOL, name=NAME)
    def square(x):
        return x * x

    batch = square.run_async_map([1, 2, 3])
    print("GROUP", batch.group_id, flush=True)
""")


@pytest.mark.slow
def test_a_script_ending_after_run_async_map_exits_and_its_batch_is_found_from_another_process(tmp_path):
    """Defect 5: a script whose last line is ``run_async_map`` (no worker polls the pool: the batch rides in slots,
    bound to its process) ends once its batch has run, within 90 s (before: it hung, its inputs' task runs
    "Finished in state Pending()"), with no traceback; another process then finds the batch and its values."""
    from worker_fixture import new_pool

    name = f"batch-end-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "batch.py"
    script.write_text(BATCH_SCRIPT)
    env = {**os.environ, "KINETIC_SWEEP_SLOTS": "2"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script), name, new_pool("batch-end")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script still ran 90 s after its last line:\n{(exc.stderr or b'')[-4000:]!r}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr and "Pending()" not in proc.stderr, proc.stderr[-5000:]
    group = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("GROUP "))
    collect = (
        "import sys; from kinetic_prefect import kinetic; "
        f"print('VALUES', kinetic.attach_batch({group!r}).results(timeout=60))"
    )
    other = subprocess.run([sys.executable, "-c", collect], capture_output=True, text=True, timeout=120, env=env)
    assert other.returncode == 0 and "VALUES [1, 4, 9]" in other.stdout, other.stdout[-2000:] + other.stderr[-4000:]
