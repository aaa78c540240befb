"""The cost and usage artifacts in the real Prefect UI (headless Chromium), and the docs' screenshots of them.

    uv run --all-extras python tests/support/ui_cost_check.py --out docs/screenshots

Starts its own ``prefect server start`` (temporary PREFECT_HOME), runs a small flow of three kinetic calls on a
``kinetic-local`` pool with a priced ``cpu`` entry (two ``cpu`` calls that keep a core busy, one ``l4`` call,
which runs on this machine's CPU and is priced at the built-in l4 list price), then opens the flow run's cost
table, a job's cost table and a job's usage plot, checks what the rendered page shows (the rows, the plot image
loaded) and saves the screenshots (``cost-flow-run-total.png``, ``cost-job.png``, ``cost-usage-plot.png``).
Used by ``tests/end_to_end/test_ui_cost.py`` against the test session's server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ui_check import ROOT, Browser, Server, _images_js, find_chromium, post_json

FLOW = """
import json, sys, time
from prefect import flow
from prefect.client.schemas.actions import WorkPoolCreate
from prefect import get_client
from kinetic_prefect import kinetic_task
from kinetic_prefect.workers.base import load_template

pool = sys.argv[1]
template = load_template("kinetic-local")
template["variables"]["properties"]["prices"]["default"] = {
    "cpu": {"on_demand": 0.4, "spot": 0.1, "source": "example price sheet (not a list price)"}}
with get_client(sync_client=True) as client:
    client.create_work_pool(WorkPoolCreate(name=pool, type="kinetic-local", base_job_template=template))


@kinetic_task(work_pool=pool, accelerator="cpu")
def train(seconds: float) -> int:
    import numpy as np
    end, steps, held = time.time() + seconds, 0, []
    while time.time() < end:
        held.append(np.ones((256, 1024)))  # memory grows as it goes: the plot shows it
        steps += int(np.linalg.norm(np.random.rand(200, 200) @ np.random.rand(200, 200)) > 0)
        time.sleep(0.02)
    return steps


@kinetic_task(work_pool=pool, accelerator="l4")
def evaluate(seconds: float) -> float:
    time.sleep(seconds)
    return 0.97


@flow(name="cost-demo")
def cost_demo():
    return train(12.0), train(5.0), evaluate(3.0)


state = cost_demo(return_state=True)
print("UI-COST-RESULT " + json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "state": state.name}))
"""


def run_cost_flow(env: dict, timeout: float = 900) -> str:
    pool = f"priced-ui-{int(time.time())}"
    proc = subprocess.run(
        [sys.executable, "-c", FLOW, pool], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UI-COST-RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"the cost flow failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads(lines[-1].split(" ", 1)[1])
    if result["state"] != "Completed":
        raise RuntimeError(f"the cost flow ended {result['state']}:\n{proc.stderr[-3000:]}")
    return result["flow_run_id"]


def check_cost_pages(ui_url: str, api_url: str, flow_run_id: str, out_dir: Path, chromium: str) -> dict:
    """Opens the three artifacts in Chromium; raises AssertionError naming what the UI did not show."""
    children = post_json(f"{api_url}/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    ids = [flow_run_id] + [c["id"] for c in children]
    found = post_json(f"{api_url}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}})
    by_key = {}
    for artifact in found:
        by_key.setdefault((artifact.get("key"), artifact["type"]), []).append(artifact)
    [total] = by_key[("kinetic-flow-cost", "table")]
    job_costs = by_key[("kinetic-job-cost", "table")]
    plots = [
        a for a in by_key.get(("kinetic-job-usage-plot", "markdown"), []) if "usage over time" in (a.get("data") or "")
    ]
    assert len(job_costs) == 3 and len(plots) == 3, f"expected 3 job cost tables and 3 plots: {list(by_key)}"
    rows = json.loads(total["data"])
    report = {"flow_run_id": flow_run_id, "total_usd": rows[-1]["usd"], "screenshots": [], "checks": []}
    browser = Browser(chromium)
    try:

        def shot(name: str, height: int | None = None) -> None:
            browser.settle()
            report["screenshots"].append(str(browser.screenshot(Path(out_dir) / name, height=height)))

        browser.goto(f"{ui_url}/artifacts/artifact/{total['id']}")
        browser.wait_for(
            "document.querySelectorAll('table tr, [role=row]').length > 4",
            90,
            what="the rows of the flow run's cost table",
        )
        browser.wait_text("total", rows[0]["call"], timeout=60)
        report["checks"].append(f"flow cost table: {len(rows)} rows shown, total ${rows[-1]['usd']}")
        shot("cost-flow-run-total.png")

        longest = max(job_costs, key=lambda a: json.loads(a["data"])[0]["minutes"])
        browser.goto(f"{ui_url}/artifacts/artifact/{longest['id']}")
        browser.wait_text(json.loads(longest["data"])[0]["call"], timeout=90)
        report["checks"].append("job cost table shown")
        shot("cost-job.png")

        plot = max(plots, key=lambda a: len(a["data"]))
        browser.goto(f"{ui_url}/artifacts/artifact/{plot['id']}")
        browser.wait_for("document.querySelectorAll('h2, table').length > 0", 90, what="the usage markdown")
        browser.wait_for(
            f"({_images_js()}).some(i => i.complete && i.w > 0 && i.shown > 0)",
            60,
            what="the usage plot image, loaded and shown",
        )
        report["checks"].append("usage plot: the SVG image renders")
        shot("cost-usage-plot.png", height=1100)
        hinted = [a for a in plots if "**Hint:**" in a["data"]]
        if hinted:
            browser.goto(f"{ui_url}/artifacts/artifact/{hinted[0]['id']}")
            browser.wait_text("Hint:", timeout=90)
            report["checks"].append("the l4 job's usage page shows its hint")
            shot("cost-usage-hint.png", height=1100)
    finally:
        report["browser_errors"] = browser.console[-10:]
        browser.close()
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument(
        "--url",
        help="use this running server (http://host:port) instead of starting one; the flow runs against its API",
    )
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if not chromium:
        print("chromium is not installed (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 2
    if args.url:
        env = {**os.environ, "PREFECT_API_URL": f"{args.url}/api"}
        report = check_cost_pages(args.url, f"{args.url}/api", run_cost_flow(env), Path(args.out), chromium)
        print(json.dumps(report, indent=1))
        return 0
    server = Server()
    try:
        flow_run_id = run_cost_flow(server.env)
        report = check_cost_pages(server.url, f"{server.url}/api", flow_run_id, Path(args.out), chromium)
    finally:
        server.stop()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
