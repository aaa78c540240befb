"""Issue 54, finding 1, written as the attacker runs it: the deployment layer of job variables.

A worker checks the caller's signature over a flow run's own job variables, but Prefect merges a *deployment's* job
variables under them and nests dotted names (``"env.PYTHONPATH"``). Anyone with API access and no key copies a
signed run's variables (any API user can read them), creates a deployment on the pool with
``{"env.PYTHONPATH": <their folder>}`` and runs it with the copied variables: on the main of its day the job started
and the attacker's ``sitecustomize`` ran holding the victim run's keys. Now what a job runs with is exactly what a key
holder signed: a signed worker refuses a run whose deployment adds or changes anything, naming the deployment and
the variables, before anything is built, launched or handed a key.

The attack goes through a real polling kinetic-local worker holding a master key (≈ 8 s to start, and a run).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import get_client
from prefect.states import Scheduled
from worker_fixture import WorkerProcess, new_pool

from kinetic_prefect import signing
from kinetic_prefect.contract import Env

MASTER = "master-key-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def keyed_worker(prefect_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deployments-worker")
    pool = new_pool("deployed")
    cache = folder / "cache"
    worker = WorkerProcess(pool, folder / "worker.log", {Env.SIGNING_KEY: MASTER, Env.CACHE_DIR: str(cache)})
    worker.start()
    yield SimpleNamespace(pool=pool, jobs=cache / "jobs", log=folder / "worker.log")
    worker.stop()


def _victims_signed_variables() -> dict:
    """What the attacker copies from a victim's job run over the API: its job variables, signed by the victim."""
    victim = "victim-" + uuid.uuid4().hex[:8]
    job_variables = {"env": {Env.RUN_ID: victim, Env.PAYLOAD_SHA256: "0" * 64, Env.SIGNED: "1"}}
    signing.sign_job_variables(signing.Keyring([MASTER.encode()]), job_variables)
    return job_variables


def _attacker_code(folder: Path, marker: Path) -> Path:
    """A folder whose ``sitecustomize`` writes the job's environment (its signing keys) where the attacker reads."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import json, os\nopen({str(marker)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    return folder


def _run_deployment(pool: str, deployment_variables: dict, run_variables: dict) -> SimpleNamespace:
    """The attacker's deployment on the pool, and a run of it with the copied variables; its final state."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name(f"attack-{uuid.uuid4().hex[:6]}")
        deployment_id = client.create_deployment(
            flow_id, name="attack", work_pool_name=pool, job_variables=deployment_variables
        )
        run = client.create_flow_run_from_deployment(deployment_id, job_variables=run_variables, state=Scheduled())
        deadline = time.time() + 120
        while not (state := client.read_flow_run(run.id).state).is_final():
            assert time.time() < deadline, "the worker never answered"
            time.sleep(0.3)
    return SimpleNamespace(id=run.id, state=state)


@pytest.mark.slow
def test_a_deployment_cannot_add_job_variables_to_a_signed_run(keyed_worker, tmp_path) -> None:
    """The attacker's dotted ``env.PYTHONPATH`` (and the same as a nested ``env``) on a deployment, under a validly
    signed run's own variables: refused, naming the deployment and the variable; the attacker's code never ran."""
    marker = tmp_path / "stolen.json"
    code = _attacker_code(tmp_path / "evil", marker)
    attacks = {
        "dotted": {"env.PYTHONPATH": str(code)},
        "nested": {"env": {"PYTHONPATH": str(code)}},
        "a variable a call may set": {"requirements": ["six"]},
    }
    for what, deployment_variables in attacks.items():
        run = _run_deployment(keyed_worker.pool, deployment_variables, _victims_signed_variables())
        assert not marker.exists(), f"{what}: the attacker's code ran with {marker.read_text()[:300]}"
        assert run.state.is_failed(), (what, run.state)
        message = run.state.message or ""
        assert "refuses the job" in message and "deployment" in message, (what, message)
        assert "nothing was built or launched" in message, (what, message)
        named = "requirements" if what == "a variable a call may set" else "PYTHONPATH"
        assert named in message, (what, message)
        assert not (keyed_worker.jobs / str(run.id)).exists(), f"{what}: a job was started"
    assert MASTER not in keyed_worker.log.read_text()


@pytest.mark.no_server
def test_what_a_deployment_adds_is_what_prefect_would_merge() -> None:
    """The rule without a server, for every launcher (the same lifecycle): a deployment that sets nothing, or only
    what the run already says, adds nothing; ``image`` (what kinetic-gke and kinetic-vertex run when a call sends
    none), a dotted env name, or a changed value is named."""
    from kinetic_prefect.workers.lifecycle import deployment_additions

    run = {"env": {Env.RUN_ID: "r", "A": "1"}, "accelerator": "cpu"}
    assert deployment_additions({}, run) == []
    assert deployment_additions({"accelerator": "cpu", "env": {"A": "1"}}, run) == []
    assert deployment_additions({"image": "attacker/image"}, run) == ["image"]
    assert deployment_additions({"env.PYTHONPATH": "/x"}, run) == ["env.PYTHONPATH"]
    assert deployment_additions({"env.A": "2"}, run) == []  # the run's own nested env wins, as in Prefect
    assert deployment_additions({"env": {"B": "2"}}, run) == ["env.B"]
