"""Issue 54, findings 2 and 7, written as the attacker runs them: the forwarded-env Secret block.

Finding 2: a call's ``env=`` values reach a polling worker in the Secret block ``kinetic-env-<run>``, saved before
the run is created. Any API user can rewrite it, and on kinetic-local (and kinetic-vertex) its values went *over*
the signed environment: the victim's own, validly signed job ran with ``PYTHONPATH`` of the attacker's, so the
attacker's ``sitecustomize`` ran holding the victim run's keys. Now the caller signs the block's content (under the
store scope no job holds) and the worker checks it before the job starts; and a forwarded value never sets a name
the signature governs (the job's run, code and keys, ``PYTHONPATH`` and the loader's names), in the caller before
anything is uploaded and in the worker.

Finding 7: the worker loaded (and deleted) whatever block ``KINETIC_ENV_BLOCK`` named *before* it checked the run's
signature, so an unsigned flow run made it read and delete any Secret block. Now the signature is checked first and
only ``kinetic-env-<signed run id>`` is ever read.

Through a real polling kinetic-local worker holding a master key (≈ 8 s to start, a few seconds a run).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import get_client
from prefect.blocks.system import Secret
from prefect.states import Scheduled
from worker_fixture import WorkerProcess, new_pool

from kinetic_prefect import signing
from kinetic_prefect.contract import Env
from kinetic_prefect.shared import key_blocks

MASTER = "master-key-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def keyed_worker(prefect_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("env-block-worker")
    pool = new_pool("envblock")
    cache = folder / "cache"
    worker = WorkerProcess(pool, folder / "worker.log", {Env.SIGNING_KEY: MASTER, Env.CACHE_DIR: str(cache)})
    worker.start()
    yield SimpleNamespace(pool=pool, jobs=cache / "jobs", log=folder / "worker.log")
    worker.stop()


def _flow_run(pool: str, job_variables: dict) -> SimpleNamespace:
    flow_record = SimpleNamespace(name=f"env-{uuid.uuid4().hex[:6]}", version=None, retries=0, retry_delay_seconds=0)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(flow_record, state=Scheduled(), work_pool_name=pool, job_variables=job_variables)
        deadline = time.time() + 120
        while not (state := client.read_flow_run(run.id).state).is_final():
            assert time.time() < deadline, "the worker never answered"
            time.sleep(0.3)
    return SimpleNamespace(id=run.id, state=state)


def _attacker_code(folder: Path, marker: Path) -> Path:
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import json, os\nopen({str(marker)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    return folder


def _victims_call(values: dict[str, str]) -> dict:
    """What a victim's caller does for a polling worker: its env= values saved in the run's block, then the run's
    job variables, naming the block, signed."""
    run_id = "victim-" + uuid.uuid4().hex[:8]
    block = asyncio.run(key_blocks.store_secret_env(values, f"kinetic-env-{run_id}"))
    job_variables = {"env": {Env.RUN_ID: run_id, Env.PAYLOAD_SHA256: "0" * 64, Env.SIGNED: "1", Env.ENV_BLOCK: block}}
    signing.sign_job_variables(signing.Keyring([MASTER.encode()]), job_variables)
    return job_variables


def _rewrite(block: str, extra: dict[str, str]) -> None:
    """The attacker, an API user: reads the block (Prefect lets them) and saves it back with values of theirs."""
    content = Secret.load(block).get()
    content = json.loads(content) if isinstance(content, str) else content
    values = content["values"] if isinstance(content.get("values"), dict) else content
    values.update(extra)
    Secret(value=json.dumps(content)).save(block, overwrite=True)


@pytest.mark.slow
def test_a_rewritten_env_block_never_reaches_the_job(keyed_worker, tmp_path, monkeypatch) -> None:
    """The victim's signed run, its block rewritten between the call and the worker: refused before anything is
    launched, naming the block; the attacker's code never ran. Then a key holder's own block that names what the
    signature governs (the run's code key, PYTHONPATH) is refused too: a forwarded value never replaces them."""
    monkeypatch.setenv(Env.SIGNING_KEY, MASTER)
    marker = tmp_path / "stolen.json"
    code = _attacker_code(tmp_path / "evil", marker)
    job_variables = _victims_call({"WANDB_API_KEY": "victims-token"})
    block = job_variables["env"][Env.ENV_BLOCK]
    _rewrite(block, {"PYTHONPATH": str(code), Env.CODE_KEY: "code/attackers.zip"})
    run = _flow_run(keyed_worker.pool, job_variables)
    assert not marker.exists(), f"the attacker's code ran with {marker.read_text()[:300]}"
    assert run.state.is_failed(), run.state
    assert block in (run.state.message or "") and "nothing was built or launched" in run.state.message, run.state
    assert not (keyed_worker.jobs / str(run.id)).exists(), "a job was started"

    governed = _victims_call({"PYTHONPATH": str(code), "WANDB_API_KEY": "t"})  # saved by a key holder's caller
    run = _flow_run(keyed_worker.pool, governed)
    assert not marker.exists(), f"a forwarded PYTHONPATH ran {marker.read_text()[:300]}"
    assert run.state.is_failed() and "PYTHONPATH" in (run.state.message or ""), run.state


@pytest.mark.slow
def test_an_unsigned_run_cannot_make_the_worker_read_or_delete_a_block(keyed_worker) -> None:
    """An unsigned run (and a signed one) naming a block that is not its own: the block is neither read nor
    deleted, and the run is refused."""
    precious = f"precious-{uuid.uuid4().hex[:8]}"
    Secret(value=json.dumps({"token": "do-not-delete"})).save(precious)
    forged = {"env": {Env.RUN_ID: "r-" + uuid.uuid4().hex[:6], Env.PAYLOAD_SHA256: "0" * 64, Env.ENV_BLOCK: precious}}
    run = _flow_run(keyed_worker.pool, forged)
    assert run.state.is_failed(), run.state
    assert Secret.load(precious).get() == {"token": "do-not-delete"}, "the worker deleted a block an unsigned run named"

    signed = {"env": {**forged["env"], Env.SIGNED: "1"}}
    signing.sign_job_variables(signing.Keyring([MASTER.encode()]), signed)
    run = _flow_run(keyed_worker.pool, signed)
    assert run.state.is_failed() and precious in (run.state.message or ""), run.state
    assert Secret.load(precious).get() == {"token": "do-not-delete"}, "the worker deleted a block that is not the run's"


@pytest.mark.no_server
def test_the_caller_refuses_to_forward_a_name_the_signature_governs() -> None:
    """``env=["PYTHONPATH"]`` (or a kinetic wire name) fails when the call is prepared, before anything is uploaded:
    a forwarded value would go over what the job's signed variables say."""
    from kinetic_prefect.caller.env_capture import forwarded_environment

    for name in ("PYTHONPATH", "LD_PRELOAD", Env.CODE_KEY, Env.RUN_ID, Env.SIGNING_KEY):
        with pytest.raises(ValueError, match=name):
            forwarded_environment((name,), environ={name: "x"})
    assert forwarded_environment(("WANDB_API_KEY", "KERAS_BACKEND"), environ={"WANDB_API_KEY": "k"}, missing="warn")
