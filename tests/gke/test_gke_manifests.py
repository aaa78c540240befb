"""kinetic-gke manifests: every catalog entry renders a Job that validates strictly against the
Kubernetes schema, with the node selector, tolerations and limits GKE needs."""

from __future__ import annotations

import asyncio
import json
import uuid

import kubernetes_validate
import pytest
from prefect.client.schemas.objects import FlowRun, WorkPool

from kinetic_prefect import accelerators
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.worker import KineticGKEWorker

pytestmark = pytest.mark.no_server

K8S_VERSION = "1.33.0"
SINGLE_HOST = [s.name for s in accelerators.catalog() if not s.multi_host]
MULTI_HOST = [s.name for s in accelerators.catalog() if s.multi_host]


def render(accelerator: str, **variables) -> KineticGKEJobConfiguration:
    template = KineticGKEWorker.get_default_base_job_template()
    values = {
        "accelerator": accelerator,
        "image": "us-docker.pkg.dev/p/r/kinetic:py311-gpu-0123456789abcdef",
        "store": "gs://bucket/kinetic",
        "env": {"KINETIC_RUN_PREFIX": "runs/abc"},
        **variables,
    }
    configuration = asyncio.run(KineticGKEJobConfiguration.from_template_and_values(template, values, client=None))
    flow_run = FlowRun(id=uuid.uuid4(), name="brave-otter-job1", flow_id=uuid.uuid4())
    pool = WorkPool(name="gke-pool", type="kinetic-gke", base_job_template=template)
    configuration.prepare_for_flow_run(flow_run, work_pool=pool, worker_name="in-process@host.example")
    return configuration


@pytest.mark.parametrize("name", SINGLE_HOST)
def test_every_single_host_entry_renders_a_valid_job(name):
    spec = accelerators.resolve(name)
    manifest = render(name).job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert manifest["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert container["command"] == ["python", "-u", "-m", "kinetic_prefect.pod.runner"]
    assert pod.get("nodeSelector", {}) == spec.node_selector
    if spec.family == "cpu":
        assert "tolerations" not in pod and "limits" not in container.get("resources", {})
    else:
        assert container["resources"]["limits"] == {spec.resource_name: str(spec.chips_per_host)}
        assert {"key": spec.resource_name, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    if spec.family == "tpu":
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == spec.tpu_topology
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KINETIC_STORE"] == "gs://bucket/kinetic" and env["KINETIC_ACCELERATOR"] == spec.name


def test_spot_resources_shm_deadline_ttl_and_service_account():
    manifest = render(
        "l4x2",
        spot=True,
        cpu_request="8",
        memory_request="32Gi",
        ephemeral_storage_request="100Gi",
        shm_size="8Gi",
        job_watch_timeout_seconds=7200,
        finished_job_ttl=600,
        cpu_limit="16",
        memory_limit="64Gi",
        image_pull_policy="Always",
        annotations={"team": "vision"},
        service_account_name="kinetic-jobs",
        namespace="ml",
    ).job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4", "cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "32Gi", "ephemeral-storage": "100Gi"}
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2", "cpu": "16", "memory": "64Gi"}
    assert container["imagePullPolicy"] == "Always" and manifest["metadata"]["annotations"] == {"team": "vision"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert manifest["spec"]["activeDeadlineSeconds"] == 7200 and manifest["spec"]["ttlSecondsAfterFinished"] == 600
    assert pod["serviceAccountName"] == "kinetic-jobs" and manifest["metadata"]["namespace"] == "ml"
    labels = manifest["metadata"]["labels"]
    assert labels["kinetic.prefect.io/accelerator"] == "l4x2" and labels["kinetic.prefect.io/work-pool"] == "gke-pool"
    assert labels["prefect.io/worker-name"] == "in-process-host.example"  # '@' is not allowed in label values


@pytest.mark.parametrize("name", MULTI_HOST)
def test_every_multi_host_slice_renders_one_indexed_job_and_its_headless_service(name):
    spec = accelerators.resolve(name)
    configuration = render(name)
    manifest = configuration.job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    job = manifest["spec"]
    assert (job["completions"], job["parallelism"], job["completionMode"], job["backoffLimit"]) == (
        spec.hosts,
        spec.hosts,
        "Indexed",
        0,
    ), "one pod per host, all or nothing"
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert pod["nodeSelector"] == spec.node_selector
    assert container["resources"]["limits"] == {"google.com/tpu": str(spec.chips_per_host)}
    name_ = manifest["metadata"]["name"]
    assert pod["subdomain"] == name_
    env = {e["name"]: e for e in container["env"]}
    hostnames = [f"{name_}-{i}.{name_}" for i in range(spec.hosts)]
    assert env["KINETIC_NUM_HOSTS"]["value"] == str(spec.hosts)
    assert env["KINETIC_COORDINATOR_ADDRESS"]["value"] == f"{hostnames[0]}:8476"
    assert env["TPU_WORKER_HOSTNAMES"]["value"] == ",".join(hostnames)
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["TPU_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert env["KINETIC_HOST_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    service = configuration.service_manifest(owner_uid="0000-uid")
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    assert service["metadata"]["name"] == name_ and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": name_}
    assert service["metadata"]["ownerReferences"][0]["uid"] == "0000-uid", "deleted with its Job"


def test_a_cpu_group_of_hosts_and_a_contradicting_host_count():
    manifest = render("cpu", hosts=3).job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert manifest["spec"]["completions"] == 3 and "TPU_WORKER_ID" not in json.dumps(manifest)
    assert render("l4").service_manifest() is None, "a single pod needs no Service"
    with pytest.raises(ValueError, match="slice of 4 hosts; hosts=2 contradicts it"):
        render("tpu-v5litepod-16", hosts=2)


def test_fields_added_to_the_template_in_the_ui_are_kept():
    template = KineticGKEWorker.get_default_base_job_template()
    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "high"
    template["job_configuration"]["job_manifest"]["metadata"]["annotations"] = {"team": "vision"}
    configuration = asyncio.run(
        KineticGKEJobConfiguration.from_template_and_values(
            template, {"accelerator": "a100", "image": "img:1"}, client=None
        )
    )
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="x", flow_id=uuid.uuid4()))
    manifest = configuration.job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert manifest["spec"]["template"]["spec"]["priorityClassName"] == "high"
    assert manifest["metadata"]["annotations"] == {"team": "vision"}


def test_the_template_file_is_what_the_worker_type_serves():
    from kinetic_prefect.config import work_pools_dir

    assert KineticGKEWorker.get_default_base_job_template() == json.loads(
        (work_pools_dir() / "kinetic-gke.json").read_text()
    )


def test_in_cluster_worker_manifests_are_valid_and_least_privilege():

    from kinetic_prefect.workers.gke.deploy import worker_manifests

    docs = worker_manifests("gpu", namespace="ml", image="us-docker.pkg.dev/p/r/worker:1")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "PriorityClass"]
    placeholders = docs[4]
    # the cluster autoscaler scales up for pods at -10 or above (--expendable-pods-priority-cutoff), and a placeholder
    # takes free room only
    assert -10 <= placeholders["value"] < 0 and placeholders["preemptionPolicy"] == "Never"
    assert not placeholders["globalDefault"]
    role = docs[1]
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "ml"  # namespaced, not a ClusterRole
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert ("jobs", "create") in granted and ("jobs", "delete") in granted and ("pods/log", "get") in granted
    assert not any(v in ("*", "escalate", "bind") for _, v in granted)
    assert not any(r == "*" for r, _ in granted)
    assert {v for r, v in granted if r == "secrets"} == {"create"}, (
        "it may create, never read, change or delete, secrets"
    )
    container = docs[3]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:5] == ["prefect", "worker", "start", "--type", "kinetic-gke"]
    assert docs[3]["spec"]["template"]["spec"]["serviceAccountName"] == docs[0]["metadata"]["name"]


def test_gke_worker_manifests_cli(capsys):
    import yaml

    from kinetic_prefect.cli import main

    main(["gke-worker-manifests", "--pool", "gpu", "--image", "img:1", "--namespace", "ml"])
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "PriorityClass"]


def test_the_pool_form_is_prefect_kubernetes_form_plus_the_kinetic_variables():
    """A prefect-kubernetes user finds every setting they know (cluster config block, namespace, image pull policy,
    finished-job TTL, limits...) under the same name; backoff_limit alone is left out: one Job is one attempt, and
    retries belong to Prefect."""
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
    from kinetic_prefect.workers.gke.worker import KineticGKEWorker

    ours = KineticGKEWorker.get_default_base_job_template()["variables"]
    theirs = KubernetesWorker.get_default_base_job_template()["variables"]
    assert set(theirs["properties"]) - set(ours["properties"]) == {"backoff_limit"}
    # a bare reference (not anyOf it and null, as prefect-kubernetes has it): see tests/worker/test_pool_form.py
    assert ours["properties"]["cluster_config"]["$ref"] == "#/definitions/KubernetesClusterConfig"
    assert ours["definitions"]["KubernetesClusterConfig"]["block_type_slug"] == "kubernetes-cluster-config"
    assert {"accelerator", "spot", "image_builder", "store", "shm_size"} <= set(ours["properties"])
    assert issubclass(KineticGKEJobConfiguration, KubernetesWorkerJobConfiguration)
