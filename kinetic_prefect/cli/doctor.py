"""``kinetic-prefect doctor``: is this machine ready to run kinetic jobs, and if not, what to do.

Each check talks to the real thing (the Prefect API, the pool, the store, the cluster) and, when it
fails, says how to fix it. The checks, in order:

- the Prefect API answers;
- the kinetic work pool exists, is a kinetic type, is not paused (workers online are reported);
- the artifact store is readable and writable (a tiny object written, read back and deleted), and for
  ``gs://`` stores, credentials are present (Application Default Credentials or an emulator);
- for ``kinetic-gke`` pools: the store is ``gs://``, the kube context loads, the cluster has a node with
  the GKE accelerator label of each accelerator the deployments use (plus ``--accelerator``), and the
  image settings are complete (``image``, or ``image_builder`` with what it needs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kinetic_prefect import accelerators, config
from kinetic_prefect.contract import GKE_WORKER_TYPE, LOCAL_WORKER_TYPE, WORKER_TYPES, Env

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"
Problem = tuple[str, str, str]  # (status, detail, fix)
KINETIC_TYPES = WORKER_TYPES
CLOUD_BUILD_SETTINGS = {
    "gcp_project": "YOUR_PROJECT",
    "gcp_region": "us-central1",
    "build_staging_bucket": "YOUR_BUCKET",
    "image_repository": "us-central1-docker.pkg.dev/YOUR_PROJECT/kinetic",
}


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Report:
    pool: str
    pool_type: str | None = None
    store: str | None = None
    accelerators: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def add(self, name: str, status: str, detail: str, fix: str = "") -> Check:
        check = Check(name, status, detail, fix)
        self.checks.append(check)
        return check

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "pool": self.pool,
            "pool_type": self.pool_type,
            "store": self.store,
            "accelerators": self.accelerators,
            "checks": [asdict(c) for c in self.checks],
        }


def _q(value: str) -> str:
    return shlex.quote(str(value))


def _pool_set(pool: str, **settings: str) -> str:
    return "kinetic-prefect pool-set " + _q(pool) + " " + " ".join(f"{k}={_q(v)}" for k, v in settings.items())


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


# --------------------------------------------------------------------------------------------- Prefect


def _api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def check_api(report: Report, client) -> bool:
    url = _api_url()
    where = url or "a temporary server started for this command (no PREFECT_API_URL)"
    problem = client.api_healthcheck()
    if problem is not None:
        report.add(
            "Prefect API",
            FAIL,
            f"{where} does not answer: {_error(problem)}",
            "start a server with `prefect server start` and point clients and workers at it: "
            "`prefect config set PREFECT_API_URL=http://HOST:4200/api` (or `prefect cloud login`)",
        )
        return False
    try:
        version = client.api_version()
    except Exception:  # noqa: BLE001 - the version is only informative
        version = "?"
    detail = f"{where} is healthy (server {version})"
    if url is None:
        detail += "; workers on other machines need a shared server: `prefect server start` and PREFECT_API_URL"
    report.add("Prefect API", OK, detail)
    return True


def check_pool(report: Report, client):
    """The pool (or None when it is missing and cannot be created on first use)."""
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.base import BaseWorker

    name = report.pool
    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        _check_missing_pool(report, name)
        return None
    report.pool_type = pool.type
    if pool.type not in KINETIC_TYPES:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} is of type {pool.type!r}, not a kinetic worker type",
            f"kinetic tasks need a pool of type kinetic-local or kinetic-gke: point {Env.WORK_POOL} at one, "
            f"or create one: `prefect work-pool create NAME --type kinetic-local`",
        )
        return pool
    if BaseWorker.get_worker_class_from_type(pool.type) is None:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} is of type {pool.type!r}, but that worker type is not installed here",
            "install kinetic-prefect in this environment (its `prefect.collections` entry point registers "
            "the worker types): `pip install kinetic-prefect`",
        )
        return pool
    if pool.is_paused:
        report.add(
            "Work pool",
            FAIL,
            f"{name!r} ({pool.type}) is paused: polling workers get no runs",
            f"`prefect work-pool resume {_q(name)}`",
        )
        return pool
    report.add("Work pool", OK, f"{name!r} is of type {pool.type}; {_workers_online(client, name)}")
    return pool


def _check_missing_pool(report: Report, name: str) -> None:
    """The default pool is created on first use; any other missing pool is a failure naming how to create it."""
    if name == config.DEFAULT_WORK_POOL:
        report.pool_type = LOCAL_WORKER_TYPE
        report.add(
            "Work pool",
            OK,
            f"{name!r} does not exist yet; kinetic-prefect creates it (type kinetic-local) on first use",
        )
        return
    report.add(
        "Work pool",
        FAIL,
        f"{name!r} does not exist on this Prefect server",
        f"create it: `prefect work-pool create {_q(name)} --type kinetic-local` (jobs as local processes) "
        f"or `--type kinetic-gke` (Kubernetes Jobs on GKE); or point {Env.WORK_POOL} / --pool at an "
        "existing kinetic pool",
    )


def _workers_online(client: Any, name: str) -> str:
    from prefect.client.schemas.objects import WorkerStatus

    try:
        online = [w.name for w in client.read_workers_for_work_pool(name) if w.status == WorkerStatus.ONLINE]
    except Exception:  # noqa: BLE001 - informative only
        online = []
    if online:
        return f"{len(online)} worker(s) online ({', '.join(online[:3])})"
    return "no worker online: each call runs the pool's worker in-process"


def _variable(pool, name: str) -> Any:
    if pool is None:
        return None
    return pool.base_job_template.get("variables", {}).get("properties", {}).get(name, {}).get("default")


# --------------------------------------------------------------------------------------------- storage


def check_gcs_credentials(report: Report) -> bool:
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        import google.auth  # noqa: F401
        from google.cloud import storage  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        report.add(
            "GCS credentials",
            FAIL,
            "the Google Cloud libraries are not installed",
            "install the gcp extra: `pip install 'kinetic-prefect[gcp]'`",
        )
        return False
    if emulator:
        report.add("GCS credentials", OK, f"STORAGE_EMULATOR_HOST={emulator}: a GCS emulator, no credentials needed")
        return True
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, project = google.auth.default()
    except DefaultCredentialsError as exc:
        report.add(
            "GCS credentials",
            FAIL,
            f"no Application Default Credentials: {_error(exc)}",
            "on a workstation: `gcloud auth application-default login`; elsewhere: "
            "GOOGLE_APPLICATION_CREDENTIALS=/path/key.json, or Workload Identity for pods in GKE",
        )
        return False
    report.add(
        "GCS credentials",
        OK,
        f"Application Default Credentials ({type(credentials).__name__}{', project ' + project if project else ''})",
    )
    return True


def check_store(report: Report, url: str) -> None:
    from kinetic_prefect.storage import LocalStore, open_store

    is_gcs = url.startswith("gs://")
    if is_gcs and not check_gcs_credentials(report):
        report.add("Store", SKIP, f"{url}: not tried without credentials")
        return
    key = f"doctor/{socket.gethostname()}-{uuid.uuid4().hex[:12]}.txt"
    token = f"kinetic-prefect doctor {uuid.uuid4()}".encode()
    step = "opening"
    store = None
    try:
        store = open_store(url)
        step = "writing"
        store.put_bytes(key, token)
        step = "reading back"
        if store.get_bytes(key) != token:
            raise OSError("the object read back differs from the one written")
        step = "deleting"
        store.delete(key)
        if store.exists(key):
            raise OSError("the object is still there after delete")
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its fix
        if is_gcs:
            fix = (
                "give this identity (and the job pods' service account) read/write on the bucket, e.g. "
                f"`gcloud storage buckets add-iam-policy-binding gs://{url[5:].split('/')[0]} "
                "--member=serviceAccount:SA --role=roles/storage.objectAdmin`; check the bucket exists"
            )
        else:
            fix = (
                f"make {url} a directory this user can write (mkdir -p / chmod u+rwx / chown), or choose another "
                "store: the pool's `store` variable (`kinetic-prefect pool-set POOL store=/writable/dir`) or "
                f"{Env.STORE}"
            )
        report.add("Store", FAIL, f"{url}: failed while {step} a test object: {_error(exc)}", fix)
        return
    finally:
        if isinstance(store, LocalStore):
            with contextlib.suppress(OSError):
                os.rmdir(store.root / "doctor")
    report.add("Store", OK, f"{url}: wrote, read back and deleted a test object")


# --------------------------------------------------------------------------------------------- GKE


def deployment_accelerators(client, pool_name: str) -> dict[str, list[str]]:
    """Accelerator name -> deployments whose flow runs send their kinetic tasks to ``pool_name``
    (``KINETIC_WORK_POOL`` in the deployment's job variables) with an ``accelerator`` parameter."""
    found: dict[str, list[str]] = {}
    try:
        deployments = client.read_deployments()
    except Exception:  # noqa: BLE001 - then only --accelerator counts
        return found
    flows = {}
    for deployment in deployments:
        env = (deployment.job_variables or {}).get("env") or {}
        if env.get(Env.WORK_POOL) != pool_name:
            continue
        accelerator = (deployment.parameters or {}).get("accelerator")
        if not isinstance(accelerator, str) or not accelerator:
            continue
        if deployment.flow_id not in flows:
            try:
                flows[deployment.flow_id] = client.read_flow(deployment.flow_id).name
            except Exception:  # noqa: BLE001
                flows[deployment.flow_id] = "?"
        found.setdefault(accelerator, []).append(f"{flows[deployment.flow_id]}/{deployment.name}")
    return found


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
                f"{where.path}: could not list node pools through the GKE API ({_error(exc)}); read from the "
                "nodes instead, a pool at zero nodes looks missing",
                "install the gcp extra (`pip install 'kinetic-prefect[gcp]'`), run doctor with Application Default "
                "Credentials (`gcloud auth application-default login`) of an identity with roles/container.viewer",
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
                f"{_error(exc)} (used by {', '.join(sources)})",
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
            _pool_set(report.pool, store="gs://YOUR_BUCKET/kinetic"),
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
            "install the k8s extra: `pip install 'kinetic-prefect[k8s]'`",
        )
        return
    from kinetic_prefect.workers.gke.kube import kube_client

    kubeconfig, context = _variable(pool, "kubeconfig_path"), _variable(pool, "kube_context")
    cluster_ref = _variable(pool, "cluster_config")
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
        f"{where}: cannot reach the cluster: {_error(exc)}{unchecked}",
        "`gcloud container clusters get-credentials CLUSTER --location LOCATION`, save it as a "
        "KubernetesClusterConfig block (prefect-kubernetes) and pick it as the pool's cluster_config in the "
        "UI, or set the pool's kubeconfig_path / kube_context: "
        + _pool_set(report.pool, kubeconfig_path="/path/kubeconfig", kube_context="CONTEXT"),
    )


def check_gcs_fuse(report: Report, api, pool) -> None:
    """Data(..., fuse=True) needs GKE's Cloud Storage FUSE CSI driver (its CSIDriver object exists once the add-on
    is on) and a pod service account allowed to read the buckets; IAM is not readable here, so that is named."""
    from kubernetes import client as k8s

    from kinetic_prefect.workers.gke.fuse import CSI_DRIVER

    namespace = _variable(pool, "namespace") or "default"
    account = _variable(pool, "service_account_name") or "default"
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
            else f"could not read CSIDriver {CSI_DRIVER} ({_error(exc)}), so the FUSE add-on was not checked"
        )
        report.add("Cloud Storage FUSE", WARN, detail, f"enable the add-on if it is off: {addon}; {binding}")
        return
    report.add("Cloud Storage FUSE", OK, f"{CSI_DRIVER} is installed; {binding}")


def check_image_settings(report: Report, pool) -> None:
    name = report.pool
    image = _variable(pool, "image")
    builder = _variable(pool, "image_builder") or "none"
    if image:
        report.add("Job image", OK, f"prebuilt image {image} (nothing is built)")
        return
    if builder == "none":
        report.add(
            "Job image",
            FAIL,
            "no image and image_builder=none: the worker cannot get an image for a job",
            "let the worker build images: "
            + _pool_set(name, image_builder="cloud-build", **CLOUD_BUILD_SETTINGS)
            + " (or a prebuilt one: "
            + _pool_set(name, image="REGISTRY/IMAGE:TAG")
            + ")",
        )
        return
    if builder == "docker":
        _check_docker_builder(report, pool)
        return
    if builder == "cloud-build":
        _check_cloud_build(report, pool)
        return
    report.add("Job image", FAIL, f"unknown image_builder {builder!r}", _pool_set(name, image_builder="cloud-build"))


def _check_docker_builder(report: Report, pool: Any) -> None:
    problems = []
    if not _variable(pool, "image_repository"):
        problems.append(("image_repository", "REGISTRY/PATH"))
    for setting, example in problems:
        report.add(
            f"Docker builder: {setting}",
            FAIL,
            f"image_builder=docker needs {setting}",
            _pool_set(report.pool, **{setting: example}),
        )
    if shutil.which("docker") is None:
        report.add(
            "Docker builder",
            FAIL,
            "no `docker` command on this machine's PATH (the worker builds here)",
            "install Docker Engine where the kinetic-gke worker runs, or use image_builder=cloud-build",
        )
    elif not problems:
        report.add("Job image", OK, f"built with Docker and pushed to {_variable(pool, 'image_repository')}")


def _check_cloud_build(report: Report, pool: Any) -> None:
    missing = [s for s in CLOUD_BUILD_SETTINGS if not _variable(pool, s)]
    for setting in missing:
        report.add(
            f"Cloud Build: {setting}",
            FAIL,
            f"image_builder=cloud-build needs the pool's {setting} variable",
            _pool_set(report.pool, **{setting: CLOUD_BUILD_SETTINGS[setting]}),
        )
    try:
        import google.cloud.artifactregistry_v1  # noqa: F401
        import google.cloud.devtools.cloudbuild_v1  # noqa: F401
    except ImportError:
        report.add(
            "Cloud Build",
            FAIL,
            "the Cloud Build / Artifact Registry clients are not installed",
            "install the gcp extra: `pip install 'kinetic-prefect[gcp]'`",
        )
        return
    if not missing:
        report.add(
            "Job image",
            OK,
            "built with Cloud Build in project "
            f"{_variable(pool, 'gcp_project')} ({_variable(pool, 'gcp_region')}), pushed "
            f"to {_variable(pool, 'image_repository')}",
        )


# --------------------------------------------------------------------------------------------- deployments


def check_deployments(report: Report, client) -> None:
    """Every deployment with an active schedule: can its runs start (the flows' pool exists, a worker
    polls it), and does the kinetic pool it names (``job_variables.env.KINETIC_WORK_POOL``) exist?"""
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    try:
        deployments = client.read_deployments()
    except Exception as exc:  # noqa: BLE001
        report.add("Deployments", FAIL, f"cannot read deployments: {_error(exc)}")
        return
    pools: dict[str, Any] = {}

    def pool_state(name: str) -> tuple[Any, int]:
        if name not in pools:
            try:
                found = client.read_work_pool(name)
                online = sum(w.status == WorkerStatus.ONLINE for w in client.read_workers_for_work_pool(name))
            except ObjectNotFound:
                found, online = None, 0
            pools[name] = (found, online)
        return pools[name]

    flows: dict[Any, str] = {}
    scheduled = [d for d in deployments if any(s.active for s in (d.schedules or []))]
    for deployment in scheduled:
        if deployment.flow_id not in flows:
            try:
                flows[deployment.flow_id] = client.read_flow(deployment.flow_id).name
            except Exception:  # noqa: BLE001
                flows[deployment.flow_id] = "?"
        title = f"Deployment {flows[deployment.flow_id]}/{deployment.name}"
        flows_pool = deployment.work_pool_name
        kinetic_pool = ((deployment.job_variables or {}).get("env") or {}).get(Env.WORK_POOL)
        problems = _flows_pool_problems(flows_pool, pool_state) + _kinetic_pool_problems(kinetic_pool, pool_state)
        accelerator = (deployment.parameters or {}).get("accelerator")
        if isinstance(accelerator, str) and accelerator:
            try:
                accelerators.resolve(accelerator)
            except ValueError as exc:
                problems.append((FAIL, _error(exc), "`kinetic-prefect accelerators` lists the names"))
        if not problems:
            report.add(
                title,
                OK,
                f"flows on {flows_pool!r} ({pools[flows_pool][1]} worker(s) online)"
                + (f", kinetic tasks on {kinetic_pool!r}" if kinetic_pool else ""),
            )
        for status, detail, fix in problems:
            report.add(title, status, detail, fix)
    if not scheduled:
        report.add("Deployments", SKIP, "no deployment has an active schedule (`prefect deploy --all` creates them)")


def _flows_pool_problems(flows_pool: str | None, pool_state: Callable[[str], tuple[Any, int]]) -> list[Problem]:
    """Why a scheduled deployment's runs would not start: no pool, a missing pool, no worker polling it."""
    if not flows_pool:
        return [(FAIL, "has an active schedule but no work pool", "redeploy it with a work pool")]
    found, online = pool_state(flows_pool)
    if found is None:
        return [
            (
                FAIL,
                f"its flows' pool {flows_pool!r} does not exist: scheduled runs never start",
                f"`prefect work-pool create {_q(flows_pool)} --type process`",
            )
        ]
    if not online:
        return [
            (
                WARN,
                f"no worker polls its flows' pool {flows_pool!r}: scheduled runs will be Late",
                f"`prefect worker start --pool {_q(flows_pool)}` where {Env.PROJECT_DIR} names "
                "a checkout (see prefect.yaml)",
            )
        ]
    return []


def _kinetic_pool_problems(kinetic_pool: str | None, pool_state: Callable[[str], tuple[Any, int]]) -> list[Problem]:
    """Why the kinetic pool a deployment names (``job_variables.env.KINETIC_WORK_POOL``) cannot take its tasks."""
    if not kinetic_pool:
        return []
    found, _online = pool_state(kinetic_pool)
    if found is None:
        return [
            (
                FAIL,
                f"its kinetic tasks go to pool {kinetic_pool!r}, which does not exist",
                f"`prefect work-pool create {_q(kinetic_pool)} --type kinetic-gke` (or "
                "kinetic-local), then `kinetic-prefect doctor --pool " + _q(kinetic_pool) + "`",
            )
        ]
    if found.type not in KINETIC_TYPES:
        return [
            (
                FAIL,
                f"its kinetic tasks go to pool {kinetic_pool!r} of type {found.type!r}",
                f"{Env.WORK_POOL} must name a kinetic-local or kinetic-gke pool",
            )
        ]
    return []


# --------------------------------------------------------------------------------------------- all


def run_checks(
    pool: str | None = None,
    accelerator: list[str] | None = None,
    store: str | None = None,
    deployments: bool = False,
    gke_cluster: str | None = None,
) -> Report:
    """Every check; ``gke_cluster`` (projects/P/locations/L/clusters/C) names the GKE cluster whose node pools are
    read when the kube context's name does not say it (ValueError when malformed, before anything is checked)."""
    import contextlib

    from prefect import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    cluster = GKECluster.from_path(gke_cluster) if gke_cluster else None
    report = Report(pool=pool or config.default_work_pool())
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}))
        try:
            client = stack.enter_context(get_client(sync_client=True))
        except Exception as exc:  # noqa: BLE001 - e.g. the ephemeral server did not start in time
            client = None
            report.add(
                "Prefect API",
                FAIL,
                f"{_api_url() or 'the ephemeral server'} is not available: {_error(exc)}",
                "run a server (`prefect server start`) and `prefect config set PREFECT_API_URL=http://HOST:4200/api`"
                "; without one, a slow machine may need PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90",
            )
        api_ok = client is not None and check_api(report, client)
        pool_obj = check_pool(report, client) if api_ok else None
        if not api_ok:
            report.add("Work pool", SKIP, f"{report.pool!r}: not checked without the Prefect API")
        report.store = store or _variable(pool_obj, "store") or config.default_store_url()
        check_store(report, report.store)
        if report.pool_type == GKE_WORKER_TYPE:
            check_gke(report, client, pool_obj, list(accelerator or []), cluster)
        elif accelerator:
            for name in accelerator:
                try:
                    spec = accelerators.resolve(name)
                    report.add(
                        f"Accelerator {name}",
                        OK,
                        f"{spec.name} ({spec.family}); a kinetic-local job runs on this machine whatever the name",
                    )
                except ValueError as exc:
                    report.add(
                        f"Accelerator {name}", FAIL, _error(exc), "`kinetic-prefect accelerators` lists the names"
                    )
        if deployments and api_ok:
            check_deployments(report, client)
    return report


def set_pool_variables(pool_name: str, assignments: list[str]) -> dict[str, Any]:
    """Set defaults of a pool's job variables (``key=value``; JSON values parse, anything else is a string)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(pool_name)
        template = json.loads(json.dumps(pool.base_job_template))
        properties = template.setdefault("variables", {}).setdefault("properties", {})
        changed: dict[str, Any] = {}
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ValueError(f"{item!r}: expected KEY=VALUE")
            if key not in properties:
                raise ValueError(
                    f"pool {pool_name!r} ({pool.type}) has no variable {key!r}; it has: {', '.join(sorted(properties))}"
                )
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            if raw == "":
                value = None  # unset: no default at all (a null default is not of the variable's type)
                properties[key].pop("default", None)
            else:
                properties[key]["default"] = value
            changed[key] = value
        client.update_work_pool(pool_name, WorkPoolUpdate(base_job_template=template))
    return changed
