"""Issue 54, finding 8: forwarded secrets do not stay in their Secret block when no worker takes the run.

A call's ``env=`` values (``WANDB_API_KEY``, ``HF_TOKEN``) travel to a polling worker in the Prefect Secret block
``kinetic-env-<run id>``, which the worker deletes once it has read it. A run no worker ever took (its caller timed
out or was interrupted before a worker came, or the run was refused before the block was read) left the block,
readable by every API user, for good; ``kinetic-prefect cleanup`` did not look at blocks. Now the caller deletes its
run's block when the call ends, and ``cleanup`` lists (``--yes``: deletes) the blocks of runs that are over.

Against the session's real Prefect server (≈ 30-60 s to start on a loaded machine, shared with the other tests).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect import flow, get_client
from prefect.blocks.system import Secret
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.states import Failed, Scheduled
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task
from kinetic_prefect.contract import Env
from kinetic_prefect.contract.layout import env_block
from kinetic_prefect.shared import key_blocks


def _block_exists(name: str) -> bool:
    try:
        Secret.load(name)
    except ValueError:
        return False
    return True


def _kinetic_run(run_id: str, state) -> None:
    """A kinetic job run of ``run_id`` in ``state``, as a caller creates it."""
    flow_record = SimpleNamespace(
        name=f"cleanup-{uuid.uuid4().hex[:6]}", version=None, retries=0, retry_delay_seconds=0
    )
    with get_client(sync_client=True) as client:
        client.create_flow_run(flow_record, state=state, tags=["kinetic"], job_variables={"env": {Env.RUN_ID: run_id}})


@pytest.mark.slow
def test_a_call_no_worker_takes_leaves_no_forwarded_secret_behind(prefect_server, monkeypatch) -> None:
    """The caller times out waiting for a worker that never comes: its run's block, holding the token, is gone
    when the call has ended (4 s of task timeout, then the run's cancellation)."""
    monkeypatch.setenv("WANDB_API_KEY", "victims-wandb-token")
    pool = new_pool("noworker")
    name = f"untaken-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name, work_pool=pool, submission="worker", env=["WANDB_API_KEY"], timeout_seconds=4, ship_project=False
    )
    def body() -> int:
        return 1

    @flow
    def pipeline() -> int:
        return body()

    with pytest.raises(TimeoutError):
        pipeline()
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    block = (run.job_variables or {}).get("env", {}).get(Env.ENV_BLOCK)
    assert block, f"the call forwarded no env block: {run.job_variables}"
    assert not _block_exists(block), f"{block} still holds the call's forwarded secret after the call ended"


@pytest.mark.slow
def test_cleanup_deletes_the_blocks_of_runs_that_are_over_and_keeps_a_live_runs(
    prefect_server, tmp_path: Path, capsys
) -> None:
    """Blocks left by runs that are gone or refused (Failed) are listed, then deleted with ``--yes``; a block whose
    run is still waiting for a worker is kept, and so is every block younger than ``--older-than``."""
    from kinetic_prefect.cli import main

    store = tmp_path / "store"
    store.mkdir()
    gone, refused, live = (f"{what}-{uuid.uuid4().hex[:8]}" for what in ("gone", "refused", "live"))
    for run_id in (gone, refused, live):
        asyncio.run(key_blocks.store_secret_env({"HF_TOKEN": "secret-" + run_id}, env_block(run_id)))
    _kinetic_run(refused, Failed(message="refused: the job variables are not signed"))
    _kinetic_run(live, Scheduled())

    assert main(["cleanup", "--store", str(store)]) == 0
    listed = capsys.readouterr().out
    assert env_block(gone) not in listed, f"a block younger than --older-than (60 min) was listed: {listed}"

    time.sleep(1.1)  # the blocks' age above --older-than 0
    assert main(["cleanup", "--store", str(store), "--older-than", "0"]) == 0
    listed = capsys.readouterr().out
    assert env_block(gone) in listed and env_block(refused) in listed, listed
    assert env_block(live) not in listed, listed
    assert all(_block_exists(env_block(r)) for r in (gone, refused, live)), "a dry run deleted a block"

    assert main(["cleanup", "--store", str(store), "--older-than", "0", "--yes"]) == 0
    capsys.readouterr()
    assert not _block_exists(env_block(gone)) and not _block_exists(env_block(refused))
    assert _block_exists(env_block(live)), "cleanup deleted the block of a run still waiting for its worker"
    assert "secret-" + live in json.dumps(Secret.load(env_block(live)).get()), "the live run's block was changed"
