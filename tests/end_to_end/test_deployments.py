"""prefect.yaml, as an operator uses it: `prefect deploy --all`, a `process` worker for the flows started
somewhere else than the checkout, a polling `kinetic-local` worker for the jobs, `prefect deployment run`
and a schedule that fires on its own. Real Prefect server (conftest), real worker processes, real jobs.

The only change to prefect.yaml is the name of the flows' pool (unique per module, so nothing else on the
server picks these runs up).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from prefect import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from worker_fixture import stop_worker_process

from kinetic_prefect.steps import set_project_directory

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
SAMPLE_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"


def _prefect(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 300) -> str:
    proc = subprocess.run(
        [*PREFECT, *args], cwd=cwd, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _prefect_file(dest: Path, pool: str, transform=None) -> Path:
    """prefect.yaml with its flows' pool renamed (and optionally more changed by ``transform``)."""
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    for deployment in config["deployments"]:
        assert deployment["work_pool"]["name"] == "pipelines"
        deployment["work_pool"]["name"] = pool
    if transform:
        transform(config)
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def _deploy(prefect_file: Path) -> None:
    before = (ROOT / "prefect.yaml").read_text()
    _prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file))
    assert (ROOT / "prefect.yaml").read_text() == before, "deploying must not rewrite prefect.yaml"


def _run(deployment: str, **params) -> str:
    args = [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
    out = _prefect("deployment", "run", deployment, *args)
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def _wait_final(flow_run_id, timeout: float, workers=()) -> object:
    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            for proc, log in workers:
                assert proc.poll() is None, f"a worker died:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"{run.name} still {run.state.name if run.state else '?'} after {timeout}s"
            time.sleep(1)


def _logs(flow_run_id) -> str:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(log.message for log in logs)


def _logs_with(flow_run_id, *needles: str, timeout: float = 20) -> str:
    """The run's logs once they hold every needle (the last batch may land after the final state)."""
    deadline = time.time() + timeout
    while True:
        logs = _logs(flow_run_id)
        if all(n in logs for n in needles) or time.time() > deadline:
            return logs
        time.sleep(0.5)


def _start_worker(args: list[str], cwd: Path, env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(
            [*PREFECT, "worker", "start", *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
        )


@pytest.fixture(scope="module")
def operator(prefect_server, tmp_path_factory):
    """Two pools and their workers, started the way prefect.yaml's header says, from a directory that is
    not the checkout: only the `pull` step can bring the flows' code in."""
    suffix = uuid.uuid4().hex[:6]
    flows_pool, jobs_pool = f"pipelines-{suffix}", f"kinetic-jobs-{suffix}"
    _prefect("work-pool", "create", flows_pool, "--type", "process")
    _prefect("work-pool", "create", jobs_pool, "--type", "kinetic-local")
    elsewhere = tmp_path_factory.mktemp("worker-machine")
    env = {
        **os.environ,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "KINETIC_PROJECT_DIR": str(ROOT),
        "KINETIC_WORK_POOL": jobs_pool,
    }
    workers = []
    for args, name in (
        (["--pool", flows_pool, "--type", "process"], "flows"),
        (["--pool", jobs_pool, "--type", "kinetic-local"], "jobs"),
    ):
        log_path = elsewhere / f"{name}-worker.log"
        workers.append((_start_worker(args, elsewhere, env, log_path), log_path))
    deadline = time.time() + 90
    with get_client(sync_client=True) as client:
        for pool in (flows_pool, jobs_pool):
            while not any(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
                for proc, log in workers:
                    assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, f"no worker online for {pool}"
                time.sleep(0.5)
    deployed: list = []
    yield {"flows_pool": flows_pool, "jobs_pool": jobs_pool, "workers": workers, "dir": elsewhere, "deployed": deployed}
    with get_client(sync_client=True) as client:  # deleting them also deletes their scheduled runs
        for deployment in client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[flows_pool]))
        ):
            client.delete_deployment(deployment.id)
    for proc, _ in workers:
        stop_worker_process(proc)


@pytest.mark.slow
def test_prefect_deploy_creates_every_pipeline_deployment(operator, tmp_path):
    _deploy(_prefect_file(tmp_path / "prefect.yaml", operator["flows_pool"]))
    with get_client(sync_client=True) as client:
        found = client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[operator["flows_pool"]]))
        )
        by_name = {d.name: d for d in found}
    assert set(by_name) == {"weekly-retrain", "monthly-finetune", "hourly-smoke", "monthly-finetune-gke"}
    weekly, monthly, smoke, gke = (
        by_name[n] for n in ("weekly-retrain", "monthly-finetune", "hourly-smoke", "monthly-finetune-gke")
    )
    assert weekly.entrypoint == "flows/eurosat_vit.py:eurosat_vit"
    assert weekly.parameters == {"accelerator": "l4", "epochs": 30, "model_size": "small", "time_budget_minutes": 60}
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in weekly.schedules] == [("0 3 * * 1", "UTC", True)]
    assert monthly.entrypoint == "flows/gemma_lora.py:gemma_lora" and monthly.parameters["retrain"] is True
    assert [(s.schedule.cron, s.active) for s in monthly.schedules] == [("0 4 1 * *", True)]
    assert smoke.schedules[0].schedule.interval == dt.timedelta(hours=1)
    assert set(weekly.tags) == {"eurosat", "retraining"} and "gke" in gke.tags
    for deployment in (weekly, monthly, smoke, gke):
        assert deployment.concurrency_options.collision_strategy.value == "CANCEL_NEW"
        assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1
        # The checkout is named where the worker runs, at run time: nothing of this machine is pinned.
        assert deployment.pull_steps == [
            {
                "kinetic_prefect.steps.set_project_directory": {
                    "directory": "{{ $KINETIC_PROJECT_DIR }}",
                    "must_contain": "prefect.yaml",
                }
            }
        ]
        assert str(ROOT) not in str(deployment.model_dump())
    assert weekly.job_variables == {} and "KINETIC_WORK_POOL" not in str(monthly.job_variables)
    assert gke.job_variables == {"env": {"KINETIC_WORK_POOL": "gpu"}}
    assert gke.parameters["accelerator"] == "l4" and "jax[cuda12]>=0.4.35" in gke.parameters["requirements"]
    assert [s.active for s in gke.schedules] == [False], "ships paused until the GKE pool passes doctor"


@pytest.mark.slow
@pytest.mark.skipif(not SAMPLE_ZIP.is_file(), reason=f"{SAMPLE_ZIP} is absent (it ships with the CI machine only)")
@pytest.mark.timeout(1200)  # its own waits (smoke, schedule, scheduled run, training) decide, not the default 300 s
def test_deployments_run_through_the_workers_and_on_their_schedule(operator, tmp_path):
    """`prefect deployment run` for the smoke flow and the EuroSAT retraining (tiny settings), then a
    short interval schedule on the smoke deployment fires by itself. Jobs go through the polling
    kinetic-local worker (KINETIC_WORK_POOL of the flows' worker).

    Needs ≈ 90 s: a real (tiny) EuroSAT training job, and a schedule that fires by itself, which waits on Prefect's
    scheduler loop; both run side by side, so the test costs the longer of them."""
    started = time.time()
    workers = operator["workers"]
    with get_client(sync_client=True) as client:
        if not client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[operator["flows_pool"]]))
        ):
            _deploy(_prefect_file(tmp_path / "prefect.yaml", operator["flows_pool"]))
    out_dir = tmp_path / "eurosat-out"
    eurosat_id = _run(
        "eurosat-vit/weekly-retrain",
        source=str(SAMPLE_ZIP),
        model_size="tiny",
        epochs=1,
        batch_size=64,
        tta="false",
        output_dir=str(out_dir),
    )  # accelerator: l4, as shipped
    smoke_id = _run("pipeline/hourly-smoke", epochs=2)

    smoke = _wait_final(smoke_id, 240, workers)
    assert smoke.state.is_completed(), _logs(smoke_id)[-3000:]
    smoke_seconds = time.time() - started
    logs = _logs_with(smoke_id, "job result", "set_project_directory")
    assert "set_project_directory" in logs, "the pull step ran"
    assert "job result {'loss': 0.25" in logs and "[polling worker]" in logs

    # A schedule that fires by itself: the operator edits the smoke deployment's schedule and deploys it
    # again. First occurrence a few seconds ahead (the anchor), the next one only 2 minutes later.
    anchor = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=25)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def every_two_minutes(config: dict) -> None:
        smoke = next(d for d in config["deployments"] if d["name"] == "hourly-smoke")
        config["deployments"] = [{**smoke, "schedules": [{"interval": 120, "anchor_date": anchor}]}]

    _deploy(_prefect_file(tmp_path / "prefect-short.yaml", operator["flows_pool"], every_two_minutes))
    with get_client(sync_client=True) as client:
        smoke_deployment = client.read_deployment_by_name("pipeline/hourly-smoke")
        deadline = time.time() + 180  # a slow deploy can miss the anchor: then the next occurrence fires
        while True:
            due = [
                r
                for r in client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[smoke_deployment.id]))
                )
                if r.auto_scheduled and r.expected_start_time <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=20)
            ]
            if due:
                break
            assert time.time() < deadline, "the scheduler created no run"
            time.sleep(1)
    scheduled = min(due, key=lambda r: r.expected_start_time)
    scheduled = _wait_final(scheduled.id, 240, workers)
    assert scheduled.state.is_completed(), _logs(scheduled.id)[-3000:]
    assert scheduled.auto_scheduled and scheduled.parameters == {"epochs": 1}, "the deployment's own parameters"
    with get_client(sync_client=True) as client:  # no more firing during the next test
        for schedule in client.read_deployment_schedules(smoke_deployment.id):
            if schedule.schedule.interval == dt.timedelta(seconds=120):
                client.delete_deployment_schedule(smoke_deployment.id, schedule.id)
        for run in client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[smoke_deployment.id]))
        ):
            if run.state is not None and run.state.is_scheduled():
                client.delete_flow_run(run.id)

    eurosat = _wait_final(eurosat_id, 400, workers)
    assert eurosat.state.is_completed(), _logs(eurosat_id)[-5000:]
    total_seconds = time.time() - started
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[eurosat.id])))
        jobs = client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[operator["jobs_pool"]]))
        )
    keys = {a.key for a in artifacts if a.key}
    assert {"eurosat-report", "eurosat-per-class-metrics", "eurosat-confusion-matrix"} <= keys
    report = next(a for a in artifacts if a.key == "eurosat-report")
    assert "test accuracy" in report.data and "epochs run (best) | 1" in report.data
    assert any(a.type == "table" and "Outputs of kinetic job" in (a.description or "") for a in artifacts)
    assert any(f.suffix == ".keras" for f in out_dir.iterdir())

    # Every job of this test (two smoke runs, one training) was claimed by the polling kinetic-local worker. The
    # pool is the module's: a rerun of this test (pytest --reruns) sees the jobs of the try before it, so only the
    # jobs created since this try started count.
    jobs = [j for j in jobs if j.created is not None and j.created.timestamp() >= started - 5]
    failed = [
        f"{j.name}: {j.state.name}: {j.state.message}\n{_logs(j.id)[-2000:]}"
        for j in jobs
        if not j.state.is_completed()
    ]
    assert len(jobs) >= 3 and not failed, "\n\n".join(failed) or [j.name for j in jobs]
    assert all(j.infrastructure_pid for j in jobs), "the polling worker records the job's pid"
    job_logs = "\n".join(_logs_with(j.id, "loss=") for j in jobs)
    assert "epoch 2/2 loss=0.2500" in job_logs, "the smoke job's own output, streamed by the worker"
    print(f"\nsmoke run {smoke_seconds:.0f}s after start; everything done in {total_seconds:.0f}s")


@pytest.mark.slow
def test_git_clone_pull_step_runs_on_a_worker_without_a_checkout(operator, tmp_path):
    """The alternative pull step: the worker's flow run clones the repository itself (here a local git
    repository holding this working tree; a real remote is just another URL)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file() and not rel.startswith(("bench/", "tests/")):
            (remote / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, remote / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=remote, check=True)
    subprocess.run(["git", "add", "-A"], cwd=remote, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot"], cwd=remote, check=True)

    def from_git(config: dict) -> None:
        git_steps = config["definitions"]["pull"]["git"]
        git_steps[0]["prefect.deployments.steps.git_clone"]["repository"] = remote.as_uri()
        config["pull"] = git_steps
        smoke = next(d for d in config["deployments"] if d["name"] == "hourly-smoke")
        config["deployments"] = [{**smoke, "name": "smoke-from-git", "schedules": []}]

    _deploy(_prefect_file(tmp_path / "prefect.yaml", operator["flows_pool"], from_git))
    run_id = _run("pipeline/smoke-from-git", epochs=1)
    run = _wait_final(run_id, 240, operator["workers"])
    logs = _logs_with(run_id, "job result", "git_clone")
    assert run.state.is_completed(), logs[-3000:]
    assert "Deployment step 'git_clone' completed successfully" in logs and "job result {'loss': 0.5" in logs


def test_project_directory_step_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("KINETIC_PROJECT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="KINETIC_PROJECT_DIR is not set on this worker's machine"):
        set_project_directory("")  # what an unset `{{ $KINETIC_PROJECT_DIR }}` renders to
    with pytest.raises(FileNotFoundError, match="is not a directory on this machine"):
        set_project_directory(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="has no prefect.yaml"):
        set_project_directory(str(tmp_path), must_contain="prefect.yaml")
    assert Path.cwd() == tmp_path
    monkeypatch.setenv("KINETIC_PROJECT_DIR", str(ROOT))
    assert set_project_directory(must_contain="prefect.yaml") == {"directory": str(ROOT)}
    assert Path.cwd() == ROOT
