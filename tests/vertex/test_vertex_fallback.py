"""A fallback list that crosses pools: GKE spot L4 first, Vertex L4 second. The GKE pool runs on the real control plane
(tests/support/kube_cluster.py), whose only L4 node is not a spot node, so the scheduler cannot place a spot L4 pod
(the GKE model of a stockout); the call then runs on the kinetic-vertex pool against the Vertex stand-in."""

from __future__ import annotations

import os
import uuid

import pytest
from docker_fixture import proxy_files
from google.cloud.aiplatform_v1 import types as vertex
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect_kubernetes.credentials import KubernetesClusterConfig
from vertex_stand_in import VertexStandIn

from kinetic_prefect import kinetic_task
from kinetic_prefect.workers.gke.worker import KineticGKEWorker
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpu_image(local_registry, python_base_image):
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    spec = ImageSpec.create(None, family="gpu", base_image=python_base_image)
    DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
        spec, log=lambda line: None
    )


@pytest.fixture(scope="module")
def stand_in(docker_engine):
    service = VertexStandIn(docker_engine.cli)
    yield service
    service.stop()


def _pool(worker: type, defaults: dict) -> str:
    template = worker.get_default_base_job_template()
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    name = f"{worker.type}-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type=worker.type, base_job_template=template))
    return name


def test_a_gke_spot_l4_that_cannot_be_placed_falls_back_to_a_vertex_l4(
    kube, stand_in, gcs_bucket, local_registry, gpu_image, python_base_image
):
    block = KubernetesClusterConfig(config=kube.plane.kubeconfig_dict(None, None), context_name="kinetic-test")
    builder = {"image_builder": "docker", "image_repository": f"{local_registry}/kinetic-tests", "poll_seconds": 0.3}
    gke = _pool(
        KineticGKEWorker,
        {
            "cluster_config": {"$ref": {"block_document_id": str(block.save(f"kube-{uuid.uuid4().hex[:8]}"))}},
            "store": f"{gcs_bucket}/gke",
            "pod_watch_timeout_seconds": 6,
            **builder,
        },
    )
    vx = _pool(
        KineticVertexWorker,
        {
            "api_endpoint": stand_in.endpoint,
            "logging_endpoint": stand_in.endpoint,
            "gcp_project": stand_in.project,
            "store": f"{gcs_bucket}/vertex",
            **builder,
        },
    )
    name = f"across-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name,
        work_pool=gke,
        accelerator=["l4:spot", f"{vx}/l4"],
        base_image=python_base_image,
        env=["STORAGE_EMULATOR_HOST"],
    )
    def where() -> dict:
        return {"accelerator": os.environ["KINETIC_ACCELERATOR"], "vertex": "CLUSTER_SPEC" in os.environ}

    @flow
    def pipeline():
        return where()

    assert pipeline() == {"accelerator": "l4", "vertex": True}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
        pools = {str(r.work_pool_name): r.state.type.value for r in runs}
    assert pools == {gke: "CRASHED", vx: "COMPLETED"}, "the GKE run says it could not start; the Vertex run ran it"
    [job] = [e.job for e in stand_in.jobs.values() if e.job.labels.get("kinetic-pool") == vx]
    assert job.job_spec.worker_pool_specs[0].machine_spec.accelerator_type == vertex.AcceleratorType.NVIDIA_L4
    assert job.state == vertex.JobState.JOB_STATE_SUCCEEDED
