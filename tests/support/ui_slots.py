"""Screenshots of a sweep in slots in the Prefect UI, with the harness of ``tests/support/ui_check.py``:

    uv run --all-extras python tests/support/ui_slots.py --out docs/screenshots

Starts its own ``prefect server start`` (UI included), runs a flow whose ``.map()`` over 8 inputs rides in 2 slot
jobs (kinetic-local, warm runners, in-process submission), then opens in headless Chromium the flow run's Task Runs
tab (one task run per input), a slot job run's Logs tab (a line per input it served) and that slot's table of the
inputs it served (its ``kinetic-slot-inputs`` artifact), checking that each shows what it must.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ui_check import Browser, Server, find_chromium, post_json  # noqa: E402

from kinetic_prefect.contract import SLOT_INPUTS_ARTIFACT_KEY, SLOT_TAG  # noqa: E402

SWEEP = """
import json
from prefect import flow
from kinetic_prefect import kinetic_task

@kinetic_task(name="square", submission="in-process", job_variables={"keep_warm_seconds": 20})
def square(i: int) -> int:
    print(f"input {i}: squaring", flush=True)
    return i * i

@flow(name="sweep-in-slots")
def sweep_in_slots(n: int = 8) -> list[int]:
    return square.map(range(n)).result()

state = sweep_in_slots(return_state=True)
print("UI-SLOTS-RESULT " + json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "state": state.name}))
"""


def run_sweep(env: dict, work: Path) -> str:
    (work / "sweep_in_slots.py").write_text(SWEEP)
    proc = subprocess.run(
        [sys.executable, "sweep_in_slots.py"],
        cwd=work,
        env={**env, "KINETIC_SWEEP_SLOTS": "2", "KINETIC_UNSIGNED_OK": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UI-SLOTS-RESULT ")]
    assert proc.returncode == 0 and lines, f"the sweep failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert result["state"] == "Completed", result
    return result["flow_run_id"]


def slot_artifact(api: str) -> tuple[dict, dict]:
    """A slot job run and its table of inputs, once the caller has published it."""
    deadline = time.time() + 60
    while True:
        slots = post_json(f"{api}/flow_runs/filter", {"flow_runs": {"tags": {"all_": [SLOT_TAG]}}})
        for slot in slots:
            found = post_json(
                f"{api}/artifacts/filter",
                {"artifacts": {"flow_run_id": {"any_": [slot["id"]]}, "key": {"any_": [SLOT_INPUTS_ARTIFACT_KEY]}}},
            )
            if found and "| Completed |" in found[0]["data"]:
                return slot, found[0]
        assert time.time() < deadline, "no slot job run with a table of its inputs"
        time.sleep(1)


def main() -> int:
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else Path("docs/screenshots")
    chromium = find_chromium()
    assert chromium, "chromium is not installed (Debian: apt-get install -y chromium)"
    server = Server(start_timeout=600)
    api = f"{server.url}/api"
    browser = None
    try:
        with tempfile.TemporaryDirectory(prefix="kinetic-ui-slots-") as work:
            flow_run_id = run_sweep(server.env, Path(work))
        slot, artifact = slot_artifact(api)
        browser = Browser(chromium)
        shots = [
            (f"/runs/flow-run/{flow_run_id}", "Task Runs", ["square-"], "slots-flow-run-task-runs.png"),
            (f"/runs/flow-run/{slot['id']}", "Logs", ["kinetic slot: input"], "slots-slot-run-logs.png"),
            (
                f"/artifacts/artifact/{artifact['id']}",
                None,
                ["Inputs served by slot job", "Completed"],
                "slots-slot-table.png",
            ),
        ]
        for path, tab, needles, name in shots:
            browser.goto(f"{server.url}{path}")
            scope = browser.click_tab(tab, timeout=90) if tab else "body"
            browser.wait_text(*needles, timeout=90, scope=scope)
            browser.settle()
            browser.redact_paths()
            print(browser.screenshot(out / name), flush=True)
    finally:
        if browser is not None:
            browser.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
