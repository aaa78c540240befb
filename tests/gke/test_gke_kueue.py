"""Queued provisioning on kinetic-gke through real Kueue (tests/support/kueue_cluster.py) on the control plane of
the tests.

Real here: Kueue's manager v0.17.0 (its Job webhook, its Workloads, its scheduler deciding admission against a
ClusterQueue's quota per ResourceFlavor, unsuspending the Job), the Kubernetes control plane, the job's pod run by
the Docker kubelet on a flex-start L4 node labelled and tainted as GKE makes them. Not here: GKE's ProvisioningRequest
admission check and the cluster autoscaler behind it (queued provisioning proper, "DWS"): Kueue admits on quota alone,
as it does for a ClusterQueue without that AdmissionCheck. Kueue's start (≈ 6 s: certificates, CRDs, the manager
ready, its webhooks) is shared by the module; the two tests take ≈ 13 s and ≈ 4 s.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
from background import call_in_background
from kubernetes import client as k8s
from kueue_cluster import API, GROUP, QUEUE_LABEL, Kueue, kueue_dir, set_up_queues
from prefect import flow, get_client
from prefect.states import Cancelling
from test_gke_cluster import (  # noqa: F401
    _cluster_block,
    _gke_task,
    _job_for,
    _job_runs,
    _make_pool,
    _run_logs,
    _wait,
    job_image,
)

from kinetic_prefect.errors import KineticJobCancelled

pytestmark = pytest.mark.slow

CLUSTER_QUEUE, LOCAL_QUEUE = "dws-cluster-queue", "dws-local-queue"
FLEX_NODE = "gke-l4-flex-1"
# A flex-start node as GKE labels and taints the nodes queued provisioning brings up ("Run a large-scale workload
# with flex-start with queued provisioning": the gke-flex-start label, the cloud.google.com/gke-queued taint).
FLEX_LABELS = {
    "cloud.google.com/gke-accelerator": "nvidia-l4",
    "cloud.google.com/gke-flex-start": "true",
    "cloud.google.com/gke-nodepool": "l4-dws",
}
FLEX_TAINTS = [
    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
    {"key": "cloud.google.com/gke-queued", "value": "true", "effect": "NoSchedule"},
]


@pytest.fixture(scope="module")
def kueue(kube, docker_engine, python_base_image, tmp_path_factory):
    """Kueue running against the session's control plane, one L4 of quota in ClusterQueue dws-cluster-queue behind
    LocalQueue dws-local-queue (the name a pool's ``queued_provisioning`` gives), and one flex-start L4 node."""
    manifests = kueue_dir(build=False)
    if manifests is None:
        message = "Kueue is not built: run `bash tests/support/kube/build_kueue.sh` (≈ 10 min once)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: .ci/run builds it)", pytrace=False)
        pytest.skip(message)
    started = Kueue(kube.plane, tmp_path_factory.mktemp("kueue"), manifests, python_base_image, docker_engine.cli)
    try:
        started.start()
        set_up_queues(kube.api(), CLUSTER_QUEUE, LOCAL_QUEUE, "default", {"nvidia-l4": 1})
        kube.plane.add_node(FLEX_NODE, FLEX_LABELS, {"nvidia.com/gpu": "1"}, FLEX_TAINTS, kube.kubelet.port)
        kube.kubelet.nodes.add(FLEX_NODE)
        yield started
    finally:
        kube.kubelet.nodes.discard(FLEX_NODE)
        with contextlib.suppress(k8s.exceptions.ApiException):
            k8s.CoreV1Api(kube.api()).delete_node(FLEX_NODE)
        for job in _queued_jobs(kube):  # before the manager goes: Kueue holds finalizers on their Workloads
            k8s.BatchV1Api(kube.api()).delete_namespaced_job(
                job.metadata.name, "default", propagation_policy="Background"
            )
        started.stop()


@pytest.fixture
def dws_pool(kube, kueue, gcs_bucket, local_registry, job_image):
    return _make_pool(
        _cluster_block(kube),
        f"{gcs_bucket}/gke",
        local_registry,
        queued_provisioning=LOCAL_QUEUE,
        pod_watch_timeout_seconds=60,
    )


def _queued_jobs(kube):
    return k8s.BatchV1Api(kube.api()).list_namespaced_job("default", label_selector=QUEUE_LABEL).items


def _workloads(kube, job) -> list[dict]:
    custom = k8s.CustomObjectsApi(kube.api())
    found = custom.list_namespaced_custom_object(
        GROUP, API, "default", "workloads", label_selector=f"kueue.x-k8s.io/job-uid={job.metadata.uid}"
    )
    return found["items"]


def _admitted(workload: dict) -> bool:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Admitted" and c["status"] == "True" for c in conditions)


def test_kueue_admits_the_suspended_job_and_the_call_returns_its_value(kube, dws_pool, python_base_image):
    name = f"queued-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, dws_pool, python_base_image, accelerator="l4")
    def where(x: int) -> dict:
        return {"value": 2 * x, "accelerator": os.environ["KINETIC_ACCELERATOR"]}

    @flow
    def pipeline():
        return where(21)

    assert pipeline() == {"value": 42, "accelerator": "l4"}
    [run] = _job_runs(name)
    [job] = _job_for(kube, run.id)
    assert job.metadata.labels[QUEUE_LABEL] == LOCAL_QUEUE and job.spec.suspend is False  # Kueue unsuspended it
    [workload] = _workloads(kube, job)
    assert _admitted(workload), workload.get("status")
    admission = workload["status"]["admission"]
    assert admission["clusterQueue"] == CLUSTER_QUEUE
    assert admission["podSetAssignments"][0]["flavors"]["nvidia.com/gpu"] == "nvidia-l4"
    pods = k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}")
    assert [p.spec.node_name for p in pods.items] == [FLEX_NODE]


def _quota_holder(kube) -> str:
    """A Job in the same queue that Kueue admits first and whose pod no node takes: the queue's one L4 is in use."""
    name = f"holder-{uuid.uuid4().hex[:6]}"
    container = {"name": "c", "image": "unused", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    selector = {"cloud.google.com/gke-accelerator": "nvidia-l4", "kinetic-test/no-such-node": "true"}
    k8s.BatchV1Api(kube.api()).create_namespaced_job(
        "default",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: LOCAL_QUEUE}},
            "spec": {
                "suspend": True,
                "template": {"spec": {"restartPolicy": "Never", "nodeSelector": selector, "containers": [container]}},
            },
        },
    )
    job = k8s.BatchV1Api(kube.api()).read_namespaced_job(name, "default")
    _wait(lambda: any(_admitted(w) for w in _workloads(kube, job)), 30, "Kueue did not admit the quota holder")
    return name


def test_a_job_queued_behind_the_quota_says_so_and_a_cancel_removes_it_and_its_workload(
    kube, dws_pool, python_base_image
):
    holder = _quota_holder(kube)
    name = f"queued-{uuid.uuid4().hex[:6]}"

    @_gke_task(name, dws_pool, python_base_image, accelerator="l4")
    def never_admitted() -> int:
        return 1

    try:
        thread, box = call_in_background(never_admitted)
        run = _wait(lambda: (_job_runs(name) or [None])[0], 60, "no job run")
        # The first look may come before Kueue has written the Workload's conditions ("no word from Kueue yet"); the
        # run says it again when Kueue's reason changes, so wait for Kueue's own words.
        said = _run_logs(run.id, "Pending: couldn't assign flavors", timeout=60)
        assert f"queued in Kueue ClusterQueue {CLUSTER_QUEUE}" in said, said
        [job] = _job_for(kube, run.id)
        [workload] = _workloads(kube, job)
        # the Workload's own words: QuotaReserved False, "couldn't assign flavors ... insufficient unused quota"
        assert f"(Workload {workload['metadata']['name']}: Pending: couldn't assign flavors" in said, said
        assert "insufficient unused quota for nvidia.com/gpu in flavor nvidia-l4" in said, said
        assert job.spec.suspend is True and not _admitted(workload)
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(run.id).state.is_pending()
            client.set_flow_run_state(run.id, Cancelling(), force=True)
        thread.join(60)
        assert not thread.is_alive() and isinstance(box.get("error"), KineticJobCancelled), box
        _wait(lambda: not _job_for(kube, run.id), 30, "the queued Job was not deleted")
        _wait(lambda: not _workloads(kube, job), 30, "its Workload is still there")
    finally:
        k8s.BatchV1Api(kube.api()).delete_namespaced_job(holder, "default", propagation_policy="Background")
