"""Capacity on kinetic-gke against the real control plane (tests/support/kube_cluster.py) with fake GKE nodes: the real
scheduler says a job cannot be placed, the real Job controller applies the podFailurePolicy, the kubelet stand-in
shuts a spot node down as a kubelet does (DisruptionTarget, SIGTERM, Failed) or OOM-kills a container."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

import pytest
from job_runs import jobs_of
from kubernetes import client as k8s
from prefect import flow, get_client
from test_gke_cluster import (  # noqa: F401
    _cluster_block,
    _events,
    _gke_task,
    _job_for,
    _job_runs,
    _make_pool,
    _wait,
    job_image,
)

from kinetic_prefect.errors import KineticJobCrashed

pytestmark = pytest.mark.slow

SPOT_NODES = ("gke-l4-spot-1", "gke-l4-spot-2")
STEPS = 40


@pytest.fixture
def spot_nodes(kube):
    """Two L4 Spot nodes, labelled and tainted as GKE makes them; whatever is left is removed afterwards."""
    core = k8s.CoreV1Api(kube.api())
    for name in SPOT_NODES:
        kube.plane.add_node(
            name,
            {
                "cloud.google.com/gke-accelerator": "nvidia-l4",
                "cloud.google.com/gke-spot": "true",
                "cloud.google.com/gke-nodepool": "l4-spot",
            },
            {"nvidia.com/gpu": "1"},
            [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"},
            ],
            kubelet_port=kube.kubelet.port,
        )
        kube.kubelet.nodes.add(name)
    yield SPOT_NODES
    for name in SPOT_NODES:
        kube.kubelet.nodes.discard(name)
        with contextlib.suppress(k8s.exceptions.ApiException):
            core.delete_node(name)


def _running_pod(kube, run_id, exclude_nodes=()):
    core = k8s.CoreV1Api(kube.api())
    for job in _job_for(kube, run_id):
        for pod in core.list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}").items:
            if pod.status.phase == "Running" and pod.spec.node_name not in exclude_nodes:
                return pod
    return None


def _run_id(name: str):
    with get_client(sync_client=True) as c:
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName

        runs = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    return runs[0].id if runs else None


def test_a_fallback_list_moves_on_when_the_cluster_cannot_place_the_job(
    kube, gcs_bucket, local_registry, job_image, python_base_image
):
    pool = _make_pool(
        _cluster_block(kube),
        f"{gcs_bucket}/gke",
        local_registry,
        capacity_wait_seconds=4,
        pod_watch_timeout_seconds=120,
    )
    name = f"fallback-{uuid.uuid4().hex[:6]}"

    # a100: no node pool carries it (at once); l4: its node is full (after the capacity wait); then the v5e TPU
    @_gke_task(name, pool, python_base_image, accelerator=["a100", "l4", "tpu-v5litepod-1"])
    def where() -> dict:
        return {k: os.environ[k] for k in ("KINETIC_ACCELERATOR", "KINETIC_ACCELERATOR_CHIPS", "JAX_PLATFORMS")}

    @flow
    def pipeline():
        return where(return_state=True)

    core = k8s.CoreV1Api(kube.api())
    full = {"status": {"capacity": {"nvidia.com/gpu": "0"}, "allocatable": {"nvidia.com/gpu": "0"}}}
    core.patch_node_status("gke-l4-pool-1", full)  # its one GPU taken
    started = time.time()
    try:
        state = pipeline()
    finally:
        core.patch_node_status(
            "gke-l4-pool-1", {"status": {"capacity": {"nvidia.com/gpu": "1"}, "allocatable": {"nvidia.com/gpu": "1"}}}
        )
    assert state.result() == {
        "KINETIC_ACCELERATOR": "tpu-v5litepod-1",
        "KINETIC_ACCELERATOR_CHIPS": "1",
        "JAX_PLATFORMS": "tpu",
    }
    assert state.message.startswith("ran on tpu-v5litepod-1; after a100 (no node pool has it), l4 (no capacity for")
    [job_run] = jobs_of(state.state_details.task_run_id)
    assert "ran on tpu-v5litepod-1" in job_run.state.message

    def tried(found) -> list:
        return sorted(e.payload["tried"] for e in found if e.resource.id.endswith(str(job_run.id)))

    fallbacks = _events("kinetic.job.fallback", started, until=lambda found: len(tried(found)) >= 2)
    assert tried(fallbacks) == ["a100", "l4"]
    # the cost record lists the attempts; the two never placed started no pod and cost nothing
    from test_cost import JOB_COST_ARTIFACT_KEY, artifacts, table

    total, *attempts = table(artifacts(job_run.id, JOB_COST_ARTIFACT_KEY)[-1])
    assert [(a["accelerator"], a["hosts"], a["usd"]) for a in attempts[:2]] == [("a100", 0, 0.0), ("l4", 0, 0.0)]
    assert attempts[2]["accelerator"] == "tpu-v5litepod-1" and attempts[2]["hosts"] == 1 and total["attempts"] == 3
    # priced (built-in TPU price); the pod's startTime and its container's startedAt both known: pending apart
    assert total["usd"] == attempts[2]["usd"] is not None and attempts[2]["pending_minutes"] is not None
    [job] = _job_for(kube, job_run.id)  # the attempts that could not be placed were deleted
    assert (
        job.metadata.name.endswith("-a3") and job.metadata.labels["kinetic.prefect.io/accelerator"] == "tpu-v5litepod-1"
    )


def train(steps: int) -> dict:
    import json
    import os
    import time
    from pathlib import Path

    checkpoint = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "step.txt"
    start = int(checkpoint.read_text()) if checkpoint.exists() else 0
    for step in range(start, steps):
        time.sleep(0.3)
        checkpoint.write_text(str(step + 1))
        print("[kinetic:progress] " + json.dumps({"done": step + 1, "total": steps}), flush=True)
    return {"start": start, "preemptions": os.environ["KINETIC_PREEMPTIONS"]}


def test_spot_preemptions_resume_from_the_checkpoint_without_spending_retries(
    kube, gcs_bucket, local_registry, job_image, python_base_image, spot_nodes
):
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry, pod_watch_timeout_seconds=120)
    name = f"spot-{uuid.uuid4().hex[:6]}"
    task = _gke_task(
        name, pool, python_base_image, accelerator="l4:spot", retries=0, preemption_retries=2, spot_fallback=True
    )(train)

    @flow
    def pipeline():
        return task(STEPS, return_state=True)

    shut: list[str] = []

    def preempt_twice() -> None:
        for _ in range(2):
            run_id = _wait(lambda: _run_id(name), 120, "no job run")
            pod = _wait(lambda: _running_pod(kube, run_id, shut), 180, "the spot pod never ran")  # noqa: B023
            time.sleep(4)  # some steps in, checkpointed
            shut.append(pod.spec.node_name)
            kube.kubelet.shut_down_node(pod.spec.node_name)

    preempter = threading.Thread(target=preempt_twice, daemon=True)
    preempter.start()
    state = pipeline()
    preempter.join(5)
    assert sorted(shut) == list(SPOT_NODES)
    value = state.result()
    assert value["start"] > 0 and value["preemptions"] == "2", value
    assert "preempted 2×, resumed from step" in state.message, state.message
    with get_client(sync_client=True) as c:
        assert c.read_task_run(state.state_details.task_run_id).run_count == 1  # retries=0 untouched
    [job_run] = jobs_of(state.state_details.task_run_id)
    [job] = _job_for(kube, job_run.id)
    pods = k8s.CoreV1Api(kube.api()).list_namespaced_pod("default", label_selector=f"job-name={job.metadata.name}")
    assert [p.spec.node_name for p in pods.items] == ["gke-l4-pool-1"], "spot_fallback: the last attempt on-demand"
    assert len(_events("kinetic.job.preempted", job_run.created.timestamp(), until=lambda f: len(f) >= 2)) >= 2


def test_a_failing_body_and_an_oom_kill_are_not_preemptions(
    kube, gcs_bucket, local_registry, job_image, python_base_image, spot_nodes
):
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke", local_registry, pod_watch_timeout_seconds=120)
    failing, hungry = f"raises-{uuid.uuid4().hex[:6]}", f"oom-{uuid.uuid4().hex[:6]}"

    @_gke_task(failing, pool, python_base_image, accelerator="l4:spot")
    def raises() -> None:
        raise ValueError("the body's own bug")

    @_gke_task(hungry, pool, python_base_image, accelerator="l4:spot")
    def sleeps() -> None:
        import time

        time.sleep(120)

    @flow
    def pipeline(which):
        return which()

    def oom_when_running() -> None:
        run_id = _wait(lambda: _run_id(hungry), 240, "no job run")
        pod = _wait(lambda: _running_pod(kube, run_id), 180, "the pod never ran")
        time.sleep(2)
        kube.kubelet.oom_kill("default", pod.metadata.name)

    with pytest.raises(ValueError, match="the body's own bug"):
        pipeline(raises)
    threading.Thread(target=oom_when_running, daemon=True).start()
    with pytest.raises(KineticJobCrashed, match="OOMKilled|137"):
        pipeline(sleeps)
    for name in (failing, hungry):
        [job_run] = _job_runs(name)  # one run, one Job: neither was retried as a preemption
        assert "preempted" not in (job_run.state.message or ""), job_run.state.message
        [job] = _job_for(kube, job_run.id)
        assert not job.metadata.name.endswith("-a2")


@pytest.mark.parametrize(
    "variables",
    [
        {"reservation": "a3-reservation", "reservation_project": "shared-project"},
        {"flex_start": True},
        {"queued_provisioning": "dws-local-queue"},
        {"spot": True},
    ],
    ids=["reservation", "flex-start", "queued", "spot"],
)
def test_the_capacity_documents_pass_the_api_servers_dry_run(kube, variables):
    """The real API server (its validation and admission) accepts each capacity rendering of a Job, podFailurePolicy
    included; nothing is stored (dryRun=All)."""
    from test_gke_manifests import render

    manifest = render("h100x8", **variables).job_manifest
    created = k8s.BatchV1Api(kube.api()).create_namespaced_job(
        manifest["metadata"]["namespace"], manifest, dry_run="All"
    )
    assert created.spec.pod_failure_policy.rules[0].on_pod_conditions[0].type == "DisruptionTarget"
    assert created.spec.suspend is bool(variables.get("queued_provisioning"))
