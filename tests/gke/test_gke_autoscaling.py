"""Fallback lists and preemptions against GKE as it behaves (tests/support/gke_autoscaler.py):
node pools at zero nodes that
the cluster autoscaler scales up in its own time, zones that stock out, Spot VMs reclaimed. The real scheduler and
Job controller decide; the model plays GKE's autoscaler and Compute Engine, with delays of seconds instead of
minutes."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gke_autoscaler import GKEAutoscaler, NodePool
from job_runs import jobs_of
from kubernetes import client as k8s
from prefect import flow
from test_gke_capacity import _run_id, _running_pod, train
from test_gke_cluster import (  # noqa: F401
    _cluster_block,
    _events,
    _gke_task,
    _job_for,
    _make_pool,
    _run_logs,
    _wait,
    job_image,
)

from kinetic_prefect.errors import KineticJobCrashed

pytestmark = pytest.mark.slow


@pytest.fixture
def gke_autoscaler(kube):
    """Start the model with ``gke_autoscaler(pools, **knobs)``; its nodes and status ConfigMap go afterwards."""
    models: list[GKEAutoscaler] = []

    def start(pools: list[NodePool], **knobs) -> GKEAutoscaler:
        models.append(GKEAutoscaler(kube, pools, **knobs).start())
        return models[-1]

    yield start
    for model in models:
        model.stop()


def _where() -> str:
    import os

    return os.environ["KINETIC_ACCELERATOR"]


def _running_on(kube, run_id, nodes: list[str]):
    """The run's pod running on one of ``nodes``, else None."""
    pod = _running_pod(kube, run_id)
    return pod if pod is not None and pod.spec.node_name in nodes else None


def _pod_start(kube, job_run_id) -> tuple[float, str]:
    """When the run's last Job's pod started (status.startTime), and on which node."""
    [job] = _job_for(kube, job_run_id)
    core = k8s.CoreV1Api(kube.api())
    [pod] = core.list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items
    return pod.status.start_time.timestamp(), pod.spec.node_name


def test_a_fallback_list_waits_for_the_preferred_pool_to_scale_up_from_zero(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler
):
    """The t4 pool has no node: the scheduler says no node matches, the autoscaler answers 2 s later with
    TriggeredScaleUp and the node joins 6 s after that, longer than capacity_wait_seconds (2): the job still runs on
    the t4, not on the free l4 of the list's second entry."""
    model = gke_autoscaler([NodePool("t4-pool", "t4")], verdict_seconds=2, provisioning_seconds=6)
    pool = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke", local_registry, capacity_wait_seconds=2, pod_watch_timeout_seconds=60
    )
    name = f"from-zero-{uuid.uuid4().hex[:6]}"
    where = _gke_task(name, pool, python_base_image, accelerator=["t4", "l4"])(_where)

    @flow
    def pipeline():
        return where(return_state=True)

    state = pipeline()
    assert state.result() == "t4", state.message
    [job_run] = jobs_of(state.state_details.task_run_id)
    started_at, node = _pod_start(kube, job_run.id)
    assert node in model.pool("t4-pool").nodes
    reasons = [reason for _, reason, _ in model.events]
    assert reasons[0] == "TriggeredScaleUp" and "NotTriggerScaleUp" not in reasons, model.events
    assert "0->1 (max: 3)" in model.events[0][2]
    waited = started_at - job_run.created.timestamp()
    print(f"\nscale-from-zero: submission to the preferred t4 pod started: {waited:.1f}s")


def test_a_stocked_out_pool_is_left_after_the_capacity_wait(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler
):
    """The h100 pool can scale up but its zone has no VM: the autoscaler triggers a scale-up, GCE fails it 2 s later
    (FailedScaleUp: out of resources), and the worker tries the l4 once capacity_wait_seconds (3) of no capacity
    have passed, the scale-up's seconds not counted; the run says why it left the h100."""
    model = gke_autoscaler([NodePool("h100-pool", "h100", stocked_out=True)], verdict_seconds=1, failure_seconds=2)
    pool = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke", local_registry, capacity_wait_seconds=3, pod_watch_timeout_seconds=60
    )
    name = f"stockout-{uuid.uuid4().hex[:6]}"
    where = _gke_task(name, pool, python_base_image, accelerator=["h100", "l4"])(_where)

    @flow
    def pipeline():
        return where(return_state=True)

    started = time.time()
    state = pipeline()
    assert state.result() == "l4", state.message
    assert "after h100 (no capacity for" in state.message, state.message
    reasons = [reason for _, reason, _ in model.events]
    assert reasons[:2] == ["TriggeredScaleUp", "FailedScaleUp"], model.events
    assert "GCE out of resources" in model.events[1][2]
    [job_run] = jobs_of(state.state_details.task_run_id)
    [fallback] = [
        e
        for e in _events("kinetic.job.fallback", started, until=lambda found: len(found) >= 1)
        if e.resource.id.endswith(str(job_run.id))
    ]
    moved_after = fallback.occurred.timestamp() - job_run.created.timestamp()
    # the capacity wait, plus the failed scale-up's 2 s that it does not count (half a second for the polls)
    assert moved_after >= 3 + 2 - 0.5, moved_after
    started_at, node = _pod_start(kube, job_run.id)
    assert node == "gke-l4-pool-1"
    print(
        f"\nstockout: submission to the fallback {moved_after:.1f}s, "
        f"to the l4 pod started {started_at - job_run.created.timestamp():.1f}s"
    )


def test_a_stockout_that_outlasts_the_pod_watch_timeout_says_what_happened(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler
):
    """One accelerator, its pool stocked out: the autoscaler triggers a scale-up, GCE fails it, the group is backed
    off, and after pod_watch_timeout_seconds the run crashes saying the scale-up failed for want of resources (a
    stockout) and what to do, not that no node pool has the accelerator."""
    gke_autoscaler([NodePool("h100-pool", "h100", stocked_out=True)], verdict_seconds=1, failure_seconds=1)
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry, pod_watch_timeout_seconds=5)
    where = _gke_task(f"stockout-timeout-{uuid.uuid4().hex[:6]}", pool, python_base_image, accelerator="h100")(_where)

    @flow
    def pipeline():
        return where()

    with pytest.raises(KineticJobCrashed) as raised:
        pipeline()
    message = str(raised.value)
    assert "FailedScaleUp" in message and "GCE out of resources" in message, message
    assert "scale-up failed" in message and "stockout" in message and "fallback list" in message, message
    assert "no node pool has this accelerator" not in message, message


def test_a_preempted_job_moves_down_the_list_when_its_spot_capacity_is_gone(
    kube, gcs_bucket, local_registry, job_image, python_base_image, gke_autoscaler
):
    """A job on the one node of a t4 Spot pool is reclaimed and the zone has no Spot t4 left: the retry's pod
    cannot be placed (the autoscaler's scale-up fails), so after capacity_wait_seconds the retry moves to the list's
    next entry, the l4, and resumes from its checkpoint; one preemption, no task retry spent. Takes 40-70 s: two pod
    starts and the 40 steps of the checkpointing body (12 s of it) around the preemption."""
    model = gke_autoscaler(
        [NodePool("t4-spot", "t4", spot=True, min_nodes=1)],
        verdict_seconds=1,
        provisioning_seconds=2,
        failure_seconds=1,
    )
    spot_nodes = list(model.pool("t4-spot").nodes)
    pool = _make_pool(
        _cluster_block(kube), f"{gcs_bucket}/gke", local_registry, capacity_wait_seconds=2, pod_watch_timeout_seconds=30
    )
    name = f"spot-down-{uuid.uuid4().hex[:6]}"
    task = _gke_task(name, pool, python_base_image, accelerator=["t4:spot", "l4"], retries=0, preemption_retries=2)(
        train
    )

    @flow
    def pipeline():
        return task(40, return_state=True)

    reclaimed: list[str] = []

    def reclaim_once() -> None:
        run_id = _wait(lambda: _run_id(name), 120, "no job run")
        pod = _wait(lambda: _running_on(kube, run_id, spot_nodes), 180, "the job never ran on the t4 Spot node")
        _run_logs(run_id, "progress", 120)  # the body has begun its steps (a slow start would leave none to resume)
        time.sleep(2)  # some steps in, checkpointed
        model.stock_out("t4-spot")
        reclaimed.append(pod.spec.node_name)
        model.reclaim(pod.spec.node_name)

    reclaimer = threading.Thread(target=reclaim_once, daemon=True)
    reclaimer.start()
    state = pipeline()
    reclaimer.join(5)
    assert reclaimed == spot_nodes, reclaimed
    assert [r for _, r, _ in model.events][:2] == ["TriggeredScaleUp", "FailedScaleUp"], model.events
    value = state.result()
    assert value["start"] > 0 and value["preemptions"] == "1", value
    assert state.message.startswith("ran on l4; after t4:spot (no capacity for"), state.message
    assert "preempted 1×" in state.message, state.message
    [job_run] = jobs_of(state.state_details.task_run_id)
    _, node = _pod_start(kube, job_run.id)
    assert node == "gke-l4-pool-1"


class FakeGKEApi:
    """The GKE API's nodePools.list over REST, as much as doctor calls: it answers with the node pools it was given
    (real container_v1 protos, as JSON) and records each request's path."""

    def __init__(self, node_pools: list) -> None:
        from google.cloud import container_v1

        self.paths: list[str] = []
        body = container_v1.ListNodePoolsResponse.to_json(container_v1.ListNodePoolsResponse(node_pools=node_pools))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.paths.append(self.path.split("?")[0])
                found = self.path.split("?")[0].endswith("/nodePools")
                data = body.encode() if found else json.dumps({"error": {"code": 404, "message": "no"}}).encode()
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self):
        """The real ClusterManagerClient (REST transport) pointed at this fake."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import container_v1

        return container_v1.ClusterManagerClient(
            transport="rest", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.endpoint}
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_doctor_reads_node_pools_as_gke_has_them(kube, gcs_bucket, gke_autoscaler, monkeypatch, capsys):
    """The accelerator pools are at zero nodes, as GKE makes them: the t4 pool scales from zero (passes), the h100
    pool is backed off after a stockout (a warning naming it), the v100 pool does not autoscale (fails, naming the
    command that turns autoscaling on), no pool has an a100 (fails, naming `pool add` for this cluster); the l4
    pool's node is up. The node pools come from the GKE API (at the client boundary: a fake of its REST endpoint,
    asked through the real client), their nodes and the autoscaler's state from the control plane."""
    from kube_cluster import kubeconfig
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from kinetic_prefect.cli import main
    from kinetic_prefect.workers.gke import doctor

    model = gke_autoscaler(
        [NodePool("t4-pool", "t4"), NodePool("h100-pool", "h100"), NodePool("v100-pool", "v100", autoscaling=False)]
    )
    model.back_off("h100-pool")
    fixed_l4 = NodePool("l4-pool", "l4", min_nodes=1, max_nodes=1, autoscaling=False)  # the session's node
    gke = FakeGKEApi([p.gke_node_pool() for p in [*model.pools, fixed_l4]])
    monkeypatch.setattr(doctor, "gke_node_pools_client", gke.client)
    context = "gke_kinetic-test_us-central1-a_kinetic-cluster"  # what `gcloud ... get-credentials` names it
    plane = kube.plane
    block = KubernetesClusterConfig(
        config=kubeconfig(plane.server, plane.ca_file, plane.admin_token, context), context_name=context
    )
    pool = _make_pool(
        str(block.save(f"kube-{uuid.uuid4().hex[:8]}")), f"{gcs_bucket}/gke", "registry.invalid", image="job:1"
    )
    capsys.readouterr()
    try:
        code = main(
            [
                "doctor",
                "--json",
                "--pool",
                pool,
                *[arg for name in ("t4", "h100", "v100", "a100", "l4") for arg in ("-a", name)],
            ]
        )
    finally:
        gke.close()
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert gke.paths == ["/v1/projects/kinetic-test/locations/us-central1-a/clusters/kinetic-cluster/nodePools"]
    assert code == 1
    t4 = checks["Node pool for t4"]
    assert t4["status"] == "ok", t4
    assert "t4-pool is at 0 nodes and scales from zero (autoscaling 0-3 nodes)" in t4["detail"]
    h100 = checks["Node pool for h100"]
    assert h100["status"] == "warn" and "backed it off" in h100["detail"], h100
    assert "OUT_OF_RESOURCES" in h100["detail"] and "fallback list" in h100["fix"]
    v100 = checks["Node pool for v100"]
    assert v100["status"] == "fail" and "v100-pool has v100 but no node, and it does not autoscale" in v100["detail"]
    assert (
        "gcloud container clusters update kinetic-cluster --location us-central1-a --project kinetic-test "
        "--node-pool v100-pool --enable-autoscaling" in v100["fix"]
    )
    a100 = checks["Node pool for a100"]
    assert a100["status"] == "fail" and "no node pool of kinetic-cluster has a100" in a100["detail"], a100
    assert (
        "kinetic-prefect pool add a100 --project kinetic-test --zone us-central1-a --cluster kinetic-cluster"
        in (a100["fix"])
    )
    assert checks["Node pool for l4"]["status"] == "ok"
    assert checks["Node pool for l4"]["detail"].startswith("node pool l4-pool: 1 node(s) up"), checks


def test_doctor_reads_node_pools_of_the_gke_cluster_it_is_given_whatever_the_context_is_named(
    kube, gcs_bucket, gke_autoscaler, monkeypatch, capsys
):
    """A kube context not named gke_P_L_C (a renamed context, a kubeconfig of one's own): `--gke-cluster
    projects/P/locations/L/clusters/C` says which cluster's node pools the GKE API is asked for, so a pool at zero
    nodes that scales from zero passes instead of reading as missing."""
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from kinetic_prefect.cli import main
    from kinetic_prefect.workers.gke import doctor

    model = gke_autoscaler([NodePool("t4-pool", "t4")])
    gke = FakeGKEApi([p.gke_node_pool() for p in model.pools])
    monkeypatch.setattr(doctor, "gke_node_pools_client", gke.client)
    block = KubernetesClusterConfig(config=kube.plane.kubeconfig_dict(), context_name="kinetic-test")
    pool = _make_pool(
        str(block.save(f"kube-{uuid.uuid4().hex[:8]}")), f"{gcs_bucket}/gke", "registry.invalid", image="job:1"
    )
    path = "projects/kinetic-test/locations/us-central1-a/clusters/kinetic-cluster"
    capsys.readouterr()
    try:
        main(["doctor", "--json", "--pool", pool, "-a", "t4", "--gke-cluster", path])
    finally:
        gke.close()
    report = json.loads(capsys.readouterr().out)
    t4 = {c["name"]: c for c in report["checks"]}["Node pool for t4"]
    assert gke.paths == [f"/v1/{path}/nodePools"]
    assert t4["status"] == "ok" and "t4-pool is at 0 nodes and scales from zero" in t4["detail"], t4
