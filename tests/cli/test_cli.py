"""`kinetic-prefect` commands, `doctor` above all, against the session's real Prefect server, real
directories, fake-gcs-server and a Kubernetes API emulator (kmock) serving real Node objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kinetic_prefect import accelerators
from kinetic_prefect.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _pool(kind: str = "kinetic-local", **defaults) -> str:
    """A new pool made the way an operator would (Prefect's CLI), its variables set with pool-set."""
    name = f"doctor-{uuid.uuid4().hex[:6]}"
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", name, "--type", kind],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if defaults:
        assert main(["pool-set", name, *(f"{k}={v}" for k, v in defaults.items())]) == 0
    return name


def _doctor(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()  # what came before (pool-set lines)
    code = main(["doctor", "--json", *args])
    report = json.loads(capsys.readouterr().out)
    return code, report


def _failed(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"] if c["status"] == "fail"}


@pytest.mark.slow
def test_doctor_passes_for_a_healthy_local_pool(tmp_path, capsys):
    pool = _pool(store=str(tmp_path / "store"))
    assert main(["doctor", "--pool", pool]) == 0
    out = capsys.readouterr().out
    assert "All checks passed." in out and "✗" not in out
    assert f"'{pool}' is of type kinetic-local" in out
    assert f"{tmp_path / 'store'}: wrote, read back and deleted a test object" in out
    assert list((tmp_path / "store").iterdir()) == [], "the test object and its folder are gone"
    code, report = _doctor(capsys, "--pool", pool)
    assert code == 0 and report["ok"] and report["pool_type"] == "kinetic-local"
    assert [c["name"] for c in report["checks"]] == ["Prefect API", "Work pool", "Store", "Isolation"]


def test_doctor_names_the_fix_for_a_missing_pool(capsys):
    code = main(["doctor", "--pool", "no-such-pool"])
    out = capsys.readouterr().out
    assert code == 1
    assert "✗ Work pool" in out and "'no-such-pool' does not exist" in out
    assert "fix: create it: `prefect work-pool create no-such-pool --type kinetic-local`" in out
    assert "1 check(s) failed." in out


def test_doctor_refuses_a_malformed_gke_cluster_before_checking_anything(capsys):
    code = main(["doctor", "--pool", "no-such-pool", "--gke-cluster", "my-project/us-central1/my-cluster"])
    captured = capsys.readouterr()
    assert code != 0 and "Work pool" not in captured.out, "nothing was checked"
    said = " ".join((captured.out + captured.err).split())
    assert "--gke-cluster 'my-project/us-central1/my-cluster'" in said
    assert "projects/PROJECT/locations/LOCATION/clusters/CLUSTER" in said


@pytest.mark.slow
def test_doctor_rejects_a_pool_that_is_not_a_kinetic_type(capsys):
    pool = _pool("process")
    code, report = _doctor(capsys, "--pool", pool)
    assert code == 1 and "not a kinetic worker type" in _failed(report)["Work pool"]["detail"]


@pytest.mark.slow
def test_doctor_fails_on_an_unwritable_store(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    pool = _pool(store=str(blocker / "store"))  # cannot be created, whoever runs the test (root included)
    code = main(["doctor", "--pool", pool])
    out = capsys.readouterr().out
    assert code == 1
    assert f"✗ Store        {blocker / 'store'}: failed while opening a test object" in out
    assert f"fix: make {blocker / 'store'} a directory this user can write" in out
    assert "kinetic-prefect pool-set POOL store=/writable/dir" in out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_doctor_fails_on_a_read_only_store_directory(tmp_path, capsys):
    store = tmp_path / "read-only"
    store.mkdir()
    store.chmod(0o500)
    try:
        code, report = _doctor(capsys, "--store", str(store))
    finally:
        store.chmod(0o700)
    assert code == 1 and "failed while writing" in _failed(report)["Store"]["detail"]


@pytest.mark.slow
def test_doctor_gke_pool_with_cloud_build_but_no_project(gcs_bucket, capsys):
    pool = _pool(
        "kinetic-gke",
        image_builder="cloud-build",
        gcp_region="europe-west4",
        build_staging_bucket="builds",
        image_repository="europe-west4-docker.pkg.dev/p/kinetic",
        store=f"{gcs_bucket}/kinetic",
        kubeconfig_path="/nonexistent/kubeconfig",
    )
    code = main(["doctor", "--pool", pool])
    out = capsys.readouterr().out
    assert code == 1
    assert "✗ Cloud Build: gcp_project" in out
    assert f"fix: kinetic-prefect pool-set {pool} gcp_project=YOUR_PROJECT" in out
    for present in ("gcp_region", "build_staging_bucket", "image_repository"):
        assert f"Cloud Build: {present}" not in out
    assert "✓ Store" in out and "✓ GCS credentials" in out and "STORAGE_EMULATOR_HOST" in out
    assert "✗ Kubernetes" in out and "gcloud container clusters get-credentials" in out

    # The fix, applied as printed, clears that check.
    assert main(["pool-set", pool, "gcp_project=my-project"]) == 0
    capsys.readouterr()
    code, report = _doctor(capsys, "--pool", pool)
    assert "Cloud Build: gcp_project" not in _failed(report)
    assert set(_failed(report)) == {"Kubernetes"}, "only the unreachable cluster is left"


@pytest.fixture
def cluster(tmp_path):
    """kmock's Kubernetes API emulator with two real Node objects: a CPU node and an L4 GPU node."""
    from k8s_emulator import KubeEmulator
    from kubernetes import client

    emulator = KubeEmulator(tmp_path)
    emulator._state["emulator"].resources["v1/nodes"] = {}
    core = client.CoreV1Api(emulator.api())
    core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "cpu-1", "labels": {"cloud.google.com/gke-nodepool": "default-pool"}},
        }
    )
    core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": "l4-1",
                "labels": {"cloud.google.com/gke-nodepool": "kinetic-l4", accelerators.GPU_LABEL: "nvidia-l4"},
            },
        }
    )
    yield emulator
    emulator.stop()


@pytest.mark.slow
def test_doctor_checks_node_pools_for_the_deployments_accelerators(cluster, gcs_bucket, capsys):
    pool = _pool(
        "kinetic-gke",
        image="europe-docker.pkg.dev/p/kinetic/job:1",
        store=f"{gcs_bucket}/k",
        kubeconfig_path=str(cluster.kubeconfig_path),
    )
    # A deployment that sends its kinetic tasks to this pool on an L4 (what prefect.yaml's -gke variant does).
    from prefect import flow, get_client

    @flow(name=f"doctor-flow-{pool}")
    def noop(accelerator: str = "cpu"):
        return accelerator

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(noop)
        client.create_deployment(
            flow_id=flow_id,
            name="uses-l4",
            parameters={"accelerator": "l4"},
            job_variables={"env": {"KINETIC_WORK_POOL": pool}},
        )
    code, report = _doctor(capsys, "--pool", pool)
    assert code == 0, report
    assert report["accelerators"] == ["l4"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["Node pool for l4"]["detail"] == "1 node(s) with cloud.google.com/gke-accelerator=nvidia-l4"
    assert checks["Kubernetes"]["detail"].endswith("2 node(s)")
    fuse = checks["Cloud Storage FUSE"]  # the emulator has no CSI driver: named, with the add-on and the IAM binding
    assert (
        fuse["status"] == "warn" and "GcsFuseCsiDriver=ENABLED" in fuse["fix"] and "storage.objectViewer" in fuse["fix"]
    )

    code, report = _doctor(capsys, "--pool", pool, "--accelerator", "h100x8", "-a", "tpu-v6e-4:spot")
    assert code == 1 and report["accelerators"] == ["h100x8", "l4", "tpu-v6e-4:spot"]
    failed = _failed(report)
    assert set(failed) == {"Node pool for h100x8", "Node pool for tpu-v6e-4:spot"}
    assert "--accelerator type=nvidia-h100-80gb,count=8" in failed["Node pool for h100x8"]["fix"]
    assert "--machine-type a3-highgpu-8g" in failed["Node pool for h100x8"]["fix"]
    tpu = failed["Node pool for tpu-v6e-4:spot"]
    assert (
        "cloud.google.com/gke-tpu-topology=2x2" in tpu["detail"] and "cloud.google.com/gke-spot=true" in tpu["detail"]
    )
    assert "--tpu-topology 2x2" in tpu["fix"] and "--spot" in tpu["fix"]


@pytest.mark.slow
def test_doctor_for_a_gke_pool_with_a_local_store_and_no_image(capsys, tmp_path):
    pool = _pool("kinetic-gke", store=str(tmp_path / "s"), kubeconfig_path="/nonexistent/kubeconfig")
    code, report = _doctor(capsys, "--pool", pool)
    failed = _failed(report)
    assert code == 1
    assert f"kinetic-prefect pool-set {pool} store=gs://YOUR_BUCKET/kinetic" == failed["Store for GKE"]["fix"]
    assert "image_builder=none" in failed["Job image"]["detail"]
    assert "image_builder=cloud-build" in failed["Job image"]["fix"]


@pytest.mark.slow
def test_doctor_reports_an_unreachable_api(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # port 9 (discard): nothing listens
    proc = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.cli", "doctor", "--store", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "✗ Prefect API  http://127.0.0.1:9/api does not answer" in proc.stdout
    assert "fix: start a server with `prefect server start`" in proc.stdout
    assert "- Work pool" in proc.stdout and "✓ Store" in proc.stdout


@pytest.mark.slow
def test_pool_set_parses_values_and_refuses_unknown_variables(capsys):
    pool = _pool()
    assert main(["pool-set", pool, "stream_output=false", 'env={"A": "1"}', "store=/tmp/x"]) == 0
    assert main(["pool-set", pool, "no_such_variable=1"]) == 1
    err = capsys.readouterr().err
    assert "has no variable 'no_such_variable'" in err and "accelerator" in err
    from prefect import get_client

    with get_client(sync_client=True) as client:
        props = client.read_work_pool(pool).base_job_template["variables"]["properties"]
    assert props["stream_output"]["default"] is False and props["env"]["default"] == {"A": "1"}
    assert props["store"]["default"] == "/tmp/x"


@pytest.mark.slow
def test_pool_set_refuses_prices_for_an_unknown_accelerator(capsys):
    """A typo in `prices` is refused by pool-set itself, naming the entry and the closest names, and nothing is
    written: otherwise the pool takes it and the next call fails on it."""
    pool = _pool()
    capsys.readouterr()
    assert main(["pool-set", pool, 'prices={"l44": {"on_demand": 0.7}}', "store=/tmp/x"]) == 1
    err = capsys.readouterr().err
    assert "'l44'" in err and "Closest valid names:" in err and "l4" in err.split("Closest valid names:")[1], err
    from prefect import get_client

    with get_client(sync_client=True) as client:
        props = client.read_work_pool(pool).base_job_template["variables"]["properties"]
    assert "default" not in props["prices"] or props["prices"]["default"] in (None, {}, ""), props["prices"]
    assert props["store"].get("default") != "/tmp/x", "a refused pool-set wrote its other values"


@pytest.mark.slow
def test_pool_set_with_an_empty_value_unsets_the_variable():
    """`KEY=` leaves the variable without a default (the pools' forms need no null defaults): the job then gets
    the configuration's own default."""
    pool = _pool()
    assert main(["pool-set", pool, "store=/tmp/x"]) == 0
    assert main(["pool-set", pool, "store="]) == 0
    from prefect import get_client

    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    assert "default" not in template["variables"]["properties"]["store"], template["variables"]["properties"]["store"]


def test_catalog_and_accelerators_commands(tmp_path, capsys):
    assert main(["catalog"]) == 0
    assert capsys.readouterr().out == accelerators.markdown_table()
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- catalog:start -->\nold\n<!-- catalog:end -->\n")
    assert main(["catalog", "--write-readme", str(readme)]) == 0
    assert accelerators.markdown_table().rstrip() in readme.read_text() and "old" not in readme.read_text()

    assert main(["accelerators", "--json", "--family", "gpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    l4 = next(r for r in rows if r["name"] == "l4")
    assert l4["node_selector"] == {accelerators.GPU_LABEL: "nvidia-l4"} and l4["machine_type"] == "g2-standard-8"
    assert {r["family"] for r in rows} == {"gpu"}
    assert main(["accelerators"]) == 0
    table = capsys.readouterr().out
    assert "tpu-v6e-8" in table and "nvidia-l4" in table
    assert main(["accelerators", "--family", "fpga"]) == 2
    assert "choose cpu, gpu or tpu" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_exit_status(tmp_path):
    script = Path(sys.executable).parent / "kinetic-prefect"
    ok = subprocess.run([str(script), "doctor", "--store", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [str(script), "doctor", "--pool", "missing-for-scripts"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "prefect work-pool create missing-for-scripts" in bad.stdout
    usage = subprocess.run(
        [str(script), "gke-worker-manifests", "--pool", "x"], capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and "give --image IMAGE, or --repository REPOSITORY" in usage.stderr


@pytest.mark.slow
def test_doctor_deployments_finds_scheduled_runs_that_cannot_start(capsys):
    """--deployments: a scheduled deployment whose flows' pool nobody polls (warning) and whose kinetic
    pool does not exist (failure), next to a healthy one."""
    from prefect import flow, get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    flows_pool, jobs_pool = _pool("process"), _pool()
    suffix = uuid.uuid4().hex[:6]

    @flow(name=f"doctor-scheduled-{suffix}")
    def scheduled_flow(accelerator: str = "cpu"):
        return accelerator

    def hourly():
        return [DeploymentScheduleCreate(schedule=IntervalSchedule(interval=3600), active=True)]

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(scheduled_flow)
        broken = client.create_deployment(
            flow_id=flow_id,
            name="broken",
            work_pool_name=flows_pool,
            schedules=hourly(),
            parameters={"accelerator": "l4"},
            job_variables={"env": {"KINETIC_WORK_POOL": "gpu-never-created"}},
        )
        fine = client.create_deployment(
            flow_id=flow_id,
            name="fine",
            work_pool_name=flows_pool,
            schedules=hourly(),
            job_variables={"env": {"KINETIC_WORK_POOL": jobs_pool}},
        )
    try:
        code, report = _doctor(capsys, "--pool", jobs_pool, "--deployments")
    finally:
        with get_client(sync_client=True) as client:
            client.delete_deployment(broken)
            client.delete_deployment(fine)
    assert code == 1
    mine = [c for c in report["checks"] if c["name"].startswith(f"Deployment doctor-scheduled-{suffix}/")]
    by = {(c["name"].rsplit("/", 1)[1], c["status"]): c for c in mine}
    assert set(by) == {("broken", "warn"), ("broken", "fail"), ("fine", "warn")}
    assert "pool 'gpu-never-created', which does not exist" in by["broken", "fail"]["detail"]
    assert "prefect work-pool create gpu-never-created --type kinetic-gke" in by["broken", "fail"]["fix"]
    assert f"no worker polls its flows' pool {flows_pool!r}" in by["fine", "warn"]["detail"]
    assert f"prefect worker start --pool {flows_pool}" in by["fine", "warn"]["fix"]
