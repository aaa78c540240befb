"""Mounted data and the other Data sources Kinetic's users pass (issue 31): ``Data(..., fuse=True)``, a single
gs:// object, and hf:// datasets.

Real here: fake-gcs-server for gs:// data and the store, kinetic-local job processes, the Kubernetes schema
(kubernetes-validate) for the FUSE volumes of a kinetic-gke Job, and the control plane's API server, which accepts
that Job and creates its pod with the volumes. Not here: GKE's Cloud Storage FUSE CSI driver (the control plane
has none, so no volume is mounted live: a FUSE mount is stood in for by a directory at the mount path, which is
what the job reads), and Hugging Face (unreachable: ``HF_ENDPOINT`` points huggingface_hub at
tests/support/hf_mirror.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
from hf_mirror import HubMirror
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from test_gke_manifests import K8S_VERSION, render

from kinetic_prefect import Data, kinetic, kinetic_task
from kinetic_prefect.caller import data_mounts
from kinetic_prefect.contract import FUSE_MOUNT_ROOT, Env
from kinetic_prefect.pod.data import DataError, DataRef, fuse_mount_id, localize, to_ref
from kinetic_prefect.storage import open_store
from kinetic_prefect.workers.base import load_template

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = Path(__file__).resolve().parents[1] / "kinetic_examples"
HF_FILES = {"acme/tiny": {"train.csv": b"text,label\ngood,1\n", "data/test.csv": b"text,label\nbad,0\n"}}


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "dataset" / "sub").mkdir(parents=True)
    (tmp_path / "dataset" / "train.csv").write_text("a,b\n1,2\n")
    (tmp_path / "dataset" / "sub" / "more.txt").write_text("more")
    return tmp_path / "dataset"


# --------------------------------------------------------------------------- caller side: checked before upload


@pytest.mark.no_server
def test_sources_that_cannot_be_mounted_or_fetched_fail_naming_the_fix(tmp_path):
    for source, fuse, says in [
        ("hf://acme/tiny", True, "cannot be mounted"),
        ("https://example.com/data.csv", True, "only gs:// data is mounted"),
        ("s3://bucket/data/", False, "other schemes are not supported"),
        ("gs://bucket/a,b/", True, "comma"),
        ("hf://imdb?split=train", False, "load_dataset(path"),
        ("hf://acme/tiny?branch=x", False, "?revision="),
        ("hf://not a repo", False, "invalid data URL"),
    ]:
        with pytest.raises(DataError, match=says.replace("(", r"\(").replace("?", r"\?")):
            Data(source, fuse=fuse)
    with pytest.raises(DataError, match="fuse takes True or False"):
        Data(str(tmp_path), fuse="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="below /_kinetic/fuse-data/"):
        kinetic.run(accelerator="cpu", volumes={f"{FUSE_MOUNT_ROOT}/x": Data("gs://b/x/")})(lambda: 0)


@pytest.mark.no_server
def test_each_source_travels_as_a_ref_that_says_what_the_job_gets(tmp_path):
    dataset = _tree(tmp_path)
    assert to_ref(Data("gs://b/raw/one.csv"), None) == DataRef("file", "one.csv", None, None, "gs://b/raw/one.csv")
    fused = Data("gs://b/raw/", fuse=True)
    assert repr(fused) == "Data('gs://b/raw/', fuse=True)" and fused != Data("gs://b/raw/")
    assert to_ref(fused, None).fuse == fuse_mount_id(fused) and to_ref(fused, None).kind == "dir"
    local = to_ref(Data(dataset, fuse=True), None)
    assert (local.kind, local.path, local.sha256, local.key) == ("dir", str(dataset), None, None), "not hashed"
    assert to_ref(Data("hf://acme/tiny?revision=v1"), None) == DataRef(
        "dir", "tiny", None, None, "hf://acme/tiny?revision=v1"
    )
    old = Data(dataset)
    state = old.__getstate__()
    del state["fuse"]  # pickled before fuse= existed
    revived = Data.__new__(Data)
    revived.__setstate__(state)
    assert revived.fuse is False and pickle.loads(pickle.dumps(fused)).fuse is True


def _plan(fuse: list[Data], store: str = "gs://store-bucket/kinetic", pool_type: str = "kinetic-gke", has=True):
    call = SimpleNamespace(fuse=fuse, data=[])
    pool = SimpleNamespace(name="gke-pool", type=pool_type)
    return data_mounts.plan(call, pool, {data_mounts.FUSE_VARIABLE} if has else set(), store), call


@pytest.mark.no_server
def test_a_gke_job_mounts_each_fuse_data_read_only_as_gke_documents(tmp_path):
    dataset = _tree(tmp_path)
    sources = [Data("gs://imagenet/train/", fuse=True), Data("gs://cfg/dir/one.json", fuse=True)]
    sources += [Data("gs://whole-bucket", fuse=True), Data(dataset, fuse=True)]
    mounts, call = _plan(sources)
    [manifest] = call.data  # the local FUSE data is uploaded once per content, then mounted from the store
    assert list(mounts.values()) == [
        "gs://imagenet/train",
        "gs://cfg/dir",  # one object: its directory, the job opens <mount>/one.json
        "gs://whole-bucket",
        f"gs://store-bucket/kinetic/data/{manifest.sha256}/files",
    ]
    job = render("l4", gcs_fuse_mounts=mounts, service_account_name="kinetic-jobs").job_manifest
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    template = job["spec"]["template"]
    assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    pod = template["spec"]
    assert pod["serviceAccountName"] == "kinetic-jobs"
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = pod["containers"][0]
    for mount_id, url in mounts.items():
        csi = volumes[f"gcsfuse-{mount_id}"]["csi"]
        bucket, _, directory = url.removeprefix("gs://").partition("/")
        assert csi["driver"] == "gcsfuse.csi.storage.gke.io" and csi["readOnly"] is True
        assert csi["volumeAttributes"] == {
            "bucketName": bucket,
            "mountOptions": "implicit-dirs" + (f",only-dir={directory}" if directory else ""),
        }
        assert {"name": f"gcsfuse-{mount_id}", "mountPath": f"{FUSE_MOUNT_ROOT}/{mount_id}", "readOnly": True} in (
            container["volumeMounts"]
        )
    assert {"name": Env.FUSE_ROOT, "value": FUSE_MOUNT_ROOT} in container["env"]
    assert "volumes" not in render("l4").job_manifest["spec"]["template"]["spec"], "no FUSE data, no volume"
    with pytest.raises(ValueError, match="gcs_fuse_mounts: 'gs://B A D'"):
        render("l4", gcs_fuse_mounts={"0" * 16: "gs://B A D"})


@pytest.mark.no_server
def test_pools_that_cannot_mount_are_refused_and_kinetic_local_is_sent_nothing(tmp_path):
    dataset = _tree(tmp_path)
    with pytest.raises(ValueError, match="no `gcs_fuse_mounts` variable.*prefect work-pool update gke-pool"):
        _plan([Data("gs://b/x/", fuse=True)], has=False)
    with pytest.raises(DataError, match="is not gs://"):
        _plan([Data(dataset, fuse=True)], store=str(tmp_path / "store"))
    mounts, call = _plan([Data(dataset, fuse=True)], pool_type="kinetic-local", has=False)
    assert mounts == {} and call.data == [], "kinetic-local: read in place, nothing uploaded"


@pytest.mark.no_server
def test_the_job_reads_fuse_data_at_its_mount_or_in_place(tmp_path, monkeypatch):
    dataset = _tree(tmp_path)
    store, cache = open_store(tmp_path / "store"), tmp_path / "node"
    in_place = to_ref(Data(dataset, fuse=True), None)
    assert localize(in_place, store, cache) == dataset and not store.list("data") and not cache.exists()
    gone = DataRef("dir", "gone", None, None, None, fuse="1" * 16, path=str(tmp_path / "gone"))
    with pytest.raises(DataError, match="read in place on kinetic-local.*drop fuse=True"):
        localize(gone, store, cache)

    root = tmp_path / "fuse-root"  # stands in for FUSE_MOUNT_ROOT: the CSI driver's mounts
    monkeypatch.setenv(Env.FUSE_ROOT, str(root))
    one = to_ref(Data("gs://cfg/dir/one.json", fuse=True), None)
    (root / one.fuse).mkdir(parents=True)
    (root / one.fuse / "one.json").write_text("{}")
    assert localize(one, store, cache) == root / one.fuse / "one.json"
    with pytest.raises(DataError, match="has no such mount.*base-job-template"):
        localize(to_ref(Data("gs://b/unmounted/", fuse=True), None), store, cache)


@pytest.mark.no_server
def test_hf_data_is_the_dataset_repositorys_files_through_huggingface_hub(tmp_path, monkeypatch):
    """Against tests/support/hf_mirror.py (HF_ENDPOINT), which records what huggingface_hub asks for."""
    store, cache = open_store(tmp_path / "store"), tmp_path / "node"
    with HubMirror(HF_FILES) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        path = localize(to_ref(Data("hf://acme/tiny"), None), store, cache)
        assert (path / "train.csv").read_bytes() == HF_FILES["acme/tiny"]["train.csv"]
        assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == [
            "data/test.csv",
            "train.csv",
        ], "the repository's files, without huggingface_hub's .cache"
        asked = len(hub.requests)
        assert localize(to_ref(Data("hf://acme/tiny"), None), store, cache) == path and len(hub.requests) == asked
        assert "GET /api/datasets/acme/tiny/revision/main" in hub.requests
        with pytest.raises(DataError, match="acme/missing was not found.*HF_TOKEN"):
            localize(to_ref(Data("hf://acme/missing"), None), store, cache)
        with pytest.raises(DataError, match="no revision 'v9'"):
            localize(to_ref(Data("hf://acme/tiny?revision=v9"), None), store, cache)


_LOCALIZE_HF = """
import sys
from kinetic_prefect.pod.data import DataError, localize, to_ref
from kinetic_prefect.storage import open_store
from kinetic_prefect import Data
try:
    localize(to_ref(Data("hf://acme/tiny?revision=v1"), None), open_store(sys.argv[1]), sys.argv[2])
except DataError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.no_server
@pytest.mark.parametrize("offline", [False, True], ids=["hub unreachable", "HF_HUB_OFFLINE"])
def test_hf_data_without_the_hub_names_the_address_and_why(tmp_path, offline):
    """Localized as a job does, in a fresh process (huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is
    imported), with the Hub on a loopback port nothing listens on or downloads turned off: ~3 s for the process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    args = [sys.executable, "-c", _LOCALIZE_HF, str(tmp_path / "store"), str(tmp_path / "node")]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    message = done.stdout.strip()
    assert message.startswith("Data('hf://acme/tiny?revision=v1'): "), message
    if offline:
        assert "downloads are off in the job (HF_HUB_OFFLINE is set)" in message, message
    else:
        assert "the Hugging Face Hub at http://127.0.0.1:9 was unreachable from the job" in message, message
    assert "HF_ENDPOINT" in message and "Traceback" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- through the public API, end to end


def _gcs_pool(store_url: str, keep_warm_seconds: float = 0) -> str:
    name = f"fuse-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    template["variables"]["properties"]["keep_warm_seconds"]["default"] = keep_warm_seconds
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


@pytest.mark.slow
def test_fuse_data_a_single_object_and_hf_data_reach_a_kinetic_local_job(gcs_bucket, tmp_path, monkeypatch):
    """One kinetic-local job (a process: 9-12 s measured beside a running CI suite) against fake-gcs-server and
    the local Hub mirror."""
    store_url = f"{gcs_bucket}/kinetic"
    bucket = open_store(gcs_bucket)
    bucket.put_bytes("raw/one.csv", b"x,y\n1,2\n")
    bucket.put_bytes("raw/images/cat.jpg", b"cat")
    dataset = _tree(tmp_path)

    @kinetic_task(work_pool=_gcs_pool(store_url), env=["HF_ENDPOINT", "STORAGE_EMULATOR_HOST"])
    def look(in_place, mounted, one_object, hf) -> dict:
        from pathlib import Path

        return {
            "in_place": in_place,
            "mounted": sorted(p.relative_to(mounted).as_posix() for p in Path(mounted).rglob("*") if p.is_file()),
            "one_object": [Path(one_object).is_file(), Path(one_object).name, Path(one_object).read_text()],
            "hf": Path(hf, "train.csv").read_text(),
        }

    with HubMirror(HF_FILES) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        got = look(
            Data(dataset, fuse=True),
            Data(f"{gcs_bucket}/raw/", fuse=True),
            Data(f"{gcs_bucket}/raw/one.csv"),
            Data("hf://acme/tiny"),
        )
    assert str(got["in_place"]) == str(dataset), "local FUSE data is used in place on kinetic-local"
    assert got["mounted"] == ["images/cat.jpg", "one.csv"]
    assert got["one_object"] == [True, "one.csv", "x,y\n1,2\n"], "a Data naming one object is that file"
    assert got["hf"] == "text,label\ngood,1\n"
    assert not open_store(store_url).list("data"), "nothing was uploaded for FUSE or remote data"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kinetics_fuse_example_runs_on_kinetic_local(gcs_bucket):
    """Kinetic's examples/example_fuse.py, ported by its import line: seven blocking jobs in one script, on a pool
    that keeps its runner warm between them (one job process for the seven): 30 s, against 43 s with a process
    each, measured one after the other."""
    env = {**os.environ, Env.WORK_POOL: _gcs_pool(f"{gcs_bucket}/kinetic", keep_warm_seconds=60)}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "example_fuse.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All FUSE examples passed!" in proc.stdout


@pytest.mark.slow
def test_the_api_server_accepts_a_job_with_fuse_volumes_and_its_pod_carries_them(kube):
    """The control plane (seconds to create a Job and see its pod): it has no CSI driver, so the pod is kept from
    being scheduled and what is checked is what the API server and the Job controller make of the volumes."""
    from kubernetes import client as k8s

    mounts, _call = _plan([Data("gs://imagenet/train/", fuse=True)])
    job = render("cpu", gcs_fuse_mounts=mounts, namespace="default").job_manifest
    job["spec"]["template"]["spec"]["nodeSelector"] = {"kinetic-test/no-such-node": "true"}
    job["spec"]["template"]["spec"].pop("serviceAccountName", None)
    batch, core = k8s.BatchV1Api(kube.api()), k8s.CoreV1Api(kube.api())
    created = batch.create_namespaced_job("default", job)
    try:
        deadline = time.time() + 30
        while not (
            pods := core.list_namespaced_pod("default", label_selector=f"job-name={created.metadata.name}").items
        ):
            assert time.time() < deadline, "the Job controller created no pod"
            time.sleep(0.3)
        [pod] = pods
        assert pod.metadata.annotations["gke-gcsfuse/volumes"] == "true"
        [volume] = [v for v in pod.spec.volumes if v.csi is not None]
        assert volume.csi.driver == "gcsfuse.csi.storage.gke.io" and volume.csi.read_only is True
        assert volume.csi.volume_attributes == {
            "bucketName": "imagenet",
            "mountOptions": "implicit-dirs,only-dir=train",
        }
        [mount] = [m for m in pod.spec.containers[0].volume_mounts if m.name == volume.name]
        assert mount.read_only and mount.mount_path == f"{FUSE_MOUNT_ROOT}/{next(iter(mounts))}"
    finally:
        batch.delete_namespaced_job(created.metadata.name, "default", propagation_policy="Background")
