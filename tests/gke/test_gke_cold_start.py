"""A cold call on GKE as the cluster behaves (tests/support/gke_autoscaler.py): a new image to build and a node pool
at zero nodes. While the image builds, a placeholder Job asks for the job's node (workers/gke/placeholder.py), so
the call waits for the longer of the build and the scale-up, not for both; and whatever ends the call before its
Job exists (a failed build, a cancel, a Ctrl-C) leaves no placeholder.

The build is the job image the module's fixture built, found after a wait the test sets (``slow_build``): a build
of known length, without a registry round of minutes. The model's knobs are the test's own lines; GKE documents a
new node as "approximately 80 to 120 seconds to boot"
(https://cloud.google.com/kubernetes-engine/docs/how-to/capacity-provisioning); here the scale-up is scaled down to
seconds, and ``tests/gke/bench_gke_cold_start.py`` measures the documented one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import ui_check
from docker_fixture import proxy_files
from gke_autoscaler import NodePool
from job_runs import jobs_of
from kubernetes import client as k8s
from prefect import flow
from test_gke_autoscaling import _pod_start, gke_autoscaler  # noqa: F401  (a fixture)
from test_gke_cluster import (  # noqa: F401  (job_image: a fixture)
    _cluster_block,
    _gke_task,
    _make_pool,
    _run_logs,
    job_image,
)

from kinetic_prefect.cli.jobs import _startup_rows
from kinetic_prefect.contract import (
    PLACEHOLDER_LABEL,
    STARTUP_ARTIFACT_KEY,
    STARTUP_FIRST_LINE,
    STARTUP_IMAGE_READY,
    STARTUP_STEPS,
)
from kinetic_prefect.shared import builders

pytestmark = pytest.mark.slow

# the job runs of the cold calls made in this process, for the UI test that follows (``--dist loadfile`` keeps a
# module on one worker, in order)
_cold_job_runs: list[str] = []


@pytest.fixture
def slow_build(monkeypatch):
    """``slow_build(seconds, fail=False)``: the image build takes ``seconds``, then finds the job image (built as
    the ``job_image`` fixture builds it, should the package's files have changed since), or fails as a build does.
    Returns the seconds each build really took."""
    real = builders.DockerBuilder.ensure
    took: list[float] = []

    def install(seconds: float, fail: bool = False) -> list[float]:
        def ensure(self, spec, log=print):
            started = time.monotonic()
            log(f"building (the test's build of {seconds:g} s)")
            time.sleep(seconds)
            if fail:
                raise builders.ImageBuildError("the test's build failed")
            found = builders.DockerBuilder(self.repository, network="host", extra_files=proxy_files())
            image = real(found, spec, log)
            took.append(time.monotonic() - started)
            return image

        monkeypatch.setattr(builders.DockerBuilder, "ensure", ensure)
        return took

    return install


def _placeholders(kube) -> list:
    jobs = k8s.BatchV1Api(kube.api()).list_namespaced_job("default", label_selector=PLACEHOLDER_LABEL).items
    return [j for j in jobs if j.metadata.deletion_timestamp is None]


def _pool(kube, gcs_bucket, local_registry) -> str:
    return _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry, pod_watch_timeout_seconds=120)


def test_a_cold_call_waits_for_the_longer_of_the_build_and_the_scale_up_not_both(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler, slow_build, capsys
):
    """Build 12 s, scale-up 12 s (the verdict 1 s after the pod is seen unschedulable): the job's pod starts about
    15 s after submission, not 25 s; the node came for the placeholder, and no second node was added. The job's
    start-up timeline says so, in its run's artifact, its logs and `jobs status`. ~25 s: two waits of 12 s each are
    what the test is about."""
    build, scale_up = 12.0, 12.0
    model = gke_autoscaler([NodePool("t4-pool", "t4")], verdict_seconds=1, provisioning_seconds=scale_up)
    took = slow_build(build)
    pool = _pool(kube, gcs_bucket, local_registry)
    name = f"cold-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="t4")
    def hello() -> str:
        print("first line from the pod")
        return "ok"

    @flow
    def pipeline():
        return hello(return_state=True)

    state = pipeline()
    assert state.result() == "ok", state.message
    [job_run] = jobs_of(state.state_details.task_run_id)
    started_at, node = _pod_start(kube, job_run.id)
    waited = started_at - job_run.created.timestamp()
    [build] = took
    print(f"\ncold call: build {build:.1f} s, scale-up {scale_up:g} s: the pod started {waited:.1f} s after submission")
    asked = [pod for pod, reason, _ in model.events if reason == "TriggeredScaleUp"]
    assert len(asked) == 1 and "-hold-" in asked[0], model.events
    assert model.pool("t4-pool").nodes == [node], "the job ran on the node the placeholder asked for, the only one"
    assert waited < build + scale_up - 4, f"{waited:.1f} s: the scale-up waited for the build"
    assert not _placeholders(kube)
    _check_the_timeline(job_run.id, node, capsys)
    _cold_job_runs.append(str(job_run.id))


def test_the_cold_calls_timeline_shows_in_the_prefect_ui(prefect_server, tmp_path):
    """The cold call's start-up timeline on its artifact page in the real Prefect UI (headless Chromium): every
    step's row, the image-ready and first-line rows with their times; saved as ``startup-timeline.png`` into
    $KINETIC_UI_SCREENSHOTS (the docs' picture: ``KINETIC_UI_SCREENSHOTS=docs/screenshots``) or a temporary folder.
    The page's text is checked to show none of this machine's folders. ~8 s (Chromium's start, one page): it reads
    the run of the cold call above rather than making a second build and scale-up of its own. Without ``chromium``
    this skips, unless CI is set."""
    chromium = ui_check.find_chromium()
    if not chromium:
        message = "chromium is not installed (Debian: apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + " and CI is set")
        pytest.skip(message)
    if not _cold_job_runs:
        pytest.skip("needs the cold-call test before it in the same process (run the module)")
    [artifact] = ui_check.post_json(
        f"{prefect_server}/artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [_cold_job_runs[-1]]}, "key": {"any_": [STARTUP_ARTIFACT_KEY]}}},
    )
    rows = {row["step"]: row for row in artifact["data"]}
    out = Path(os.environ.get("KINETIC_UI_SCREENSHOTS") or tmp_path)
    browser = ui_check.Browser(chromium, size=(1400, 680))
    try:
        browser.goto(f"{prefect_server.removesuffix('/api')}/artifacts/artifact/{artifact['id']}")
        browser.wait_text(*STARTUP_STEPS, timeout=60, scope="table")
        for step in (STARTUP_IMAGE_READY, STARTUP_FIRST_LINE):
            cells = [c for c in (step, rows[step]["after"], rows[step]["note"]) if c]
            browser.wait_for(
                f"""Array.from(document.querySelectorAll('table tr')).some(tr => {{
                    const cells = Array.from(tr.querySelectorAll('td, th')).map(c => c.innerText.trim());
                    return {json.dumps(cells)}.every(c => cells.includes(c)); }})""",
                10,
                what=f"the row {cells}",
            )
        browser.redact_paths()
        browser.settle()
        shot = browser.screenshot(out / "startup-timeline.png")
    finally:
        errors = browser.console[-5:]
        browser.close()
    print(f"\nthe timeline's page: {shot} (browser errors: {errors})")
    assert shot.stat().st_size > 10_000


def _check_the_timeline(job_run_id, node: str, capsys) -> None:
    """The start-up timeline: a table artifact on the job's run, a line in its logs, and `jobs status`."""
    from kinetic_prefect.cli import main

    deadline = time.monotonic() + 20  # published once the run is final, beside the caller's return
    while not (found := _startup_rows(str(job_run_id))) and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = {row["step"]: row for row in found}
    assert list(rows) == list(STARTUP_STEPS)
    assert rows["image ready"]["note"].startswith("built in"), rows
    assert rows["scale-up asked"]["note"] == "a placeholder, while the image built", rows
    assert rows["node ready"]["note"] == node, rows
    after = {step: float(row["after"].strip("+ s")) for step, row in rows.items() if row["after"] != "—"}
    assert set(after) == set(STARTUP_STEPS), rows
    # the fake nodes share one Docker engine, where the image was built
    assert "already present on machine" in rows["image pulled"]["note"], rows
    assert after["scale-up asked"] < after["image ready"] <= after["node ready"] + 2, rows
    # in order, to the second: Kubernetes stamps conditions and container states in whole seconds
    order = [after[s] for s in ("node ready", "container started", "first line", "finished")]
    assert all(later >= earlier - 1.0 for earlier, later in zip(order, order[1:])), rows
    assert "start-up: image ready +" in _run_logs(job_run_id, "start-up:")
    capsys.readouterr()
    main(["jobs", "status", str(job_run_id)])
    out = capsys.readouterr().out
    assert "start-up:" in out and "a placeholder, while the image built" in out, out


def test_a_failed_build_leaves_no_placeholder(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler, slow_build
):
    """The build fails after 6 s, while the node it asked for is still on its way (60 s): the call fails with the
    build's error and its placeholder is gone when it returns. ~10 s: the placeholder must exist before the build
    fails (it is made 2 s into a build)."""
    model = gke_autoscaler([NodePool("t4-pool", "t4")], verdict_seconds=1, provisioning_seconds=60)
    slow_build(6, fail=True)
    pool = _pool(kube, gcs_bucket, local_registry)
    name = f"badbuild-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="t4")
    def hello() -> str:
        return "ok"

    @flow
    def pipeline():
        return hello(return_state=True), "the flow went on"

    state, _ = pipeline()
    assert state.is_failed() or state.is_crashed(), state
    assert "the test's build failed" in state.message, state.message
    assert [reason for _, reason, _ in model.events] == ["TriggeredScaleUp"], "the placeholder had asked for a node"
    assert not _placeholders(kube)


def test_a_cancelled_call_leaves_no_placeholder(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler, slow_build
):
    """The task's timeout (8 s) cancels the call during a 60-s build, after its placeholder asked for a node: the
    call ends at its timeout, without waiting for the build, and its placeholder is gone. ~10 s: the timeout has to
    pass."""
    model = gke_autoscaler([NodePool("t4-pool", "t4")], verdict_seconds=1, provisioning_seconds=60)
    slow_build(60)
    pool = _pool(kube, gcs_bucket, local_registry)
    name = f"cancel-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="t4", timeout_seconds=8)
    def hello() -> str:
        return "ok"

    @flow
    def pipeline():
        return hello(return_state=True), "the flow went on"

    started = time.monotonic()
    state, _ = pipeline()
    assert not state.is_completed(), state
    assert time.monotonic() - started < 30, "the cancel waited for the build"
    assert [reason for _, reason, _ in model.events] == ["TriggeredScaleUp"], "the placeholder had asked for a node"
    assert not _placeholders(kube)


CTRL_C_SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as from a terminal, even under `cmd &`
from kinetic_prefect.shared import builders

def ensure(self, spec, log=print):
    time.sleep(120)

builders.DockerBuilder.ensure = ensure
from prefect import flow
from kinetic_prefect import kinetic_task

@kinetic_task(name=sys.argv[1], work_pool=sys.argv[2], base_image=sys.argv[3], accelerator="t4",
              env=["STORAGE_EMULATOR_HOST"])
def hello():
    return 1

@flow
def pipeline():
    return hello()

pipeline()
"""


def test_ctrl_c_during_the_build_leaves_no_placeholder(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler, tmp_path
):
    """A script is interrupted (SIGINT) while its image builds and its placeholder exists: the script ends and no
    placeholder is left. ~20 s: the script's own start (Prefect's imports) and its placeholder's first 2 s."""
    gke_autoscaler([NodePool("t4-pool", "t4")], verdict_seconds=1, provisioning_seconds=60)
    pool = _pool(kube, gcs_bucket, local_registry)
    script = tmp_path / "cold.py"
    script.write_text(textwrap.dedent(CTRL_C_SCRIPT))
    name = f"ctrlc-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen([sys.executable, str(script), name, pool, python_base_image], text=True)
    try:
        deadline = time.monotonic() + 90
        while not _placeholders(kube):
            assert time.monotonic() < deadline and proc.poll() is None, "the placeholder was never made"
            time.sleep(0.3)
        proc.send_signal(subprocess.signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not _placeholders(kube)


def test_a_call_on_a_warm_pod_says_so_in_its_timeline(
    kube, gcs_bucket, local_registry, job_image, python_base_image, slow_build
):
    """Two calls on a pool that keeps pods warm: the second one's start-up timeline says it reused the first one's
    pod (no node, no pull, no container start of its own) and still times its image and its first line. ~15 s: two
    calls, the first one starting its pod."""
    slow_build(0)  # the job image, found (or built as the fixture builds it)
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke-warm-timeline", local_registry, keep_warm_seconds=30)
    name = f"warm-line-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="cpu")
    def step() -> str:
        print("a line from the warm pod")
        return os.environ.get("KINETIC_WARM_CONTROL", "")

    @flow
    def twice():
        return step(return_state=True), step(return_state=True)

    first, second = twice()
    assert first.result() == second.result() != "", "both calls ran on one warm pod"
    [job_run] = jobs_of(second.state_details.task_run_id)
    deadline = time.monotonic() + 20
    while not (found := _startup_rows(str(job_run.id))) and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = {row["step"]: row for row in found}
    assert rows["node ready"]["note"].startswith("reused warm pod default/"), rows
    assert rows["container started"]["note"] == rows["node ready"]["note"], rows
    assert rows["image ready"]["after"] != "—" and rows["first line"]["after"] != "—", rows


def test_prebuilt_mode_installs_the_requirements_as_the_pod_starts(
    kube, gcs_bucket, local_registry, job_image, python_base_image, slow_build
):
    """Kinetic's prebuilt mode (install_requirements_at_start): the call runs in the runner-only image (the one a call
    without requirements gets: nothing is built for its requirements) and imports what its pod installed as it
    started. ~15 s: a pip install from the index in the pod."""
    from kinetic_prefect.shared.builders import image_name
    from kinetic_prefect.shared.image import ImageSpec

    slow_build(0)  # found, or built as the job_image fixture builds it (the machine's proxy CA in the image)
    pool = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke-prebuilt", local_registry, install_requirements_at_start=True
    )
    name = f"prebuilt-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, pool, python_base_image, accelerator="cpu", requirements=["tabulate==0.9.0"])
    def table() -> str:
        import tabulate

        return tabulate.__version__

    @flow
    def pipeline():
        return table(return_state=True)

    state = pipeline()
    assert state.result() == "0.9.0", state.message
    [job_run] = jobs_of(state.state_details.task_run_id)
    [job] = (
        k8s.BatchV1Api(kube.api())
        .list_namespaced_job("default", label_selector=f"prefect.io/flow-run-id={job_run.id}")
        .items
    )
    runner_only = ImageSpec.create(None, family="cpu", base_image=python_base_image)
    assert job.spec.template.spec.containers[0].image == image_name(f"{local_registry}/kinetic-tests", runner_only)
