"""Multi-host groups on kinetic-local (issue 13): ``@kinetic_task(hosts=N)`` runs N job processes on this
machine that form one ``jax.distributed`` group (CPU collectives through gloo).

Real Prefect server (conftest), real job processes, real JAX collectives between them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from test_logs import api_lines
from worker_fixture import new_pool, prefect_cli

from kinetic_prefect import kinetic_task

pytestmark = pytest.mark.slow


def job_runs(task_name: str):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))
    return sorted(runs, key=lambda r: r.created)


def test_a_group_of_two_processes_forms_one_jax_group(store_dir):
    """process_count() is 2, a psum across the two processes sees both, the coordinator's value comes back,
    every host's lines reach the run's log (host 1's tagged), host 1's outputs are kept under hosts/1/."""
    name = f"group-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, hosts=2)
    def collective() -> dict:
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        index = jax.process_index()
        mesh = Mesh(np.array(jax.devices()), ("hosts",))
        local = np.array([float(index + 1)], dtype=np.float32)  # host 0 holds 1, host 1 holds 2
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("hosts")), local)
        summed = jax.jit(
            jax.shard_map(lambda v: jax.lax.psum(v, "hosts"), mesh=mesh, in_specs=P("hosts"), out_specs=P())
        )(x)
        total = float(np.asarray(summed.addressable_data(0))[0])
        print(f"hello from host {index}: psum={total}", flush=True)
        Path(os.environ["KINETIC_OUTPUT_DIR"], "host.txt").write_text(f"host {index}\n")
        return {
            "index": index,
            "count": jax.process_count(),
            "psum": total,
            "devices": len(jax.devices()),
            "run_id": os.environ["KINETIC_RUN_ID"],
        }

    @flow
    def parent():
        return collective()

    result = parent()
    assert result["index"] == 0, "the coordinator's value is the result"
    assert result["count"] == 2 and result["devices"] == 2
    assert result["psum"] == 3.0, "1 + 2: the collective summed over both processes"

    [run] = job_runs(name)
    assert run.state.is_completed()
    lines = api_lines(run.id)
    assert "hello from host 0: psum=3.0" in lines, "host 0's lines go untagged"
    assert "[host 1] hello from host 1: psum=3.0" in lines, "host 1's lines are tagged"
    outputs = store_dir / "outputs" / result["run_id"]
    assert (outputs / "host.txt").read_text() == "host 0\n"
    assert (outputs / "hosts" / "1" / "host.txt").read_text() == "host 1\n"
    host_outcome = json.loads((store_dir / "runs" / result["run_id"] / "hosts" / "1" / "outcome.json").read_text())
    assert host_outcome["status"] == "completed" and host_outcome["host_index"] == 1
    assert not (Path(os.environ["KINETIC_CACHE_DIR"]) / "jobs" / str(run.id)).exists(), "job folder removed"


def _train_curve(global_batch: int, epochs: int, steps_per_epoch: int) -> dict:
    """A tiny Keras model trained data-parallel over every process's CPU device; each process feeds its slice of
    each global batch. Returns the per-epoch loss and the final weights' sum."""
    import jax
    import keras
    import numpy as np

    count, index = jax.process_count(), jax.process_index()
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process passes its own slice of every global batch (below)
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    n = global_batch * epochs * steps_per_epoch
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    local = global_batch // count
    rows = np.concatenate(
        [
            np.arange(j * global_batch + index * local, j * global_batch + (index + 1) * local)
            for j in range(n // global_batch)
        ]
    )
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x[rows], y[rows], batch_size=local, epochs=epochs, shuffle=False, verbose=0)
    weights = sum(float(np.sum(w)) for w in model.get_weights())
    return {"loss": [float(v) for v in history.history["loss"]], "weights": weights, "processes": count}


def test_data_parallel_keras_over_two_processes_matches_one_process():
    """The same global batch on 1 process and on 2: the same loss curve. Tolerance: relative 1e-4. The two runs do
    the same float32 arithmetic except the order of the batch reduction (two partial sums joined by an all-reduce
    instead of one sum), a difference of a few ulps (~1e-7 relative) per step that 12 SGD steps do not amplify
    past ~1e-5; a wrong split of the data (a process seeing the other's rows, or the whole batch twice) or
    unsynchronised gradients changes the curve by whole percents."""
    name = f"dp-{uuid.uuid4().hex[:6]}"
    one = kinetic_task(name=f"{name}-1")(_train_curve)
    two = kinetic_task(name=f"{name}-2", hosts=2)(_train_curve)

    @flow
    def parent():
        return one(32, 4, 3), two(32, 4, 3)

    single, pair = parent()
    assert single["processes"] == 1 and pair["processes"] == 2
    assert single["loss"][-1] < single["loss"][0] * 0.8, "it trains"
    assert pair["loss"] == pytest.approx(single["loss"], rel=1e-4)
    assert pair["weights"] == pytest.approx(single["weights"], rel=1e-4)


def test_one_host_killed_fails_the_group_and_the_retry_resumes_from_the_checkpoint():
    """Host 1 SIGKILLs itself at step 3 on the first attempt: the whole group ends (host 0 is stopped), the job's
    run is Crashed naming host 1, and the task's retry starts a new group that resumes from the checkpoint the
    coordinator saved in KINETIC_CHECKPOINT_DIR, and completes."""
    name = f"killed-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, hosts=2, retries=1, retry_delay_seconds=0)
    def resumable(total_steps: int, kill_at: int) -> dict:
        import signal

        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        state_file = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "state.json"
        start = json.loads(state_file.read_text())["step"] if state_file.exists() else 0
        total = 0.0
        for step in range(start, total_steps):
            gathered = multihost_utils.process_allgather(np.array([float(jax.process_index() + 1)]))
            total += float(np.sum(gathered))
            if jax.process_index() == 0:  # the coordinator's checkpoint is the one the store keeps
                tmp = state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step + 1}))
                os.replace(tmp, state_file)
            print(f"step {step + 1} done", flush=True)
            if step + 1 == kill_at and start == 0 and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost machine, on host 1 only
        return {"start": start, "sum_per_step": total / (total_steps - start)}

    @flow
    def parent():
        return resumable(6, 3)

    result = parent()
    assert result["sum_per_step"] == 3.0
    assert result["start"] >= 3, f"the retry resumed from the coordinator's checkpoint (step {result['start']})"
    first, second = job_runs(name)
    assert first.state.is_crashed(), first.state
    assert "host 1 of 2" in first.state.message and "-9" in first.state.message, first.state.message
    assert second.state.is_completed()


def test_a_host_whose_function_raises_fails_the_group_with_its_error():
    """Host 1's exception (not the coordinator's stop) is what the caller gets, its traceback attached."""
    name = f"raises-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, hosts=2)
    def uneven() -> int:
        import jax
        from jax.experimental import multihost_utils

        if jax.process_index() == 1:
            raise ValueError("host 1 has no data shard")
        multihost_utils.process_allgather(jax.numpy.ones(1))  # host 0 waits here for host 1, which never comes
        return 0

    @flow
    def parent():
        return uneven()

    with pytest.raises(Exception, match="host 1 of 2: host 1 has no data shard"):
        parent()
    [run] = job_runs(name)
    assert run.state.is_failed(), run.state


def test_hosts_below_one_or_on_a_pool_without_groups_is_refused_before_upload(store_dir, tmp_path):
    def body() -> int:
        return 1

    with pytest.raises(ValueError, match=r"hosts=0: a job runs on at least one host.*hosts=2"):
        kinetic_task(hosts=0)(body)
    with pytest.raises(ValueError, match=r"hosts=-1"):
        kinetic_task(body).with_options(hosts=-1)
    with pytest.raises(ValueError, match=r"accelerator 'tpu-v5litepod-16' is a slice of 4 hosts"):
        kinetic_task(accelerator="tpu-v5litepod-16", hosts=2)(body)

    # A pool made from a template without the `hosts` variable (before groups existed) would run one process.
    from kinetic_prefect.workers.local.worker import KineticLocalWorker

    old = KineticLocalWorker.get_default_base_job_template()
    old["job_configuration"].pop("hosts")
    old["variables"]["properties"].pop("hosts")
    pool = new_pool("nogroups")
    template = tmp_path / f"{pool}.json"  # not beside the store: its folder is made by the first call
    template.write_text(json.dumps(old))
    prefect_cli("work-pool", "update", pool, "--base-job-template", str(template))
    runs_before = set((store_dir / "runs").iterdir()) if (store_dir / "runs").exists() else set()
    task = kinetic_task(name=f"nogroups-{uuid.uuid4().hex[:6]}", work_pool=pool, hosts=2)(body)

    @flow
    def parent():
        return task()

    with pytest.raises(ValueError, match=rf"hosts=2: pool '{pool}'.*no `hosts` variable.*work-pool update {pool}"):
        parent()
    runs_after = set((store_dir / "runs").iterdir()) if (store_dir / "runs").exists() else set()
    assert runs_after == runs_before, "nothing was uploaded"


SAMPLE_ZIP = Path(__file__).resolve().parents[3] / "shared" / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"


@pytest.mark.skipif(not SAMPLE_ZIP.exists(), reason=f"{SAMPLE_ZIP} is absent (it ships with the CI machine only)")
def test_eurosat_trains_data_parallel_on_two_local_processes(tmp_path):
    """The EuroSAT flow with hosts=2: one group of two processes trains (global batch 64 = 2 x 32), the coordinator
    scores and publishes; both hosts' epoch lines reach the training job's log."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))
    import eurosat_vit

    state = eurosat_vit.eurosat_vit(
        return_state=True,
        source=str(SAMPLE_ZIP),
        epochs=2,
        model_size="tiny",
        batch_size=64,
        tta=False,
        hosts=2,
        cache_dir=str(tmp_path / "cache"),
        output_dir=str(tmp_path / "out"),
    )
    result = state.result()
    assert result["epochs_run"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    assert Path(result["model_path"]).exists()
    runs = [r for r in job_runs("eurosat-train") if r.parent_task_run_id is not None]
    run = runs[-1]
    assert run.state.is_completed()
    lines = api_lines(run.id)
    assert any(
        line.startswith("group: host 0 of 2, data-parallel over 2 devices; global batch 64 = 2 x 32") for line in lines
    ), lines[:20]
    assert any(line.startswith("[host 1] epoch 2/2 loss=") for line in lines), "host 1's epochs, tagged"
    assert any(line.startswith("epoch 2/2 loss=") for line in lines)
