"""The cost and usage artifacts in the real Prefect UI (headless Chromium): the flow run's cost table, a job's
cost table and its usage plot render (rows shown, the plot image loaded). The docs' screenshots come from
`python tests/support/ui_cost_check.py --out docs/screenshots`; here they go to $KINETIC_UI_SCREENSHOTS or a temporary
folder. Needs Debian's `chromium`: without it this skips, unless CI is set, where it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ui_check
import ui_cost_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_cost_and_usage_artifacts_render_in_the_ui(prefect_server, tmp_path):
    chromium = ui_check.find_chromium()
    if not chromium:
        message = "chromium is not installed (Debian: apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + " and CI is set")
        pytest.skip(message)
    flow_run_id = ui_cost_check.run_cost_flow(os.environ.copy())
    out = Path(os.environ.get("KINETIC_UI_SCREENSHOTS") or tmp_path)
    report = ui_cost_check.check_cost_pages(
        prefect_server.removesuffix("/api"), prefect_server, flow_run_id, out, chromium
    )
    assert report["total_usd"] > 0
    names = {Path(p).name for p in report["screenshots"]}
    assert {"cost-flow-run-total.png", "cost-job.png", "cost-usage-plot.png", "cost-usage-hint.png"} <= names
    assert "usage plot: the SVG image renders" in report["checks"]
