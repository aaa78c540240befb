"""``kinetic-prefect doctor`` for a kinetic-gke pool (``KineticGKEWorker.doctor``): the store is ``gs://``, the
image settings are complete (``image``, or ``image_builder`` with what it needs), the kube context loads, the Cloud
Storage FUSE driver is there, and the cluster has a node pool for each accelerator the deployments use (plus
``--accelerator``), read through the GKE API where the cluster is known (a pool at zero nodes that scales from zero
passes), else from the nodes' labels.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.contract import Env
from kinetic_prefect.shared.doctor import (
    FAIL,
    OK,
    SKIP,
    WARN,
    Report,
    deployment_accelerators,
    error_text,
    pool_set,
    pool_variable,
)

CLOUD_BUILD_SETTINGS = {
    "gcp_project": "YOUR_PROJECT",
    "gcp_region": "us-central1",
    "build_staging_bucket": "YOUR_BUCKET",
    "image_repository": "us-central1-docker.pkg.dev/YOUR_PROJECT/kinetic",
}


def doctor(report: Report, client: Any, pool: Any, names: list[str], gke_cluster: str | None = None) -> None:
    """The kinetic-gke checks of ``pool``; ``gke_cluster`` (projects/P/locations/L/clusters/C) names the cluster whose
    node pools are read when the kube context's name does not say it."""
    check_gke(report, client, pool, names, GKECluster.from_path(gke_cluster) if gke_cluster else None)


def _node_pool_fix(spec: accelerators.AcceleratorSpec, where: GKECluster | None = None) -> str:
    cluster, location = (where.cluster, where.location) if where else ("CLUSTER", "LOCATION")
    project = where.project if where else "PROJECT"
    name = f"kinetic-{spec.name.replace(':', '-')}"[:40]
    command = (
        f"gcloud container node-pools create {name} --cluster {cluster} --location {location} "
        f"--machine-type {spec.machine_type}"
    )
    if spec.family == "gpu":
        command += f" --accelerator type={spec.gke_accelerator},count={spec.chips_per_host},gpu-driver-version=latest"
    elif spec.tpu_topology:
        command += f" --tpu-topology {spec.tpu_topology}"
    if spec.spot:
        command += " --spot"
    command += " --num-nodes 0 --enable-autoscaling --min-nodes 0 --max-nodes 2"
    spot = " --spot" if spec.spot else ""
    fix = (
        f"`kinetic-prefect pool add {spec.name}{spot} --project {project} --zone {location} --cluster {cluster}`, "
        f"or `{command}` (or enable node auto-provisioning)"
    )
    if where is None:
        fix += (
            ". Read from the nodes, a node pool scaled to zero looks missing: doctor reads node pools through the "
            "GKE API when the kube context is the one `gcloud container clusters get-credentials` writes "
            "(gke_PROJECT_LOCATION_CLUSTER), or with `kinetic-prefect doctor --gke-cluster "
            "projects/PROJECT/locations/LOCATION/clusters/CLUSTER`"
        )
    return fix


# GKE's node pools as the GKE API describes them (google-cloud-container), with their size read from the cluster's
# nodes and the cluster autoscaler's state from its status ConfigMap: a pool at zero nodes that can scale up is
# healthy (GKE's accelerator pools are made that way), which a look at the nodes alone cannot tell.

NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
_GKE_CONTEXT = re.compile(
    r"gke_(?P<project>[a-z][-a-z0-9:.]*)_(?P<location>[a-z]+-[a-z]+[0-9]+(?:-[a-z])?)_(?P<cluster>.+)"
)

_GKE_PATH = re.compile(r"projects/(?P<project>[^/\s]+)/locations/(?P<location>[^/\s]+)/clusters/(?P<cluster>[^/\s]+)")


@dataclass(frozen=True)
class GKECluster:
    project: str
    location: str
    cluster: str

    @property
    def path(self) -> str:
        return f"projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"

    @classmethod
    def from_path(cls, path: str) -> GKECluster:
        """``projects/P/locations/L/clusters/C`` (doctor's ``--gke-cluster``), for a kube context not named
        gke_P_L_C; ValueError naming the form when it is not that."""
        found = _GKE_PATH.fullmatch(path.strip())
        if found is None:
            raise ValueError(
                f"--gke-cluster {path!r}: give the cluster as projects/PROJECT/locations/LOCATION/clusters/CLUSTER, "
                "e.g. projects/my-project/locations/us-central1/clusters/my-cluster (LOCATION: its region or zone)"
            )
        return cls(found["project"], found["location"], found["cluster"])

    @classmethod
    def from_context(cls, context: str | None) -> GKECluster | None:
        """The cluster of a kube context named as `gcloud container clusters get-credentials` names it
        (gke_PROJECT_LOCATION_CLUSTER, what `kinetic-prefect up` sets as the pool's kube_context)."""
        found = _GKE_CONTEXT.fullmatch(context or "")
        return cls(found["project"], found["location"], found["cluster"]) if found else None


def gke_node_pools_client() -> Any:
    """The GKE API client doctor lists node pools with (Application Default Credentials)."""
    from google.cloud import container_v1

    return container_v1.ClusterManagerClient()


def _current_context(kubeconfig: str | None) -> str | None:
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None  # in-cluster credentials: there is no context name
    try:
        from kubernetes import config as kube_config

        _, active = kube_config.list_kube_config_contexts(config_file=kubeconfig or None)
        return str(active["name"])
    except Exception:  # noqa: BLE001 - no kubeconfig: the cluster is not known by name
        return None


def autoscaler_groups(api: Any) -> dict[str, dict[str, Any]] | None:
    """The cluster autoscaler's node groups from ``kube-system/cluster-autoscaler-status`` (its YAML form), by
    instance group name (the last part of the group's URL); None when the ConfigMap is absent or not readable."""
    import yaml
    from kubernetes import client as k8s

    from kinetic_prefect.workers.gke.capacity import AUTOSCALER_STATUS_CONFIGMAP

    namespace, name = AUTOSCALER_STATUS_CONFIGMAP
    try:
        found = k8s.CoreV1Api(api).read_namespaced_config_map(name, namespace, _request_timeout=15)
        status = yaml.safe_load((found.data or {}).get("status") or "")
    except Exception:  # noqa: BLE001 - absent, forbidden, or the older plain-text form: not known
        return None
    if not isinstance(status, dict):
        return None
    groups = status.get("nodeGroups") or []
    return {str(g.get("name", "")).rstrip("/").rsplit("/", 1)[-1]: g for g in groups if isinstance(g, dict)}


def _serves(node_pool: Any, spec: accelerators.AcceleratorSpec) -> bool:
    """Whether a node of this GKE node pool carries what the job's node selector asks: the GPU type and count
    attached, or the TPU machine type and topology; a Spot pool for a Spot accelerator."""
    config = node_pool.config
    if spec.spot and not config.spot:
        return False
    if spec.family == "gpu":
        return any(
            a.accelerator_type == spec.gke_accelerator and a.accelerator_count >= spec.chips_per_host
            for a in config.accelerators
        )
    topology = node_pool.placement_policy.tpu_topology
    return config.machine_type == spec.machine_type and topology in ("", spec.tpu_topology)


def check_node_pools(
    report: Report,
    api: Any,
    nodes: list[Any],
    wanted: dict[str, list[str]],
    context: str | None,
    cluster: GKECluster | None = None,
):
    """A check per accelerator: through the GKE API when the cluster is known (``--gke-cluster``, else its
    context's name), else from the nodes' labels (which cannot see a pool at zero nodes)."""
    where = cluster or GKECluster.from_context(context)
    node_pools = None
    if where is not None:
        try:
            node_pools = list(gke_node_pools_client().list_node_pools(parent=where.path, timeout=30).node_pools)
        except Exception as exc:  # noqa: BLE001 - no library, no credentials, no permission: say so, use the nodes
            report.add(
                "GKE node pools",
                WARN,
                f"{where.path}: could not list node pools through the GKE API ({error_text(exc)}); read from the "
                "nodes instead, a pool at zero nodes looks missing",
                "install the gcp extra (`uv sync --inexact --extra gcp` in the checkout), run doctor with "
                "Application Default Credentials (`gcloud auth application-default login`) of an identity with "
                "roles/container.viewer",
            )
    labels = [(node.metadata.labels if node.metadata else None) or {} for node in nodes]
    groups = autoscaler_groups(api) if node_pools is not None else None
    for name, sources in sorted(wanted.items()):
        title = f"Node pool for {name}"
        try:
            spec = accelerators.resolve(name)
        except ValueError as exc:
            report.add(
                title,
                FAIL,
                f"{error_text(exc)} (used by {', '.join(sources)})",
                "use a catalog name: `kinetic-prefect accelerators`",
            )
            continue
        if spec.multi_host:
            report.add(
                title,
                FAIL,
                f"{spec.name} is a multi-host TPU slice ({spec.hosts} hosts); kinetic-gke runs single-pod Jobs",
                "use a single-host shape (`kinetic-prefect accelerators`)",
            )
        elif not spec.node_selector:
            report.add(title, OK, f"{spec.name} needs no accelerator node ({len(nodes)} node(s))")
        elif node_pools is None or where is None:
            _check_by_nodes(report, title, spec, sources, labels)
        else:
            _check_gke_pools(report, title, spec, sources, where, node_pools, labels, groups)


def _check_by_nodes(report: Report, title: str, spec: Any, sources: list[str], labels: list[dict]) -> None:
    selector = spec.node_selector
    matching = sum(all(node.get(k) == v for k, v in selector.items()) for node in labels)
    shown = ", ".join(f"{k}={v}" for k, v in selector.items())
    if matching:
        report.add(title, OK, f"{matching} node(s) with {shown}")
    else:
        report.add(title, FAIL, f"no node with {shown} (used by {', '.join(sources)})", _node_pool_fix(spec))


def _pool_state(node_pool: Any, labels: list[dict], groups: dict[str, dict] | None) -> tuple[int, int, int, dict]:
    """(nodes up, autoscaling minimum, maximum: 0 when it does not autoscale, the autoscaler's scale-up state)."""
    up = sum(node.get(NODE_POOL_LABEL) == node_pool.name for node in labels)
    scaling = node_pool.autoscaling
    top = max(scaling.max_node_count, scaling.total_max_node_count) if scaling.enabled else 0
    bottom = max(scaling.min_node_count, scaling.total_min_node_count) if scaling.enabled else 0
    scale_up: dict = {}
    for url in node_pool.instance_group_urls:
        group = (groups or {}).get(url.rstrip("/").rsplit("/", 1)[-1])
        if group:
            scale_up = group.get("scaleUp") or {}
    return up, bottom, top, scale_up


def _check_gke_pools(
    report: Report,
    title: str,
    spec: Any,
    sources: list[str],
    where: GKECluster,
    node_pools: list[Any],
    labels: list[dict],
    groups: dict[str, dict] | None,
) -> None:
    serving = [p for p in node_pools if _serves(p, spec)]
    shown = ", ".join(f"{k}={v}" for k, v in spec.node_selector.items())
    if not serving:
        pools = ", ".join(f"{p.name} ({p.config.machine_type})" for p in node_pools) or "none"
        report.add(
            title,
            FAIL,
            f"no node pool of {where.cluster} has {spec.name} ({shown}; its pools: {pools}; used by "
            f"{', '.join(sources)})",
            _node_pool_fix(spec, where),
        )
        return
    states = [(p, *_pool_state(p, labels, groups)) for p in serving]
    for node_pool, up, bottom, top, _ in states:
        if up:
            report.add(title, OK, f"node pool {node_pool.name}: {up} node(s) up with {shown}" + _range(bottom, top))
            return
    scalable = [state for state in states if state[3] > 0]
    ready = [state for state in scalable if state[4].get("status") != "Backoff"]
    if ready:
        node_pool, _, bottom, top, _ = ready[0]
        report.add(
            title,
            OK,
            f"node pool {node_pool.name} is at 0 nodes and scales from zero{_range(bottom, top)}: a job's first pod "
            "waits for the cluster autoscaler to add a node (minutes for a GPU, longer for a TPU slice)",
        )
    elif scalable:
        node_pool, _, bottom, top, scale_up = scalable[0]
        info = scale_up.get("backoffInfo") or {}
        why = ": ".join(str(x) for x in (info.get("errorCode"), info.get("errorMessage")) if x) or "a failed scale-up"
        report.add(
            title,
            WARN,
            f"node pool {node_pool.name} is at 0 nodes and scales from zero{_range(bottom, top)}, but the cluster "
            f"autoscaler has backed it off after a failed scale-up ({why}): jobs for {spec.name} wait until the "
            "backoff ends",
            "give the task a fallback list (accelerator=[...]) or add a pool in another zone; the autoscaler's state: "
            "`kubectl -n kube-system get configmap cluster-autoscaler-status -o yaml`",
        )
    else:
        node_pool = serving[0]
        why = "its maximum size is 0" if node_pool.autoscaling.enabled else "it does not autoscale"
        report.add(
            title,
            FAIL,
            f"node pool {node_pool.name} has {spec.name} but no node, and {why}: no job for {spec.name} can be placed",
            f"`gcloud container clusters update {where.cluster} --location {where.location} --project "
            f"{where.project} --node-pool {node_pool.name} --enable-autoscaling --min-nodes 0 --max-nodes 2`",
        )


def _range(bottom: int, top: int) -> str:
    return f" (autoscaling {bottom}-{top} nodes)" if top else ""


def check_gke(report: Report, client, pool, extra_accelerators: list[str], cluster: GKECluster | None = None) -> None:
    store = report.store or ""
    if not store.startswith("gs://"):
        report.add(
            "Store for GKE",
            FAIL,
            f"{store or '(none)'} is not a gs:// store: job pods cannot reach a directory on this machine",
            pool_set(report.pool, store="gs://YOUR_BUCKET/kinetic"),
        )
    check_image_settings(report, pool)
    wanted = _wanted_accelerators(client, report.pool, extra_accelerators)
    report.accelerators = sorted(wanted)

    try:
        from kubernetes import client as k8s
    except ImportError:
        report.add(
            "Kubernetes",
            FAIL,
            "the kubernetes client is not installed",
            "install the k8s extra: `uv sync --inexact --extra k8s` in the checkout (pip: `pip install -e '.[k8s]'`)",
        )
        return
    from kinetic_prefect.workers.gke.kube import kube_client

    kubeconfig, context = pool_variable(pool, "kubeconfig_path"), pool_variable(pool, "kube_context")
    cluster_ref = pool_variable(pool, "cluster_config")
    where = f"kubeconfig {kubeconfig or '~/.kube/config (or in-cluster)'}" + (f", context {context}" if context else "")
    try:
        cluster_config = None
        if isinstance(cluster_ref, dict) and "$ref" in cluster_ref:
            from prefect_kubernetes.credentials import KubernetesClusterConfig

            cluster_config = KubernetesClusterConfig.load_from_ref(cluster_ref["$ref"])
            where = f"KubernetesClusterConfig block {cluster_ref['$ref']}, context {cluster_config.context_name}"
        api = kube_client(cluster_config, kubeconfig, context)
        context_name = cluster_config.context_name if cluster_config else context or _current_context(kubeconfig)
        nodes = k8s.CoreV1Api(api).list_node(_request_timeout=15).items
    except Exception as exc:  # noqa: BLE001
        _check_unreachable_cluster(report, exc, where, wanted)
        return
    report.add("Kubernetes", OK, f"{where}: {len(nodes)} node(s)")
    check_gcs_fuse(report, api, pool)
    if not wanted:
        report.add(
            "Node pools",
            SKIP,
            "no accelerator to check: no deployment sends its tasks to this pool "
            f"({Env.WORK_POOL} in its job variables); name some with --accelerator",
        )
        return
    check_node_pools(report, api, nodes, wanted, context_name, cluster)


def _wanted_accelerators(client: Any, pool_name: str, extra_accelerators: list[str]) -> dict[str, list[str]]:
    """Accelerator name -> where it is asked for (--accelerator, the deployments sending tasks to the pool)."""
    wanted: dict[str, list[str]] = {}
    for name in extra_accelerators:
        wanted.setdefault(name, []).append("--accelerator")
    for name, sources in deployment_accelerators(client, pool_name).items():
        wanted.setdefault(name, []).extend(sources)
    return wanted


def _check_unreachable_cluster(report: Report, exc: Exception, where: str, wanted: dict[str, list[str]]) -> None:
    """The cluster's nodes could not be listed: a 403 is a warning (connected), anything else a failure."""
    if getattr(exc, "status", None) == 403:
        report.add(
            "Kubernetes",
            WARN,
            f"{where}: connected, but this identity may not list nodes, so node pools were not checked",
            "run doctor with an identity that can `kubectl get nodes`",
        )
        return
    unchecked = f"; node pools for {', '.join(sorted(wanted))} not checked" if wanted else ""
    report.add(
        "Kubernetes",
        FAIL,
        f"{where}: cannot reach the cluster: {error_text(exc)}{unchecked}",
        "`gcloud container clusters get-credentials CLUSTER --location LOCATION`, save it as a "
        "KubernetesClusterConfig block (prefect-kubernetes) and pick it as the pool's cluster_config in the "
        "UI, or set the pool's kubeconfig_path / kube_context: "
        + pool_set(report.pool, kubeconfig_path="/path/kubeconfig", kube_context="CONTEXT"),
    )


def check_gcs_fuse(report: Report, api, pool) -> None:
    """Data(..., fuse=True) needs GKE's Cloud Storage FUSE CSI driver (its CSIDriver object exists once the add-on
    is on) and a pod service account allowed to read the buckets; IAM is not readable here, so that is named."""
    from kubernetes import client as k8s

    from kinetic_prefect.workers.gke.fuse import CSI_DRIVER

    namespace = pool_variable(pool, "namespace") or "default"
    account = pool_variable(pool, "service_account_name") or "default"
    binding = (
        f"for Data(..., fuse=True), the service account {namespace}/{account} needs roles/storage.objectViewer on "
        "each mounted bucket (Workload Identity): `gcloud storage buckets add-iam-policy-binding gs://BUCKET --role "
        "roles/storage.objectViewer --member principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/"
        f"global/workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/{namespace}/sa/{account}`"
    )
    addon = "`gcloud container clusters update CLUSTER --location LOCATION --update-addons GcsFuseCsiDriver=ENABLED`"
    try:
        k8s.StorageV1Api(api).read_csi_driver(CSI_DRIVER, _request_timeout=15)
    except Exception as exc:  # noqa: BLE001
        missing = getattr(exc, "status", None) == 404
        detail = (
            f"the cluster has no {CSI_DRIVER} CSI driver: a call with Data(..., fuse=True) cannot mount its data"
            if missing
            else f"could not read CSIDriver {CSI_DRIVER} ({error_text(exc)}), so the FUSE add-on was not checked"
        )
        report.add("Cloud Storage FUSE", WARN, detail, f"enable the add-on if it is off: {addon}; {binding}")
        return
    report.add("Cloud Storage FUSE", OK, f"{CSI_DRIVER} is installed; {binding}")


def check_image_settings(report: Report, pool) -> None:
    name = report.pool
    image = pool_variable(pool, "image")
    builder = pool_variable(pool, "image_builder") or "none"
    if image:
        report.add("Job image", OK, f"prebuilt image {image} (nothing is built)")
        return
    if builder == "none":
        report.add(
            "Job image",
            FAIL,
            "no image and image_builder=none: the worker cannot get an image for a job",
            "let the worker build images: "
            + pool_set(name, image_builder="cloud-build", **CLOUD_BUILD_SETTINGS)
            + " (or a prebuilt one: "
            + pool_set(name, image="REGISTRY/IMAGE:TAG")
            + ")",
        )
        return
    if builder == "docker":
        _check_docker_builder(report, pool)
        return
    if builder == "cloud-build":
        _check_cloud_build(report, pool)
        return
    report.add("Job image", FAIL, f"unknown image_builder {builder!r}", pool_set(name, image_builder="cloud-build"))


def _check_docker_builder(report: Report, pool: Any) -> None:
    problems = []
    if not pool_variable(pool, "image_repository"):
        problems.append(("image_repository", "REGISTRY/PATH"))
    for setting, example in problems:
        report.add(
            f"Docker builder: {setting}",
            FAIL,
            f"image_builder=docker needs {setting}",
            pool_set(report.pool, **{setting: example}),
        )
    if shutil.which("docker") is None:
        report.add(
            "Docker builder",
            FAIL,
            "no `docker` command on this machine's PATH (the worker builds here)",
            "install Docker Engine where the kinetic-gke worker runs, or use image_builder=cloud-build",
        )
    elif not problems:
        report.add("Job image", OK, f"built with Docker and pushed to {pool_variable(pool, 'image_repository')}")


def _check_cloud_build(report: Report, pool: Any) -> None:
    missing = [s for s in CLOUD_BUILD_SETTINGS if not pool_variable(pool, s)]
    for setting in missing:
        report.add(
            f"Cloud Build: {setting}",
            FAIL,
            f"image_builder=cloud-build needs the pool's {setting} variable",
            pool_set(report.pool, **{setting: CLOUD_BUILD_SETTINGS[setting]}),
        )
    try:
        import google.cloud.artifactregistry_v1  # noqa: F401
        import google.cloud.devtools.cloudbuild_v1  # noqa: F401
    except ImportError:
        report.add(
            "Cloud Build",
            FAIL,
            "the Cloud Build / Artifact Registry clients are not installed",
            "install the gcp extra: `uv sync --inexact --extra gcp` in the checkout (pip: `pip install -e '.[gcp]'`)",
        )
        return
    if not missing:
        report.add(
            "Job image",
            OK,
            "built with Cloud Build in project "
            f"{pool_variable(pool, 'gcp_project')} ({pool_variable(pool, 'gcp_region')}), pushed "
            f"to {pool_variable(pool, 'image_repository')}",
        )
