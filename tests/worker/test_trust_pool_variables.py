"""Issue 45, findings 7 and 3 (kinetic-local), written as the attacker runs them.

Finding 7: anyone who may create a flow run on a pool sends its job variables. Before, a kinetic-local worker ran a
run's ``command`` (any command on the worker's machine), gave it ``inherit_env: ["*"]`` (the worker's whole
environment) and took its ``env`` over the worker's own names, and handed every such job the pool's signing keys.
Now a call may set only its pool type's ``caller_variables``; the pool pins the rest, and the worker refuses a run
that sets a pinned variable to another value, or a worker-only name in ``env``, before it builds, launches or hands
over anything: the run ends Failed naming the variable and the fix (edit the pool, not the call).

Finding 3 (local part): a kinetic-local job never gets Prefect's credentials or its server's settings
(``PREFECT_API_KEY``, ``PREFECT_API_AUTH_STRING``, ``PREFECT_API_DATABASE_*``, ``PREFECT_SERVER_*``): not from the
worker's own Prefect settings (Prefect's base environment of a job), not through an ``inherit_env`` pattern.

The attacks go through a real polling worker that holds a master key (one worker for the module, ≈ 8 s to start).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolUpdate
from prefect.states import Scheduled
from worker_fixture import WorkerProcess, new_pool

from kinetic_prefect import kinetic_task, signing
from kinetic_prefect.contract import Env
from kinetic_prefect.workers.gke.variables import KineticGKEVariables
from kinetic_prefect.workers.local.variables import KineticLocalVariables
from kinetic_prefect.workers.local.worker import KineticLocalWorker

MASTER = "master-key-" + uuid.uuid4().hex
WORKER_SECRETS = {
    "PREFECT_API_KEY": "pnu_worker_secret_" + uuid.uuid4().hex[:8],
    "PREFECT_API_AUTH_STRING": "admin:worker-secret",
    "PREFECT_API_DATABASE_PASSWORD": "db-secret",
    "PREFECT_SERVER_API_AUTH_STRING": "admin:server-secret",
}
NEVER_IN_A_JOB = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_API_DATABASE_", "PREFECT_SERVER_")


@pytest.fixture(scope="module")
def keyed_worker(prefect_server, tmp_path_factory):
    """A polling kinetic-local worker holding a master key and Prefect credentials, on a pool whose owner lets jobs
    inherit ``PREFECT_*`` (a broad pattern: the launcher still drops Prefect's credentials and server settings)."""
    folder = tmp_path_factory.mktemp("keyed-worker")
    pool = new_pool("keyed")
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
        template["variables"]["properties"]["inherit_env"]["default"] = ["PREFECT_*"]
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
    cache = folder / "cache"
    worker = WorkerProcess(
        pool, folder / "worker.log", {Env.SIGNING_KEY: MASTER, Env.CACHE_DIR: str(cache), **WORKER_SECRETS}
    )
    worker.start()
    yield SimpleNamespace(pool=pool, jobs=cache / "jobs", log=folder / "worker.log")
    worker.stop()


def _attack(pool: str, job_variables: dict) -> object:
    """What the attacker does: a flow run of their own on the pool, with their job variables; its final state."""
    flow_record = SimpleNamespace(name=f"attack-{uuid.uuid4().hex[:6]}", version=None, retries=0, retry_delay_seconds=0)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(flow_record, state=Scheduled(), work_pool_name=pool, job_variables=job_variables)
        deadline = time.time() + 90
        while not (state := client.read_flow_run(run.id).state).is_final():
            assert time.time() < deadline, "the worker never answered"
            time.sleep(0.3)
    return SimpleNamespace(id=run.id, state=state)


def _env_dump(marker: Path) -> str:
    """A command that writes the job's whole environment (the signing key included) to ``marker``."""
    return f"python -c \"import json, os; open('{marker}', 'w').write(json.dumps(dict(os.environ)))\""


@pytest.mark.slow
def test_a_flow_run_cannot_widen_a_local_job(keyed_worker, tmp_path) -> None:
    """Each attack ends Failed with the refusal (the variable, and the fix: edit the pool), no job folder is made,
    and the attacker's command never runs, so no key ever reached a process of theirs."""
    job_env = {Env.RUN_ID: "attacker-run", Env.PAYLOAD_SHA256: "0" * 64}  # looks like a kinetic job
    attacks = {
        "command": ({"command": _env_dump(tmp_path / "command"), "env": job_env}, ["command", "edit the pool"]),
        "inherit_env": (
            {"inherit_env": ["*"], "command": _env_dump(tmp_path / "inherit"), "env": job_env},
            ["inherit_env", "edit the pool"],
        ),
        "empty key": ({"env": {**job_env, Env.SIGNING_KEY: ""}}, [Env.SIGNING_KEY, "only the worker"]),
        "dotted key": ({f"env.{Env.SIGNING_KEY}": "", "env": job_env}, [Env.SIGNING_KEY, "only the worker"]),
        "owner's api": (
            {"env": {**job_env, Env.PREFECT_API_URL: "http://attacker.example/api"}},
            [Env.PREFECT_API_URL, "only the worker"],
        ),
    }
    for what, (job_variables, words) in attacks.items():
        run = _attack(keyed_worker.pool, job_variables)
        ran = [path.read_text()[:300] for path in (tmp_path / "command", tmp_path / "inherit") if path.exists()]
        assert not ran, f"{what}: the attacker's command ran with this environment: {ran}"
        assert run.state.is_failed(), (what, run.state)
        assert all(word in run.state.message for word in words), (what, run.state.message)
        assert "Nothing was started" in run.state.message
        assert not (keyed_worker.jobs / str(run.id)).exists(), f"{what}: a job was started"
    assert MASTER not in keyed_worker.log.read_text()


@pytest.mark.slow
def test_a_flow_run_no_key_holder_signed_is_refused_before_anything_is_built(keyed_worker, tmp_path) -> None:
    """Only variables a call may set, but not a call's: the attacker picks the victim's run id (so a job would be
    handed that run's keys) and requirements of their own (a package's ``.pth`` runs at interpreter start, before
    the payload's signature is checked). The worker checks the caller's signature over the job variables first:
    Failed, nothing built or launched. On the main of its day the worker launched it."""
    victim = "victim-" + uuid.uuid4().hex[:8]
    forged = {Env.RUN_ID: victim, Env.PAYLOAD_SHA256: "0" * 64, Env.SIGNED: "1"}
    signed_by_another = {"env": dict(forged), "requirements": ["six"]}
    signing.sign_job_variables(signing.Keyring([b"not-the-pools-key"]), signed_by_another)
    for what, job_variables in {
        "unsigned": {"env": forged, "requirements": ["six"]},
        "another key": signed_by_another,
    }.items():
        run = _attack(keyed_worker.pool, job_variables)
        assert run.state.is_failed(), (what, run.state)
        assert "refuses the job" in run.state.message and "nothing was built or launched" in run.state.message
        assert not (keyed_worker.jobs / str(run.id)).exists(), f"{what}: a job was started"


@pytest.mark.slow
def test_a_call_of_our_own_still_runs_and_its_job_gets_no_prefect_credential(keyed_worker, monkeypatch) -> None:
    """The control: what @kinetic_task sends (here with per-task env and keep_warm_seconds) passes the worker's check
    and runs, signed. Finding 3: the job's environment holds a scoped keyring, not the master key, and none of the
    worker's Prefect credentials or server settings, though the pool's inherit_env says ``PREFECT_*``."""
    monkeypatch.setenv(Env.SIGNING_KEY, MASTER)
    name = f"env-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name,
        work_pool=keyed_worker.pool,
        submission="worker",
        job_variables={"keep_warm_seconds": 0, "env": {"MY_SETTING": "1"}},
    )
    def environment() -> dict:
        import os

        return dict(os.environ)

    @flow
    def pipeline() -> dict:
        return environment()

    seen = pipeline()
    assert seen["MY_SETTING"] == "1"
    leaked = sorted(name for name in seen if name.startswith(NEVER_IN_A_JOB))
    assert not leaked, f"Prefect credentials or server settings reached the job: {leaked}"
    assert not any(value in seen.values() for value in WORKER_SECRETS.values())
    assert seen[Env.SIGNING_KEY].startswith(signing.SCOPED_PREFIX) and MASTER not in seen[Env.SIGNING_KEY]
    assert "PREFECT_API_URL" in seen  # inherit_env PREFECT_* still gives what is not a credential


@pytest.mark.slow
def test_an_in_process_job_gets_none_of_the_callers_prefect_server_settings() -> None:
    """In-process, Prefect's base environment of a job is the calling process's own settings; this test session's
    include its server's database URL (a password, on PostgreSQL) and PREFECT_SERVER_* settings."""
    name = f"in-process-env-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, submission="in-process")
    def prefect_names() -> list:
        import os

        return sorted(name for name in os.environ if name.startswith("PREFECT_"))

    @flow
    def pipeline() -> list:
        return prefect_names()

    names = pipeline()
    assert not [name for name in names if name.startswith(NEVER_IN_A_JOB)], names


# ------------------------------------------------------------------------------------------ the rule, without a server


def _pool(worker_type: str, **defaults):
    from kinetic_prefect.workers.base import load_template

    template = load_template(worker_type)
    for name, value in defaults.items():
        template["variables"]["properties"][name]["default"] = value
    return SimpleNamespace(name="shared", type=worker_type, base_job_template=template)


def _run(job_variables: dict, deployment_id=None):
    return SimpleNamespace(job_variables=job_variables, deployment_id=deployment_id)


@pytest.mark.no_server
def test_what_a_call_may_set_and_what_the_pool_pins() -> None:
    from kinetic_prefect.workers.overrides import refuse_overrides

    local = _pool("kinetic-local", inherit_env=["HF_*"], command=None)
    configuration = SimpleNamespace(env={})
    assert refuse_overrides(_run({"inherit_env": ["HF_*"], "hosts": 2}), configuration, local) is None  # the pool's
    assert "inherit_env=['*']" in refuse_overrides(_run({"inherit_env": ["*"]}), configuration, local)
    assert "working_dir" in refuse_overrides(_run({"working_dir": "/"}), configuration, local)
    assert "gcp_credentials" in refuse_overrides(_run({"gcp_credentials": "admin"}), configuration, local)
    assert "command" in refuse_overrides(_run({"command.x": "y"}), configuration, local)  # Prefect nests dotted names
    # a deployment's job variables count as the run's
    deployment = SimpleNamespace(job_variables={"command": "sh -c evil"})
    assert "command" in refuse_overrides(_run({}, deployment_id=1), configuration, local, deployment)
    # env is the call's, but not the worker's own names nor Prefect's credentials
    for name in (Env.SIGNING_KEY, Env.SIGNING_KEY_PREVIOUS, Env.OWNER_PID, "PREFECT_API_KEY", "PREFECT_SERVER_X"):
        assert name in refuse_overrides(_run({"env": {name: "x"}}), configuration, local), name
    assert refuse_overrides(_run({"env": {"HF_TOKEN": "x", Env.SIGNED: "1"}}), configuration, local) is None
    # a worker-only name that reached the configuration another way (the pool's env) is refused too
    assert Env.SIGNING_KEY in refuse_overrides(_run({}), SimpleNamespace(env={Env.SIGNING_KEY: ""}), local)

    gke = _pool("kinetic-gke", namespace="jobs", service_account_name="jobs-sa")
    assert refuse_overrides(_run({"image": "mine:1", "gcs_fuse_mounts": {"m": "gs://b/d"}}), configuration, gke) is None
    for name, value in (("namespace", "kube-system"), ("service_account_name", "worker-sa"), ("cluster_config", {})):
        refusal = refuse_overrides(_run({name: value}), configuration, gke)
        assert name in refusal and "prefect work-pool update shared" in refusal, refusal
    assert refuse_overrides(_run({"namespace": "jobs"}), configuration, gke) is None  # the pool's own value


@pytest.mark.no_server
@pytest.mark.parametrize("variables", [KineticLocalVariables, KineticGKEVariables])
def test_every_variable_our_caller_sends_is_on_the_list(variables) -> None:
    """build_job_variables with every option that adds a variable (debug, hosts, image, preemption settings), plus
    what submission adds (a budget, FUSE mounts): all of it a call may set."""
    from kinetic_prefect import accelerators
    from kinetic_prefect.caller.calls import KineticOptions, PreparedCall
    from kinetic_prefect.caller.job_settings import build_job_variables
    from kinetic_prefect.contract import RunLayout
    from kinetic_prefect.shared.image import ImageSpec

    spec = accelerators.resolve("cpu")
    pool_variables = set(variables.model_fields)
    options = KineticOptions(
        accelerator=spec,
        image_spec=ImageSpec(requirements=("numpy",), family=spec.family),
        debug=True,
        hosts=2,
        preemption_retries=1,
        spot_fallback=True,
        image="img:1" if "image" in pool_variables else None,
        job_variables={"keep_warm_seconds": 5, "min_warm": 1, "prices": {}, "capacity_wait_seconds": 9},
    )
    call = PreparedCall(
        layout=RunLayout("run-1"), payload=b"", payload_sha256="0" * 64, code_archive=None, env={}, data=[]
    )
    sent = set(build_job_variables(options, call, "/tmp/store", pool_variables)) | {"max_cost_usd"}
    if "gcs_fuse_mounts" in pool_variables:
        sent.add("gcs_fuse_mounts")
    assert sent <= variables.caller_variables, sent - variables.caller_variables
    assert variables.caller_variables <= pool_variables


@pytest.mark.no_server
def test_dotted_names_are_read_as_prefect_reads_them() -> None:
    from kinetic_prefect.contract.job_variables import sent_variables

    assert sent_variables({"env": {"A": "1"}}, {"env": {"B": "2"}, "env.C": "3"}) == {
        "env": {"A": "1", "B": "2", "C": "3"}
    }


@pytest.mark.no_server
def test_the_caller_refuses_a_pinned_variable_before_anything_is_uploaded() -> None:
    from kinetic_prefect.caller.job_settings import check_pinned_variables

    pool = _pool("kinetic-local")
    with pytest.raises(ValueError, match=r"command=.*edit the pool \(`prefect work-pool update shared"):
        check_pinned_variables(pool, {"command": "sh -c evil"}, KineticLocalWorker.job_configuration_variables)
    with pytest.raises(ValueError, match="PREFECT_API_KEY"):
        check_pinned_variables(pool, {"env": {"PREFECT_API_KEY": "k"}}, KineticLocalVariables)
    check_pinned_variables(pool, {"keep_warm_seconds": 3, "env": {"A": "1"}}, KineticLocalVariables)
