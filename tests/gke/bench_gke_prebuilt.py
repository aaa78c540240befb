"""Benchmark (not collected by default: the name has no ``test_`` prefix): Kinetic's prebuilt mode
(``install_requirements_at_start``: the pod installs the requirements as it starts) against the bundled image (the
default: built once with them), on the control plane of the tests, for the EuroSAT-like requirements of
``tests/shared/bench_job_image.py`` (CPU family).

    eval "$(bash .ci/setup-containers.sh)"
    CI=1 uv run --all-extras pytest -q -s tests/gke/bench_gke_prebuilt.py

Each mode gets a base image labelled afresh (nothing in the registry or Docker's cache) and two calls with the same
requirements: the first pays for the build (bundled) or for the runner-only image's build and the install
(prebuilt); the second finds its image, and in prebuilt mode installs again. Measured: the job run's creation to
the pod's first line in Prefect's logs; written to ``bench/results/gke_prebuilt.json``.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from bench_gke_cold_start import FIRST_LINE, _first_line_at
from docker_fixture import proxy_files
from job_runs import jobs_of
from prefect import flow
from test_gke_cluster import _cluster_block, _gke_task, _make_pool, job_image  # noqa: F401  (job_image: a fixture)

from kinetic_prefect.shared import builders

RESULTS = Path(__file__).resolve().parents[2] / "bench/results/gke_prebuilt.json"
REQUIREMENTS = ["keras>=3.8", "jax", "pillow"]


def _fresh_base(base_image: str) -> str:
    fresh = f"kinetic-test/python:prebuilt-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["docker", "build", "-q", "--label", f"kinetic.bench={fresh}", "-t", fresh, "-"],
        input=f"FROM {base_image}\n",
        text=True,
        check=True,
        capture_output=True,
    )
    return fresh


def _call(pool: str, base: str) -> float:
    @_gke_task(f"prebuilt-{uuid.uuid4().hex[:6]}", pool, base, accelerator="cpu", requirements=REQUIREMENTS)
    def job() -> str:
        print(FIRST_LINE)
        import keras

        return keras.__version__

    @flow
    def pipeline():
        return job(return_state=True)

    state = pipeline()
    assert state.result(), state.message
    [job_run] = jobs_of(state.state_details.task_run_id)
    return round(_first_line_at(job_run.id) - job_run.created.timestamp(), 1)


@pytest.mark.timeout(1200)  # two builds and two installs of a few hundred MB each
def test_prebuilt_mode_against_the_bundled_image(  # noqa: F811
    kube, gcs_bucket, local_registry, job_image, python_base_image, monkeypatch
):
    real = builders.DockerBuilder.ensure

    def ensure(self, spec, log=print):  # the test machine reaches PyPI through its proxy (docker_fixture)
        return real(builders.DockerBuilder(self.repository, network="host", extra_files=proxy_files()), spec, log)

    monkeypatch.setattr(builders.DockerBuilder, "ensure", ensure)
    result: dict = {}
    for mode, prebuilt in (("bundled", False), ("prebuilt", True)):
        pool = _make_pool(
            _cluster_block(kube), f"{gcs_bucket}/bench-prebuilt", local_registry, install_requirements_at_start=prebuilt
        )
        base = _fresh_base(python_base_image)
        try:
            started = time.monotonic()
            first = _call(pool, base)
            second = _call(pool, base)
            result[mode] = {
                "first_call_submission_to_first_line_seconds": first,
                "second_call_submission_to_first_line_seconds": second,
                "both_calls_wall_seconds": round(time.monotonic() - started, 1),
            }
        finally:
            subprocess.run(["docker", "rmi", base], capture_output=True)
    report = {
        "what": "Kinetic's prebuilt mode (the pod pip-installs the requirements as it starts) against the bundled "
        "image, kinetic-gke on the control plane of the tests (cpu node, Docker pods, pip through the machine's "
        "proxy), two calls each with the same requirements, from a freshly labelled base image",
        "when": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "requirements": REQUIREMENTS,
        **result,
        "command": "CI=1 uv run --all-extras pytest -q -s tests/gke/bench_gke_prebuilt.py",
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
