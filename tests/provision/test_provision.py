"""`kinetic-prefect up` / `down` / `pool`, end to end through the CLI.

At the client boundary: the GKE and Artifact Registry clients are fakes that keep state and record every request
(Google's APIs are unreachable from here; the requests are real container_v1 / artifactregistry_v1 protos); the
bucket is real, on fake-gcs-server; the work pool is real, on the session's Prefect server; the in-cluster worker
is a recording fake given the manifests ``workers.gke.deploy`` makes (``KubeClusterAccess`` applies them, see
test_provision_kube in this module)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import uuid
from typing import Any

import pytest
from google.api_core import exceptions as google_errors
from google.cloud import container_v1

from kinetic_prefect.cli import main
from kinetic_prefect.cli import provision as provision_cli
from kinetic_prefect.workers.gke.deploy import worker_manifests
from kinetic_prefect.workers.gke.provision import steps

PROJECT, ZONE = "test-project-1", "us-central1-a"
DONE, RUNNING = container_v1.Operation.Status.DONE, container_v1.Operation.Status.RUNNING


class FakeOperation:
    def result(self, timeout: float | None = None) -> None:
        return None


class FakeClusterManager:
    """ClusterManagerClient's calls that provisioning makes; an operation is RUNNING once, then DONE."""

    def __init__(self) -> None:
        self.clusters: dict[str, container_v1.Cluster] = {}
        self.pools: dict[str, dict[str, container_v1.NodePool]] = {}
        self.requests: list[tuple[str, Any]] = []
        self.refuse_pool: set[str] = set()  # node pools whose create call fails (quota)
        self._operations = 0

    def _operation(self) -> container_v1.Operation:
        self._operations += 1
        return container_v1.Operation(name=f"operation-{self._operations}", status=RUNNING)

    def get_operation(self, name: str) -> container_v1.Operation:
        return container_v1.Operation(name=name.rpartition("/")[2], status=DONE)

    def get_cluster(self, name: str) -> container_v1.Cluster:
        if name not in self.clusters:
            raise google_errors.NotFound(f"cluster {name}")
        return self.clusters[name]

    def create_cluster(self, parent: str, cluster: container_v1.Cluster) -> container_v1.Operation:
        self.requests.append(("create_cluster", cluster))
        path = f"{parent}/clusters/{cluster.name}"
        stored = container_v1.Cluster(cluster, status=container_v1.Cluster.Status.RUNNING, location=ZONE)
        self.clusters[path] = stored
        self.pools[path] = {p.name: container_v1.NodePool(p) for p in cluster.node_pools}
        return self._operation()

    def delete_cluster(self, name: str) -> container_v1.Operation:
        self.requests.append(("delete_cluster", name))
        del self.clusters[name], self.pools[name]
        return self._operation()

    def list_node_pools(self, parent: str) -> container_v1.ListNodePoolsResponse:
        return container_v1.ListNodePoolsResponse(node_pools=list(self.pools[parent].values()))

    def create_node_pool(self, parent: str, node_pool: container_v1.NodePool) -> container_v1.Operation:
        self.requests.append(("create_node_pool", node_pool))
        if node_pool.name in self.refuse_pool:
            self.refuse_pool.discard(node_pool.name)
            raise google_errors.ResourceExhausted("Insufficient regional quota to satisfy request: NVIDIA_A100_GPUS")
        self.pools[parent][node_pool.name] = container_v1.NodePool(
            node_pool, status=container_v1.NodePool.Status.RUNNING
        )
        return self._operation()

    def delete_node_pool(self, name: str) -> container_v1.Operation:
        self.requests.append(("delete_node_pool", name))
        cluster, _, pool = name.rpartition("/nodePools/")
        del self.pools[cluster][pool]
        return self._operation()

    def calls(self, method: str) -> list[Any]:
        return [request for called, request in self.requests if called == method]


class FakeRegistry:
    def __init__(self) -> None:
        self.repositories: dict[str, Any] = {}
        self.requests: list[tuple[str, Any]] = []

    def get_repository(self, name: str) -> Any:
        if name not in self.repositories:
            raise google_errors.NotFound(f"repository {name}")
        return self.repositories[name]

    def create_repository(self, parent: str, repository_id: str, repository: Any) -> FakeOperation:
        self.requests.append(("create_repository", (parent, repository_id, repository)))
        self.repositories[f"{parent}/repositories/{repository_id}"] = repository
        return FakeOperation()

    def delete_repository(self, name: str) -> FakeOperation:
        self.requests.append(("delete_repository", name))
        del self.repositories[name]
        return FakeOperation()


class FakeClusterAccess:
    def __init__(self) -> None:
        self.deployed: list[tuple[str, list[dict], dict]] = []
        self.applied: list[tuple[str, list[dict]]] = []

    def worker_exists(self, cluster: Any, namespace: str) -> bool:
        return any(name == cluster.name for name, _, _ in self.deployed)

    def namespace_exists(self, cluster: Any, namespace: str) -> bool:
        return any(
            name == cluster.name and doc["kind"] == "Namespace" and doc["metadata"]["name"] == namespace
            for name, docs in self.applied
            for doc in docs
        )

    def apply(self, cluster: Any, manifests: list[dict]) -> None:
        self.applied.append((cluster.name, manifests))

    def deploy_worker(self, cluster: Any, manifests: list[dict], api: dict) -> None:
        self.deployed.append((cluster.name, manifests, api))

    def node_counts(self, cluster: Any) -> dict[str, int]:
        return {"default-pool": 1, "kp-h100x8-spot": 2}


PROJECT_NUMBER = 314159265358


class FakeBucketIam:
    """Bucket IAM policies, which fake-gcs-server does not serve: kept per bucket, each set recorded."""

    def __init__(self) -> None:
        self.bindings: dict[str, list[dict]] = {}
        self.sets: list[tuple[str, list[dict]]] = []

    def install(self, monkeypatch) -> None:
        from google.api_core.iam import Policy
        from google.cloud.storage.bucket import Bucket

        iam = self

        def get_iam_policy(bucket, *args, **kwargs):
            policy = Policy(version=3)
            policy.bindings = [dict(b, members=set(b["members"])) for b in iam.bindings.get(bucket.name, [])]
            return policy

        def set_iam_policy(bucket, policy, *args, **kwargs):
            bindings = [dict(b, members=set(b["members"])) for b in policy.bindings]
            iam.bindings[bucket.name] = bindings
            iam.sets.append((bucket.name, bindings))
            return policy

        monkeypatch.setattr(Bucket, "get_iam_policy", get_iam_policy)
        monkeypatch.setattr(Bucket, "set_iam_policy", set_iam_policy)
        monkeypatch.setattr(Bucket, "project_number", property(lambda bucket: PROJECT_NUMBER))

    def members(self, bucket: str, role: str = "roles/storage.objectUser") -> set[str]:
        return {m for b in self.bindings.get(bucket, []) if b["role"] == role for m in b["members"]}


def _signing_key_value() -> str | None:
    from prefect.blocks.system import Secret

    from kinetic_prefect import signing

    try:
        return str(Secret.load(signing.SECRET_BLOCK).get())
    except ValueError:
        return None


def _delete_signing_key() -> None:
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectNotFound

    from kinetic_prefect import signing

    with contextlib.suppress(ValueError, ObjectNotFound):
        Secret.delete(signing.SECRET_BLOCK)


@pytest.fixture
def no_signing_key():
    """`up` saves the signing key in the session's Prefect server: none before a test, and the one there was (if
    any) back after it, so no other test of the session signs with a key one of these made."""
    from kinetic_prefect.shared.key_blocks import forget_signing_key

    before = _signing_key_value()
    _delete_signing_key()
    yield
    _delete_signing_key()
    if before is not None:
        from prefect.blocks.system import Secret

        from kinetic_prefect import signing

        Secret(value=before).save(signing.SECRET_BLOCK, overwrite=True)
    forget_signing_key()


@pytest.fixture
def fakes(gcs_emulator, monkeypatch, no_signing_key):
    """The clients `kinetic-prefect` gets: fakes for GKE and Artifact Registry, fake-gcs-server for the bucket (its
    IAM policy faked: the emulator has none)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    clients = steps.Clients(
        container=FakeClusterManager(),
        registry=FakeRegistry(),
        storage=storage.Client(project=PROJECT, credentials=AnonymousCredentials()),
        clusters=FakeClusterAccess(),
        poll_seconds=0,
    )
    made: list[str] = []
    monkeypatch.setattr(provision_cli, "make_clients", lambda project, platform: made.append(project) or clients)
    clients.made = made  # type: ignore[attr-defined]
    clients.iam = FakeBucketIam()  # type: ignore[attr-defined]
    clients.iam.install(monkeypatch)  # type: ignore[attr-defined]
    return clients


def _cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _where(cluster: str) -> list[str]:
    return ["--project", PROJECT, "--zone", ZONE, "--cluster", cluster]


def _names() -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:6]
    return f"c-{suffix}", f"up-{suffix}"


def _pool(name: str) -> Any:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_work_pool(name)


def test_up_makes_everything_once_and_a_second_up_makes_nothing(fakes, capsys):
    cluster, pool = _names()
    args = ["up", *_where(cluster), "-a", "l4x2", "-a", "tpu-v5litepod-16", "--spot", "--pool-name", pool, "--yes"]
    code, out = _cli(capsys, *args)
    assert code == 0, out
    gke = fakes.container
    (created,) = gke.calls("create_cluster")
    assert created.workload_identity_config.workload_pool == f"{PROJECT}.svc.id.goog"
    assert created.addons_config.gcs_fuse_csi_driver_config.enabled
    gpu, tpu = gke.calls("create_node_pool")
    assert (gpu.name, gpu.config.machine_type, gpu.config.spot) == ("kp-l4x2-spot", "g2-standard-24", True)
    assert [(a.accelerator_type, a.accelerator_count) for a in gpu.config.accelerators] == [("nvidia-l4", 2)]
    assert (gpu.autoscaling.min_node_count, gpu.autoscaling.max_node_count) == (0, 10)
    assert (tpu.placement_policy.tpu_topology, tpu.config.machine_type) == ("4x4", "ct5lp-hightpu-4t")
    assert tpu.placement_policy.type_.name == "COMPACT" and tpu.autoscaling.max_node_count == 4
    ((parent, repository_id, repository),) = [r for _, r in fakes.registry.requests]
    assert (parent, repository_id) == (f"projects/{PROJECT}/locations/us-central1", f"kn-{cluster}")
    assert repository.format_.name == "DOCKER"
    bucket = f"{PROJECT}-kn-{cluster}-jobs"
    assert fakes.storage.lookup_bucket(bucket) is not None
    defaults = {k: v.get("default") for k, v in _pool(pool).base_job_template["variables"]["properties"].items()}
    assert defaults["store"] == f"gs://{bucket}/kinetic-prefect" and defaults["gcp_project"] == PROJECT
    assert defaults["image_repository"] == f"us-central1-docker.pkg.dev/{PROJECT}/kn-{cluster}"
    assert defaults["kube_context"] == f"gke_{PROJECT}_{ZONE}_{cluster}" and defaults["image_builder"] == "cloud-build"
    assert "worker" in out and "no --worker-image" in out and fakes.clusters.deployed == []

    requests_before = len(gke.requests) + len(fakes.registry.requests)
    code, out = _cli(capsys, *args)
    assert code == 0, out
    assert len(gke.requests) + len(fakes.registry.requests) == requests_before, "a second up created something"
    # cluster, 2 node pools, registry, bucket, namespace, bucket access, signing key, pool
    assert "Nothing to do." in out and out.count("exists") == 9


def test_dry_run_shows_the_plan_and_changes_nothing(fakes, capsys):
    cluster, pool = _names()
    code, out = _cli(capsys, "up", *_where(cluster), "-a", "h100x8", "--pool-name", pool, "--dry-run")
    assert code == 0, out
    # cluster, node pool, registry, bucket, namespace, bucket access, signing key, work pool
    assert out.count("will create") == 8 and "dry run: nothing was changed." in out
    assert fakes.container.requests == [] and fakes.registry.requests == []
    assert fakes.storage.lookup_bucket(f"{PROJECT}-kn-{cluster}-jobs") is None
    from prefect.exceptions import ObjectNotFound

    with pytest.raises(ObjectNotFound):
        _pool(pool)


def test_an_up_that_failed_halfway_resumes_with_only_what_is_missing(fakes, capsys):
    cluster, pool = _names()
    args = ["up", *_where(cluster), "-a", "l4", "-a", "a100", "-a", "v6e-4", "--pool-name", pool, "--yes"]
    fakes.container.refuse_pool.add("kp-a100")
    code, out = _cli(capsys, *args)
    assert code == 1
    assert "node pool kp-a100: ResourceExhausted" in out and "NVIDIA_A100_GPUS" in out
    assert "done before it: cluster " in out and "node pool kp-l4" in out and "resume" in out
    assert fakes.registry.requests == [], "nothing after the failed step ran"

    fakes.container.requests.clear()
    code, out = _cli(capsys, *args)
    assert code == 0, out
    assert fakes.container.calls("create_cluster") == []
    assert [p.name for p in fakes.container.calls("create_node_pool")] == ["kp-a100", "kp-tpu-v6e-4"]
    assert [r[0] for r in fakes.registry.requests] == ["create_repository"]
    assert _pool(pool).type == "kinetic-gke"


def test_down_keeps_a_bucket_with_objects_unless_delete_data(fakes, capsys):
    cluster, pool = _names()
    assert _cli(capsys, "up", *_where(cluster), "-a", "l4", "--pool-name", pool, "--yes")[0] == 0
    bucket = fakes.storage.bucket(f"{PROJECT}-kn-{cluster}-jobs")
    bucket.blob("kinetic-prefect/runs/r1/result.pkl").upload_from_string(b"a result")

    monkey_input = io.StringIO("n\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdin", monkey_input)
        code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool)
    assert code == 1 and "Aborted" in out and fakes.container.calls("delete_cluster") == []

    code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool, "--yes")
    assert code == 0, out
    assert "kept" in out and "--delete-data" in out
    assert fakes.container.clusters == {} and fakes.registry.repositories == {}
    assert [b.name for b in bucket.list_blobs()] == ["kinetic-prefect/runs/r1/result.pkl"]
    from prefect.exceptions import ObjectNotFound

    with pytest.raises(ObjectNotFound):
        _pool(pool)

    code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool, "--yes", "--delete-data")
    assert code == 0, out
    assert fakes.storage.lookup_bucket(bucket.name) is None


def test_pool_add_list_and_remove(fakes, capsys):
    cluster, pool = _names()
    code, out = _cli(capsys, "pool", "add", "l4", *_where(cluster))
    assert code == 1 and f"no cluster {cluster!r}" in out and "kinetic-prefect up" in out
    assert _cli(capsys, "up", *_where(cluster), "--pool-name", pool, "--yes")[0] == 0

    assert _cli(capsys, "pool", "add", "h100x8", "--spot", *_where(cluster))[0] == 0
    code, out = _cli(capsys, "pool", "add", "a100x4", "--reservation", "my-a100s", "--min-nodes", "1", *_where(cluster))
    assert code == 0, out
    code, out = _cli(capsys, "pool", "list", *_where(cluster), "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["kp-h100x8-spot"] | {} == {
        "name": "kp-h100x8-spot",
        "accelerator": "h100x8",
        "spot": True,
        "reservation": "",
        "min_nodes": 0,
        "max_nodes": 10,
        "nodes": 2,
        "status": "running",
    }
    reserved = next(r for r in rows.values() if r["accelerator"] == "a100x4")
    assert (reserved["reservation"], reserved["min_nodes"], reserved["max_nodes"]) == ("my-a100s", 1, 11)
    assert rows["default-pool"]["accelerator"] == "- (e2-standard-4)"

    code, out = _cli(capsys, "pool", "remove", "h100x8", *_where(cluster), "--yes")
    assert code == 1 and "no node pool for h100x8" in out  # its only pool is a Spot pool
    code, out = _cli(capsys, "pool", "remove", "h100x8", "--spot", *_where(cluster), "--yes")
    assert code == 0, out
    assert fakes.container.calls("delete_node_pool") == [
        f"projects/{PROJECT}/locations/{ZONE}/clusters/{cluster}/nodePools/kp-h100x8-spot"
    ]


def test_node_pools_stream_their_images_and_pool_add_can_preload_them_on_a_secondary_boot_disk(fakes, capsys):
    """The node pools `up` and `pool add` ask GKE for have image streaming on (gcfsConfig; images in Artifact
    Registry, which `up` makes), and `pool add --preload-disk-image` gives each node the disk image of container
    images as a secondary boot disk in CONTAINER_IMAGE_CACHE mode; a malformed image name is refused before any
    request."""
    cluster, pool = _names()
    assert _cli(capsys, "up", *_where(cluster), "-a", "l4", "--pool-name", pool, "--yes")[0] == 0
    code, out = _cli(capsys, "pool", "add", "h100", "--preload-disk-image", "eurosat-images", *_where(cluster))
    assert code == 0, out
    code, out = _cli(capsys, "pool", "add", "a100", "--preload-disk-image", "Not An Image", *_where(cluster))
    assert code == 1 and "--preload-disk-image 'Not An Image'" in out, out
    l4, h100 = fakes.container.calls("create_node_pool")
    assert l4.config.gcfs_config.enabled and h100.config.gcfs_config.enabled
    assert not list(l4.config.secondary_boot_disks)
    (disk,) = h100.config.secondary_boot_disks
    assert disk.disk_image == "global/images/eurosat-images"
    assert disk.mode == container_v1.SecondaryBootDisk.Mode.CONTAINER_IMAGE_CACHE


def test_the_in_cluster_worker_is_deployed_with_the_pools_manifests(fakes, capsys, monkeypatch):
    cluster, pool = _names()
    monkeypatch.setattr(steps, "prefect_api_for_the_cluster", lambda: {"url": "https://prefect.example/api"})
    args = ["up", *_where(cluster), "--pool-name", pool, "--worker-image", "registry.example/worker:1", "--yes"]
    code, out = _cli(capsys, *args)
    assert code == 0, out
    ((where, manifests, api),) = fakes.clusters.deployed
    assert where == cluster and api == {"url": "https://prefect.example/api"}
    assert manifests == worker_manifests(pool, namespace="kinetic", image="registry.example/worker:1")
    assert _cli(capsys, *args)[0] == 0 and len(fakes.clusters.deployed) == 1


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["up", "--zone", ZONE], "no project: give --project"),
        (["up", "--project", PROJECT, "--zone", ZONE, "-a", "l5"], "Unknown accelerator 'l5'"),
        (["up", "--project", PROJECT, "--zone", ZONE, "-a", "l4", "--spot", "--reservation", "r"], "drop --spot"),
        (["pool", "add", "cpu", "--project", PROJECT, "--zone", ZONE], "cpu jobs run on the cluster's own"),
        (["up", "--project", PROJECT, "--zone", ZONE, "--worker-image", "w:1"], "cannot reach"),
    ],
)
def test_bad_input_fails_before_any_request(fakes, capsys, monkeypatch, args, culprit):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    code, out = _cli(capsys, *args)
    assert code == 1 and culprit in out, out
    assert fakes.made == [], "a client was made for bad input"


def test_provision_kube_applies_the_worker_to_a_real_control_plane(kube):
    """`KubeClusterAccess` against the real kube-apiserver: the Secret and the worker's four objects are created,
    a second deploy leaves them (409), and node counts come from GKE's node-pool label. A ResourceQuota of 0 pods
    keeps the Deployment from starting a pod (its image does not exist)."""
    from kubernetes import client

    from kinetic_prefect.workers.gke.provision.cluster_access import KubeClusterAccess

    api_client = kube.api()
    core = client.CoreV1Api(api_client)
    namespace = f"provision-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_resource_quota(namespace, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    access, cluster = KubeClusterAccess(api_client), container_v1.Cluster(name="test")
    try:
        assert not access.worker_exists(cluster, namespace)
        manifests = worker_manifests("a-pool", namespace=namespace, image="registry.invalid/worker:1")
        for _ in range(2):
            access.deploy_worker(cluster, manifests, {"url": "https://prefect.example/api"})
        assert access.worker_exists(cluster, namespace)
        secret = core.read_namespaced_secret(steps.API_SECRET, namespace)
        assert set(secret.data) == {"url"}
        assert client.RbacAuthorizationV1Api(api_client).read_namespaced_role(steps.WORKER_NAME, namespace).rules
        counts = access.node_counts(cluster)
        assert counts.get("l4-pool") == 1 and counts.get("tpu-pool") == 1
    finally:
        core.delete_namespace(namespace)


def _row(out: str, kind: str) -> str:
    """The plan table's line for the resource ``kind`` (the table is printed 140 columns wide: one line a row)."""
    [line] = [line for line in out.splitlines() if f"│ {kind} " in line]
    return line


def test_up_gives_jobs_a_restricted_namespace_their_own_account_alone_on_the_bucket_and_a_signing_key(
    fakes, capsys, monkeypatch
):
    """Issue 45 findings 5 and 6: `up` makes the namespace that enforces the restricted Pod Security Standard, the
    job pods' ServiceAccount, grants the bucket to that account (and the worker's) by name and to no other account
    of any namespace, and saves a random signing key as the Prefect Secret block, shown in the dry run, never
    printed, kept by a second `up` and by `down` unless --delete-signing-key."""
    cluster, pool = _names()
    bucket = f"{PROJECT}-kn-{cluster}-jobs"
    monkeypatch.setattr(steps, "prefect_api_for_the_cluster", lambda: {"url": "https://prefect.example/api"})
    args = ["up", *_where(cluster), "--pool-name", pool, "--worker-image", "registry.example/worker:1"]
    code, out = _cli(capsys, *args, "--dry-run")
    assert code == 0, out
    assert "will create" in _row(out, "signing key") and "not shown" in _row(out, "signing key")
    assert "will create" in _row(out, "namespace") and "restricted" in _row(out, "namespace")
    assert "kinetic/kinetic-job" in _row(out, "bucket access")
    assert _signing_key_value() is None and fakes.clusters.applied == [] and fakes.iam.sets == []

    code, out = _cli(capsys, *args, "--yes")
    assert code == 0, out
    key = _signing_key_value()
    assert key and len(base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))) == 32, "a random 32-byte key"
    assert key not in out, "the key is never printed"
    ((where, docs),) = fakes.clusters.applied
    namespace, account = docs
    assert where == cluster and namespace["metadata"]["name"] == "kinetic"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert (account["kind"], account["metadata"]["name"]) == ("ServiceAccount", "kinetic-job")
    assert account["automountServiceAccountToken"] is False
    principal = (
        f"principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
        f"{PROJECT}.svc.id.goog/subject/ns/kinetic/sa/"
    )
    assert fakes.iam.members(bucket) == {principal + "kinetic-job", principal + "kinetic-gke-worker"}
    granted = {m for b in fakes.iam.bindings[bucket] for m in b["members"]}
    assert not any("principalSet" in m or m.endswith("/sa/default") for m in granted), granted
    defaults = {k: v.get("default") for k, v in _pool(pool).base_job_template["variables"]["properties"].items()}
    assert (defaults["namespace"], defaults["service_account_name"]) == ("kinetic", "kinetic-job")
    ((_, manifests, _),) = fakes.clusters.deployed
    role = next(d for d in manifests if d["kind"] == "Role")
    assert {v for rule in role["rules"] if "secrets" in rule["resources"] for v in rule["verbs"]} == {"create"}

    code, out = _cli(capsys, *args, "--yes")
    assert code == 0 and "Nothing to do." in out, out
    assert _signing_key_value() == key and len(fakes.iam.sets) == 1, "a second up keeps the key and the grant"

    code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool, "--yes")
    assert code == 0, out
    assert "kept" in _row(out, "signing key") and _signing_key_value() == key, "down keeps the key unless asked"
    code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool, "--yes", "--delete-signing-key")
    assert code == 0, out
    assert _signing_key_value() is None


def test_without_an_in_cluster_worker_only_the_job_account_gets_the_bucket(fakes, capsys):
    cluster, pool = _names()
    assert _cli(capsys, "up", *_where(cluster), "--pool-name", pool, "--yes")[0] == 0
    assert fakes.iam.members(f"{PROJECT}-kn-{cluster}-jobs") == {
        f"principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
        f"{PROJECT}.svc.id.goog/subject/ns/kinetic/sa/kinetic-job"
    }


def test_ups_namespace_and_accounts_on_a_real_control_plane(kube):
    """What `up` applies for kinetic's namespace and worker, on the real kube-apiserver: the namespace enforces the
    restricted Pod Security Standard (its admission refuses a root pod), the job pods' account mounts no token and
    may do nothing, and the worker's Role lets it create Secrets but read, change or delete none (RBAC, asked of
    the API server as each ServiceAccount). A ResourceQuota of 0 pods keeps the worker from starting."""
    from kubernetes import client

    from kinetic_prefect.workers.gke.deploy import namespace_manifests
    from kinetic_prefect.workers.gke.provision.cluster_access import KubeClusterAccess

    admin = kube.api()
    core = client.CoreV1Api(admin)
    namespace = f"kinetic-{uuid.uuid4().hex[:6]}"
    access, cluster = KubeClusterAccess(admin), container_v1.Cluster(name="test")
    try:
        assert not access.namespace_exists(cluster, namespace)
        for _ in range(2):  # a second up leaves what is there
            access.apply(cluster, namespace_manifests(namespace))
        assert access.namespace_exists(cluster, namespace)
        labels = core.read_namespace(namespace).metadata.labels
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        assert core.read_namespaced_service_account("kinetic-job", namespace).automount_service_account_token is False
        root_pod = {"metadata": {"name": "root"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
        with pytest.raises(client.exceptions.ApiException) as refused:
            core.create_namespaced_pod(namespace, root_pod)
        message = json.loads(refused.value.body)["message"]
        assert refused.value.status == 403 and 'violates PodSecurity "restricted' in message, message
        core.create_namespaced_resource_quota(
            namespace, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}
        )
        access.deploy_worker(
            cluster, worker_manifests("a-pool", namespace=namespace, image="registry.invalid/worker:1"), {"url": "u"}
        )

        def allowed(account: str, verb: str, resource: str) -> bool:
            review = client.AuthorizationV1Api(admin).create_subject_access_review(
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": f"system:serviceaccount:{namespace}:{account}",
                        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                        "resourceAttributes": {
                            "namespace": namespace,
                            "verb": verb,
                            "resource": resource,
                            "group": "batch" if resource == "jobs" else "",
                        },
                    },
                }
            )
            return bool(review.status.allowed)

        assert allowed("kinetic-gke-worker", "create", "secrets")
        for verb in ("get", "list", "watch", "patch", "update", "delete"):
            assert not allowed("kinetic-gke-worker", verb, "secrets"), f"the worker may {verb} Secrets"
        assert allowed("kinetic-gke-worker", "create", "jobs") and allowed("kinetic-gke-worker", "get", "pods")
        for verb, resource in (("get", "pods"), ("list", "secrets"), ("create", "jobs"), ("create", "secrets")):
            assert not allowed("kinetic-job", verb, resource), f"the job account may {verb} {resource}"
    finally:
        core.delete_namespace(namespace)


@pytest.mark.parametrize(
    "args",
    [
        ["up", "--project", PROJECT, "--zone", ZONE, "--dry-run"],
        ["down", "--project", PROJECT, "--zone", ZONE, "--yes"],
        ["pool", "list", "--project", PROJECT, "--zone", ZONE],
    ],
    ids=["up --dry-run", "down", "pool list"],
)
def test_without_google_credentials_one_line_says_how_to_log_in(capsys, monkeypatch, tmp_path, args):
    """No GOOGLE_APPLICATION_CREDENTIALS, no gcloud ADC file, no metadata server (an unroutable loopback port, and
    google-auth told not to probe GCE): the real clients are made, and the command says what to run, no traceback."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # where gcloud keeps the ADC file: empty
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    code, out = _cli(capsys, *args)
    assert code == 1, out
    assert "gcloud auth application-default login" in out, out
    assert "Traceback" not in out and "DefaultCredentialsError" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_down_and_pool_remove_dry_run_delete_nothing(fakes, capsys):
    cluster, pool = _names()
    assert _cli(capsys, "up", *_where(cluster), "-a", "l4", "--pool-name", pool, "--yes")[0] == 0
    bucket = fakes.storage.bucket(f"{PROJECT}-kn-{cluster}-jobs")
    bucket.blob("kinetic-prefect/runs/r1/result.pkl").upload_from_string(b"a result")
    fakes.container.requests.clear()
    fakes.registry.requests.clear()

    # no --yes and nothing on stdin: a dry run never asks
    code, out = _cli(capsys, "down", *_where(cluster), "--pool-name", pool, "--delete-data", "--dry-run")
    assert code == 0, out
    assert "will delete" in out and "dry run: nothing was changed." in out
    assert fakes.container.calls("delete_cluster") == [] and fakes.container.clusters
    assert fakes.registry.repositories and fakes.registry.requests == []
    assert [b.name for b in bucket.list_blobs()] == ["kinetic-prefect/runs/r1/result.pkl"]
    assert _pool(pool).type == "kinetic-gke"

    code, out = _cli(capsys, "pool", "remove", "l4", *_where(cluster), "--dry-run")
    assert code == 0, out
    assert "kp-l4" in out and "will delete" in out and "dry run: nothing was changed." in out
    assert fakes.container.calls("delete_node_pool") == []
    assert any(name.endswith(f"/{cluster}") and "kp-l4" in pools for name, pools in fakes.container.pools.items())
