"""Capacity without a cluster: fallback lists validated at decoration, the plan of attempts, what counts as a
preemption (the pod and Job records Kubernetes writes), and the capacity documents of a kinetic-gke Job (validated
against the Kubernetes schema)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from test_gke_manifests import K8S_VERSION, render

from kinetic_prefect import accelerators, kinetic_task
from kinetic_prefect.shared import capacity
from kinetic_prefect.workers.gke import capacity as gke_capacity

# --------------------------------------------------------------------------- fallback lists


def _noop() -> None:
    """A task body (a lambda would need name=)."""


def test_a_list_resolves_in_order_and_travels_as_one_job_variable():
    specs = capacity.choices(["tpu-v6e-8", "a100x4", "l4x4:spot"])
    assert [capacity.label(s) for s in specs] == ["tpu-v6e-8", "a100x4", "l4x4:spot"]
    assert capacity.choices(capacity.join(specs)) == specs  # the pool variable form: "tpu-v6e-8,a100x4,l4x4:spot"
    assert [capacity.chip_count(s) for s in specs] == [8, 4, 4]


@pytest.mark.parametrize(
    "bad, culprit",
    [
        (["a100x4", "l4x3"], "l4x3"),  # a size that does not exist
        (["a100x4", "nvidia-zz"], "nvidia-zz"),
        (["l4", "gpu"], "twice"),  # gpu is the l4's other spelling
        ([], "at least one"),
    ],
)
def test_a_bad_list_fails_at_decoration_naming_the_culprit(bad, culprit):
    with pytest.raises(ValueError, match=culprit):
        kinetic_task(_noop, accelerator=bad)


def test_multi_host_and_single_host_mix_only_where_hosts_allows():
    with pytest.raises(ValueError, match=r"mixes host counts \(tpu-v5p-16: 2, l4: 1\).*hosts=2"):
        kinetic_task(_noop, accelerator=["tpu-v5p-16", "l4"])
    task = kinetic_task(_noop, accelerator=["tpu-v5p-16", "l4"], hosts=2)  # both run as 2 hosts
    assert [s.name for s in (task.kinetic.accelerator, *task.kinetic.fallbacks)] == ["tpu-v5p-16", "l4"]
    with pytest.raises(ValueError, match="slice of 2 hosts"):
        kinetic_task(_noop, accelerator=["tpu-v5p-16", "l4"], hosts=4)


def test_with_options_takes_a_list_and_keeps_the_capacity_options():
    task = kinetic_task(_noop, accelerator="l4", preemption_retries=1, spot_fallback=True)
    other = task.with_options(accelerator=["a100x4", "l4x4"])
    assert other.kinetic.accelerator.name == "a100x4" and [s.name for s in other.kinetic.fallbacks] == ["l4x4"]
    assert other.kinetic.preemption_retries == 1 and other.kinetic.spot_fallback is True
    with pytest.raises(ValueError, match="preemption_retries=-1"):
        task.with_options(preemption_retries=-1)


def test_job_variables_carry_the_list_and_the_budget():
    from kinetic_prefect.caller.calls import PreparedCall
    from kinetic_prefect.caller.job_settings import build_job_variables
    from kinetic_prefect.contract import RunLayout

    task = kinetic_task(_noop, accelerator=["a100x4", "l4x4:spot"], preemption_retries=2)
    call = PreparedCall(RunLayout("r"), b"", "0" * 64, None, {}, [])
    variables = build_job_variables(task.kinetic, call, "/tmp/store", {"preemption_retries", "spot_fallback"})
    assert variables["accelerator"] == "a100x4,l4x4:spot" and variables["preemption_retries"] == 2
    assert "spot_fallback" not in variables  # not set: the pool's own default stands


# --------------------------------------------------------------------------- the plan


def _plan(names, **kw) -> capacity.CapacityPlan:
    return capacity.CapacityPlan(capacity.choices(names), **kw)


def test_no_node_pool_falls_back_at_once_insufficient_capacity_after_the_wait():
    plan = _plan(["tpu-v6e-8", "a100x4", "l4x4"], capacity_wait_seconds=60)
    assert plan.fallback_after(capacity.NO_NODE_POOL, 0).name == "a100x4"
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, 59) is None
    assert plan.fallback_after(None, 10_000) is None  # pending for no capacity reason (an image pull): wait
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, 61).name == "l4x4"
    assert plan.fallback_after(capacity.NO_NODE_POOL, 0) is None  # the end of the list: today's timeout decides
    assert plan.summary().startswith("ran on l4x4; after tpu-v6e-8 (no node pool has it), a100x4 (no capacity")


def test_a_wait_ended_by_the_pod_watch_says_so_not_a_number_of_seconds():
    """The lifecycle ends every wait at the pod watch (or provisioning) timeout by passing an endless wait: the
    attempt's reason said "no capacity for infs"."""
    plan = _plan(["t4", "l4", "a100"], capacity_wait_seconds=300)
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, float("inf")).name == "l4"
    assert plan.fallback_after(capacity.SCALING_UP, float("inf"), float("inf")).name == "a100"
    summary = plan.summary()
    assert "inf" not in summary, summary
    assert "t4 (no capacity before the pod watch timed out)" in summary, summary
    assert "l4 (the node the autoscaler was adding did not join before the pod watch timed out)" in summary, summary


def test_the_autoscaler_gets_its_verdict_window_and_a_scale_up_its_provisioning_timeout():
    plan = _plan(["t4", "l4", "tpu-v6e-1"], capacity_wait_seconds=30, verdict_seconds=60)
    assert plan.fallback_after(capacity.AWAITING_AUTOSCALER, 59) is None  # a pool at zero may answer yet
    assert plan.fallback_after(capacity.SCALING_UP, 10_000, 899) is None  # a node on its way: not the capacity wait
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, 40, 20) is None  # 20 s without capacity, of 30
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, 60, 20).name == "l4"
    assert plan.summary().startswith("ran on l4; after t4 (no capacity for 40s")
    assert plan.fallback_after(capacity.AWAITING_AUTOSCALER, 61).name == "tpu-v6e-1"
    tpu = _plan(["tpu-v6e-1", "l4"])
    assert tpu.fallback_after(capacity.SCALING_UP, 1000, 1000) is None  # a TPU slice: 1800 s by default
    assert tpu.fallback_after(capacity.SCALING_UP, 1801, 1801).name == "l4"
    assert "did not join in 1801s" in tpu.attempts[0].ended
    gpu = _plan(["t4", "l4"], provisioning_timeout_seconds=120)
    assert gpu.fallback_after(capacity.SCALING_UP, 121, 121).name == "l4"
    assert capacity.provisioning_timeout(accelerators.resolve("t4"), None) == 900


def test_a_preempted_job_can_move_down_the_list_on_its_retry():
    plan = _plan(["t4:spot", "l4"], preemption_retries=2, spot_fallback=True)
    plan.started = True
    assert plan.fallback_after(capacity.NO_NODE_POOL, 0) is None  # running: never
    assert plan.retry_after_preemption("its node shut down").name == "t4"
    assert plan.fallback_after(capacity.INSUFFICIENT_CAPACITY, 301).name == "l4"  # the spot t4s went with the VM
    plan.started = True
    last = plan.retry_after_preemption("again")
    assert last.name == "l4" and not last.spot  # spot_fallback's last attempt on-demand, as before
    assert plan.summary() == "ran on l4; after t4:spot (no capacity for 301s (capacity_wait_seconds=300)); preempted 2×"


def test_never_a_fallback_once_the_job_started():
    plan = _plan(["a100x4", "l4x4"])
    plan.started = True
    assert plan.fallback_after(capacity.NO_NODE_POOL, 0) is None and plan.current.name == "a100x4"


def test_the_preemption_budget_and_spot_fallback_on_the_last_attempt():
    plan = _plan(["l4:spot"], preemption_retries=2, spot_fallback=True)
    plan.started = True
    assert plan.retry_after_preemption("node shut down").spot  # 1 of 2: spot again
    last = plan.retry_after_preemption("node shut down")
    assert last.name == "l4" and not last.spot  # 2 of 2, the last attempt: on-demand
    plan.resumed = "step 1,200"
    assert plan.summary() == "ran on l4; preempted 2×, resumed from step 1,200"
    assert plan.retry_after_preemption("again") is None  # 3 > 2: spent
    assert _plan(["l4:spot"], preemption_retries=0).retry_after_preemption("x") is None


# --------------------------------------------------------------------------- what a preemption is


def _pod(phase="Failed", conditions=(), reason=None, message=None, terminated=None, node="gke-l4-spot-1"):
    status = {"phase": phase, "conditions": list(conditions), "reason": reason, "message": message}
    if terminated:
        status["containerStatuses"] = [{"name": "prefect-job", "state": {"terminated": terminated}}]
    return {"spec": {"nodeName": node}, "status": status}


DISRUPTED = {
    "type": "DisruptionTarget",
    "status": "True",
    "reason": "TerminationByKubelet",
    "message": "Pod was terminated in response to imminent node shutdown.",
}


@pytest.mark.parametrize(
    "pod, node_exists, expected",
    [
        (_pod(conditions=[DISRUPTED], terminated={"exitCode": 0, "reason": "Completed"}), True, "TerminationByKubelet"),
        (_pod(conditions=[{**DISRUPTED, "reason": "DeletionByPodGC"}]), False, "its node was deleted"),
        (_pod(conditions=[{**DISRUPTED, "reason": "EvictionByEvictionAPI"}]), True, "evicted"),
        (
            _pod(reason="Terminated", message="Pod was terminated in response to imminent node shutdown."),
            True,
            "its node shut down",
        ),  # a kubelet older than the DisruptionTarget condition
        (_pod(terminated={"exitCode": 1, "reason": "Error"}), False, "was deleted under it"),  # node gone, no record
        (_pod(terminated={"exitCode": 1, "reason": "Error"}), True, None),  # the body's failure
        (_pod(conditions=[DISRUPTED], terminated={"exitCode": 137, "reason": "OOMKilled"}), True, None),  # OOM
        (_pod(terminated={"exitCode": 137, "reason": "OOMKilled"}), True, None),
    ],
)
def test_a_preemption_is_told_from_a_failure_and_from_an_oom(pod, node_exists, expected):
    found = capacity.pod_disruption(pod, node_exists)
    assert (found is None) if expected is None else (expected in found), found


def test_the_jobs_own_record_of_a_disruption_outlives_the_pod():
    job = {
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "message": "Pod default/x-abc has condition DisruptionTarget matching FailJob rule at index 0",
                }
            ]
        }
    }
    assert "DisruptionTarget" in capacity.job_disruption(job)
    backoff = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
    assert capacity.job_disruption(backoff) is None


def _unschedulable(message: str) -> dict:
    return {
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        }
    }


NO_MATCH = "0/5 nodes are available: 5 node(s) didn't match Pod's node affinity/selector."
TRIGGERED = ("TriggeredScaleUp", "pod triggered scale-up: [{https://www.googleapis.com/.../gke-t4-grp 0->1 (max: 3)}]")
STOCKOUT = (
    "FailedScaleUp",
    "Node scale up in zones us-central1-a associated with this pod failed: GCE out of resources. Pod is at risk of "
    "not being scheduled.",
)
NO_GROUP = ("NotTriggerScaleUp", "pod didn't trigger scale-up: 3 node(s) didn't match Pod's node affinity/selector")
BACKED_OFF = (
    "NotTriggerScaleUp",
    "pod didn't trigger scale-up: 2 node(s) didn't match Pod's node affinity/selector, "
    "1 in backoff after failed scale-up",
)


@pytest.mark.parametrize(
    "message, events, autoscaler, expected",
    [
        (NO_MATCH, [], False, capacity.NO_NODE_POOL),  # no autoscaler in the cluster: nothing will come
        (NO_MATCH, [], True, capacity.AWAITING_AUTOSCALER),  # a pool at zero nodes looks the same until it answers
        (NO_MATCH, [], None, capacity.AWAITING_AUTOSCALER),  # not known whether there is one: wait for a verdict
        (
            "0/5 nodes are available: 1 Insufficient nvidia.com/gpu, 3 node(s) had untolerated taint {google.com/tpu: "
            "present}, 1 node(s) didn't match Pod's node affinity/selector.",
            [],
            None,
            capacity.INSUFFICIENT_CAPACITY,
        ),
        (NO_MATCH, [NO_GROUP], True, capacity.NO_NODE_POOL),
        (NO_MATCH, [TRIGGERED], True, capacity.SCALING_UP),  # a pool at zero, or node auto-provisioning
        (NO_MATCH, [TRIGGERED, STOCKOUT], True, capacity.INSUFFICIENT_CAPACITY),  # the zone has no VM to give
        (NO_MATCH, [TRIGGERED, STOCKOUT, BACKED_OFF], True, capacity.INSUFFICIENT_CAPACITY),  # the pool exists
        (NO_MATCH, [STOCKOUT, TRIGGERED], True, capacity.SCALING_UP),  # the latest verdict stands
        ("", [TRIGGERED], True, None),  # scheduled: what the autoscaler said before no longer applies
    ],
)
def test_what_the_scheduler_and_autoscaler_say_about_capacity(message, events, autoscaler, expected):
    pod = _unschedulable(message) if message else {"status": {"phase": "Pending", "conditions": []}}
    assert gke_capacity.pending_capacity(pod, events, autoscaler) == expected


# --------------------------------------------------------------------------- kinetic-gke documents


def test_every_job_fails_fast_on_disruption_and_is_named_per_attempt():
    configuration = render("l4", spot=True)
    manifest = configuration.job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert manifest["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["type"] == "DisruptionTarget"
    import uuid

    from prefect.client.schemas.objects import FlowRun

    run = FlowRun(id=uuid.uuid4(), name="brave-otter-job1", flow_id=uuid.uuid4())
    second = configuration.render_manifest(accelerators.resolve("l4"), run, attempt=2)
    kubernetes_validate.validate(second, K8S_VERSION, strict=True)
    assert (
        second["metadata"]["name"].endswith("-a2") and second["metadata"]["labels"][gke_capacity.ATTEMPT_LABEL] == "2"
    )
    pod = second["spec"]["template"]["spec"]
    assert "cloud.google.com/gke-spot" not in pod["nodeSelector"]  # re-rendered from the template: on-demand
    assert len(pod["tolerations"]) == len(manifest["spec"]["template"]["spec"]["tolerations"]) - 1


def test_a_reservation_is_consumed_by_the_first_accelerator_only():
    configuration = render("a100x8,l4x4", reservation="a2-res", reservation_project="shared-proj")
    manifest = configuration.job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    selector = manifest["spec"]["template"]["spec"]["nodeSelector"]
    assert selector["cloud.google.com/reservation-name"] == "a2-res"
    assert selector["cloud.google.com/reservation-affinity"] == "specific"
    assert selector["cloud.google.com/reservation-project"] == "shared-proj"
    assert selector["cloud.google.com/gke-accelerator"] == "nvidia-tesla-a100"
    import uuid

    from prefect.client.schemas.objects import FlowRun

    fallback = configuration.render_manifest(
        accelerators.resolve("l4x4"), FlowRun(id=uuid.uuid4(), name="r", flow_id=uuid.uuid4()), 2
    )
    assert "cloud.google.com/reservation-name" not in fallback["spec"]["template"]["spec"]["nodeSelector"]


def test_flex_start_and_queued_provisioning_render_as_gke_documents():
    flex = render("h100x8", flex_start=True).job_manifest
    kubernetes_validate.validate(flex, K8S_VERSION, strict=True)
    assert flex["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-flex-start"] == "true"
    queued = render("h100x8", queued_provisioning="dws-local-queue").job_manifest
    kubernetes_validate.validate(queued, K8S_VERSION, strict=True)
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "dws-local-queue"
    assert queued["spec"]["suspend"] is True
    assert {
        "key": "cloud.google.com/gke-queued",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    } in queued["spec"]["template"]["spec"]["tolerations"]


@pytest.mark.parametrize(
    "settings, culprit",
    [
        ({"reservation": "r", "spot": True}, "Spot VMs never consume reservations"),
        ({"flex_start": True, "spot": True}, "not Spot"),
        ({"reservation": "r", "flex_start": True}, "set one of them"),
        ({"preemption_retries": -1}, "preemption_retries=-1"),
        ({"capacity_wait_seconds": "soon"}, "capacity_wait_seconds='soon'"),
    ],
)
def test_capacity_settings_that_cannot_work_are_refused_before_upload(settings, culprit):
    from kinetic_prefect.workers.gke.worker import KineticGKEWorker

    with pytest.raises(ValueError, match=culprit):
        KineticGKEWorker.check_pool_settings("gke", {"image": "x"}, settings)


def test_a_queued_job_is_described_from_its_kueue_workload():
    workload = {
        "metadata": {"name": "job-train-a1-3f2c1"},
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Pending",
                    "message": "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu "
                    "in flavor nvidia-l4, 1 more needed",
                }
            ]
        },
    }
    said = gke_capacity.kueue_queued("dws-local-queue", workload, "dws-cluster-queue")
    assert said == (
        "queued in Kueue ClusterQueue dws-cluster-queue (Workload job-train-a1-3f2c1: Pending: couldn't assign "
        "flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor nvidia-l4, 1 more needed)"
    )
    assert gke_capacity.kueue_queued("dws-local-queue", None, None) == (
        "queued in Kueue LocalQueue dws-local-queue (Kueue has not made its Workload yet)"
    )
