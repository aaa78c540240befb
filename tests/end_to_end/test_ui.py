"""The Prefect UI, checked in a real browser (headless Chromium over the DevTools protocol).

The session's `prefect server start` (conftest; it serves the UI too) gets one EuroSAT flow run on the
shared sample (tiny preset, 1 epoch); then the flow run page, its task runs, the training job nested
under its task run, the logs and every artifact are opened in Chromium and checked in the rendered DOM.
Screenshots go to a temporary folder, or to $KINETIC_UI_SCREENSHOTS (the README's come from
`python tests/support/ui_check.py --out docs/screenshots`).

Needs Debian's `chromium` (`apt-get install -y chromium`): without it these tests skip, unless CI is
set, where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ui_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def chromium() -> str:
    path = ui_check.find_chromium()
    if path:
        return path
    message = "chromium is not installed (Debian: apt-get install -y chromium); the UI checks need a real browser"
    if os.environ.get("CI"):
        pytest.fail(message + " and CI is set")
    pytest.skip(message)


@pytest.fixture(scope="module")
def ui(chromium, prefect_server, tmp_path_factory):
    """One EuroSAT flow run against the session's server, and a browser on its UI."""
    if not ui_check.SAMPLE_ZIP.is_file():
        pytest.skip(f"{ui_check.SAMPLE_ZIP} is absent (the EuroSAT sample ships with the CI machine only)")
    work = tmp_path_factory.mktemp("ui-run")
    run = ui_check.run_eurosat_flow(os.environ.copy(), work)
    out = Path(os.environ.get("KINETIC_UI_SCREENSHOTS") or work / "screenshots")
    check = ui_check.UICheck(prefect_server.removesuffix("/api"), prefect_server, run["flow_run_id"], out, chromium)
    yield check
    check.close()


def test_ui_talks_to_this_server(ui):
    ui.ui_settings()


def test_flow_run_page_shows_task_runs_and_the_nested_job(ui):
    tracker = ui.facts["job_tracker"]
    assert [p["id"] for p in tracker["task_inputs"]["__parents__"]] == [ui.train["id"]], (
        "the job's run is not nested (through its tracking task run) under its task run"
    )
    ui.flow_run_page()
    assert {"flow-run.png", "flow-run-task-runs.png", "flow-run-subflows.png"} <= set(ui.report["screenshots"])


def test_logs_show_the_flow_and_the_jobs_epochs(ui):
    ui.logs()


def test_artifacts_render(ui):
    ui.artifacts()
    kinds = {key: a["type"] for key, a in ui.report["artifacts"].items()}
    assert kinds.get("eurosat-per-class-metrics") == "table", kinds
    assert kinds.get("eurosat-confusion-matrix") == "table", kinds
    assert kinds.get("eurosat-report") == "markdown", kinds
    broken = [p for p in ui.report["problems"] if "does not render" in p]
    assert not broken, broken


def test_plots_render_as_images_in_the_ui(ui):
    """confusion_matrix.png and learning_curves.png must be visible in the UI, not only files on disk."""
    with_images = [a for a in ui.facts["artifacts"] if ui_check.carries_image(a)]
    assert with_images, "no artifact carries an image: the UI would show the plots nowhere"
    if not ui.report["artifacts"]:
        ui.artifacts()
    rendered = sum(ui.report["artifacts"][ui.artifact_name(a)]["rendered"] for a in with_images)
    assert rendered >= 2, (
        f"expected the confusion matrix and the learning curves as images in the UI, "
        f"{rendered} rendered: {ui.report['artifacts']}"
    )


def test_job_progress_shows_in_the_ui(ui):
    """The training job's progress (kinetic_prefect.pod.progress.report) as a progress artifact on its run."""
    progress = ui.job_progress()
    assert progress, f"no progress artifact on the job's run {ui.job['name']}"
    if not ui.report["artifacts"]:
        ui.artifacts()
    names = {ui.artifact_name(a) for a in progress}
    assert any(line.startswith(f"progress artifact {name}:") for line in ui.report["checks"] for name in names), (
        ui.report["checks"]
    )
