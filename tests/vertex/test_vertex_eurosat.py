"""The EuroSAT flow (flows/eurosat_vit.py) with its training job on a kinetic-vertex pool against the Vertex stand-in:
fetch, decode and split run in the flow; ``train`` runs as a custom job in the job image (keras and jax at the
caller's versions, built ahead through this machine's proxy), reads its data from the store (fake-gcs-server) and
sends its outputs back; evaluate and publish run in the flow again. The tiny model, 2 epochs, the 1,000-image
sample, as tests/pipelines/test_eurosat.py runs it on kinetic-local."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from docker_fixture import proxy_files
from google.cloud.aiplatform_v1 import types as vertex
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from vertex_stand_in import VertexStandIn

from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"
SAMPLE_SHA256 = "sha256:cd456252984ad18bd9a748a94e2c3fec0e102ebe98c835dabd9eae3606b2984d"
# The caller's versions: the job unpickles what the caller pickled
ML_REQUIREMENTS = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "keras==3.15.1",
    "numpy==2.4.6",
    "pillow==13.0.0",
    "scikit-learn==1.9.1",
    "matplotlib==3.11.2",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SAMPLE_ZIP.is_file(), reason=f"{SAMPLE_ZIP} is absent (the CI machine only)"),
]


@pytest.fixture(scope="module")
def ml_image(local_registry, python_base_image) -> str:
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    spec = ImageSpec.create(ML_REQUIREMENTS, family="cpu", base_image=python_base_image)
    builder = DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files())
    return builder.ensure(spec, log=lambda line: None)


@pytest.fixture(scope="module")
def stand_in(docker_engine):
    service = VertexStandIn(docker_engine.cli)
    yield service
    service.stop()


def _vertex_pool(stand_in: VertexStandIn, gcs_bucket: str, image: str, monkeypatch) -> str:
    """A kinetic-vertex pool running ``image``, made the default pool of this test's calls (KINETIC_WORK_POOL)."""
    from prefect.client.schemas.actions import WorkPoolCreate

    template = KineticVertexWorker.get_default_base_job_template()
    defaults = {
        "api_endpoint": stand_in.endpoint,
        "logging_endpoint": stand_in.endpoint,
        "gcp_project": stand_in.project,
        "image": image,
        "store": f"{gcs_bucket}/vertex",
        "poll_seconds": 0.5,
        "env": {"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"], "KERAS_BACKEND": "jax"},
    }
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    pool = f"vertex-flows-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="kinetic-vertex", base_job_template=template))
    monkeypatch.setenv("KINETIC_WORK_POOL", pool)
    return pool


def test_hello_kinetic_runs_on_a_vertex_pool(stand_in, gcs_bucket, ml_image, monkeypatch):
    pool = _vertex_pool(stand_in, gcs_bucket, ml_image, monkeypatch)
    sys.path.insert(0, str(ROOT / "flows"))
    import hello_kinetic

    result = hello_kinetic.pipeline(epochs=3)
    assert result["loss"] == 0.125 and result["pid"] != os.getpid()
    [job] = [e.job for e in stand_in.jobs.values() if e.job.labels.get("kinetic-pool") == pool]
    assert job.state == vertex.JobState.JOB_STATE_SUCCEEDED


def test_the_eurosat_flow_trains_on_a_vertex_pool(stand_in, gcs_bucket, ml_image, tmp_path, monkeypatch):
    pool = _vertex_pool(stand_in, gcs_bucket, ml_image, monkeypatch)
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    sys.path.insert(0, str(ROOT / "flows"))
    import eurosat_vit

    out = tmp_path / "out"
    state = eurosat_vit.eurosat_vit(
        return_state=True,
        source=str(SAMPLE_ZIP),
        checksum=SAMPLE_SHA256,
        epochs=2,
        cache_dir=str(tmp_path / "cache"),
        output_dir=str(out),
        model_size="tiny",
        batch_size=64,
        tta=True,
    )
    result = state.result()
    assert result["split_sizes"] == {"train": 800, "val": 100, "test": 100}
    assert result["epochs_run"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    assert (out / "eurosat_vit.keras").stat().st_size > 0, "the model came back from the job's outputs"
    [job] = [e for e in stand_in.jobs.values() if e.job.labels.get("kinetic-pool") == pool]
    assert job.job.state == vertex.JobState.JOB_STATE_SUCCEEDED
    assert job.job.job_spec.worker_pool_specs[0].container_spec.image_uri == ml_image
    run_id = job.job.labels["kinetic-flow-run"]
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
    assert any("epoch 2/2" in log.message for log in logs), "the job's per-epoch lines reached the run"
