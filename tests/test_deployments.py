"""prefect.yaml: the scheduled retraining deployments deploy with `prefect deploy --all`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefect import get_client

ROOT = Path(__file__).resolve().parent.parent


def test_prefect_deploy_creates_the_scheduled_deployments():
    env = {**os.environ, "PREFECT_CLI_PROMPT": "false"}
    for args in (["work-pool", "create", "pipelines", "--type", "process", "--overwrite"],
                 ["--no-prompt", "deploy", "--all"]):
        proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        weekly = deployments["weekly-retrain"]
        assert weekly.work_pool_name == "pipelines" and weekly.parameters["accelerator"] == "l4"
        assert weekly.job_variables["env"]["KINETIC_WORK_POOL"] == "kinetic-local"
        [schedule] = weekly.schedules
        assert schedule.schedule.cron == "0 3 * * 1" and schedule.active
        assert deployments["hourly-smoke"].schedules[0].schedule.interval.total_seconds() == 3600
