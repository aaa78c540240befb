"""The ``kinetic`` API (Keras Kinetic's surface on Prefect): accelerator names, options, and Kinetic's documented
examples, written here with the calls of Kinetic's docs and examples (simple demo, Keras training, Data API,
detached jobs, batched jobs, collections, checkpointing), their import line changed to
``from kinetic_prefect import kinetic``, small and on the CPU, on kinetic-local against the session's real
Prefect server. Detached jobs go through a real polling worker and real separate processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, WorkPoolFilter, WorkPoolFilterName

from kinetic_prefect import accelerator_names as names
from kinetic_prefect import (
    accelerators,
    kinetic,  # the one line a Kinetic script changes
)
from kinetic_prefect.cli import main as cli
from kinetic_prefect.contract import DETACHED_TAG, Env, RunLayout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = Path(__file__).resolve().parents[1] / "kinetic_examples"
DOC = ROOT / "docs" / "coming-from-kinetic.md"


# --------------------------------------------------------------------------- accelerator names: both readings

# name -> (Kinetic's reading, this catalog's reading), each (chips, topology, hosts) or None where that naming has no
# such name. Kinetic's column is its docs/accelerators.md table (chips in every TPU name); this catalog's follows GKE
# and Cloud TPU (v4/v5p names count TensorCores, two per chip; tpu-v6e-8 is one ct6e-standard-8t host).
READINGS = {
    "v5p-8": ((8, "2x2x2", 2), (4, "2x2x1", 1)),
    "tpu-v5p-16": ((16, "2x2x4", 4), (8, "2x2x2", 2)),
    "v5p-32": ((32, "2x4x4", 8), (16, "2x2x4", 4)),
    "v6e-8": ((8, "2x4", 2), (8, "2x4", 1)),
    "v6e-16": ((16, "4x4", 4), (16, "4x4", 4)),
    "v4-4": ((4, "2x2x1", 1), None),
    "v4-8": ((8, "2x2x2", 2), (4, "2x2x1", 1)),
    "tpu-v4-16": ((16, "2x2x4", 4), (8, "2x2x2", 2)),
    "v5litepod-1": ((1, "1x1", 1), (1, "1x1", 1)),
    "v5litepod-4": ((4, "2x2", 1), (4, "2x2", 1)),
    "v5litepod-8": ((8, "2x4", 1), (8, "2x4", 1)),
    "tpu-v5e-16": ((16, "4x4", 4), (16, "4x4", 4)),
    "v3-4": (None, None),  # Kinetic has it; GKE, and so this catalog, does not
    "l4": ((1, None, 1), (1, None, 1)),
    "a100x4": ((4, None, 1), (4, None, 1)),
}
# The same names the doc page's table shows.
DOC_TABLE_NAMES = [
    "v5p-8",
    "tpu-v5p-16",
    "v5p-32",
    "v6e-8",
    "v6e-16",
    "v4-4",
    "v4-8",
    "tpu-v4-16",
    "v5litepod-4",
    "v5litepod-8",
    "tpu-v5e-16",
    "l4",
    "a100x4",
    "tpu:8",
    "gpu:4",
]


def _shape(spec):
    return None if spec is None else (spec.chips, spec.tpu_topology, spec.hosts)


@pytest.mark.parametrize("name", list(READINGS))
def test_accelerator_names_read_both_ways(name):
    kinetic_reading, catalog_reading = READINGS[name]
    ours, theirs = names.both_readings(name)
    assert _shape(ours) == catalog_reading
    if name == "v3-4":
        with pytest.raises(accelerators.UnknownAcceleratorError, match="TPU v3 is not in this catalog.*nearest"):
            names.kinetic_reading(name)
        return
    assert _shape(theirs) == kinetic_reading
    # Kinetic's reading is a real entry of this catalog: the worker gets it back from its name
    assert accelerators.resolve(theirs.name) == theirs
    if theirs.family == "tpu":  # and on Kinetic's machine type
        shapes = next(rows for label, _, rows in names.TPU_FAMILIES_KINETIC.values() if label == theirs.gke_accelerator)
        assert theirs.machine_type == shapes[theirs.chips].machine_type


def test_the_doc_page_shows_the_readings_this_code_uses():
    table = names.naming_table(DOC_TABLE_NAMES)
    assert table in DOC.read_text(), "docs/coming-from-kinetic.md: paste names.naming_table(DOC_TABLE_NAMES)"


def test_kinetic_spellings():
    read = lambda name: names.kinetic_reading(name).name  # noqa: E731
    assert [
        read(n)
        for n in (
            "cpu",
            "cpu:8",
            "gpu",
            "gpu-l4",
            "gpu:l4",
            "nvidia-l4",
            "gpu:a100x4",
            "gpu:4",
            "tpu",
            "tpu:8",
            "tpu-v5e-1",
            "v5litepod-2x4",
            "v6e-2x4",
        )
    ] == [
        "cpu",
        "cpu",
        "l4",
        "l4",
        "l4",
        "l4",
        "a100x4",
        "h100x4",
        "tpu-v5litepod-4",
        "tpu-v6e-8-2hosts",
        "tpu-v5litepod-1",
        "tpu-v5litepod-8",
        "tpu-v6e-8-2hosts",
    ]
    assert names.kinetic_reading("v5p-8:spot").spot
    with pytest.raises(accelerators.UnknownAcceleratorError, match=r"v5p comes in \[8, 16, 32\] chips"):
        names.kinetic_reading("v5p-4")
    with pytest.raises(accelerators.UnknownAcceleratorError, match="Unknown Kinetic accelerator 'v9z-8'"):
        names.kinetic_reading("v9z-8")


def test_kinetic_task_warns_once_where_the_namings_disagree():
    from kinetic_prefect import kinetic_task

    names._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kinetic_task(accelerator="tpu-v5p-8", name="noop")(lambda: None)
        kinetic_task(accelerator="tpu-v5p-8", name="noop")(lambda: None)  # once per name
        kinetic_task(accelerator="tpu-v5p-2x2x1", name="noop")(lambda: None)  # the unambiguous spelling: silent
        kinetic_task(accelerator="tpu-v5litepod-4", name="noop")(lambda: None)  # both namings agree: silent
        kinetic_task(accelerator="l4", name="noop")(lambda: None)
    messages = [str(w.message) for w in caught if issubclass(w.category, names.AcceleratorNamingWarning)]
    assert len(messages) == 1, messages
    assert "'tpu-v5p-8'" in messages[0] and "4 chips (2x2x1) on 1 host" in messages[0]
    assert "8 chips (2x2x2) on 2 hosts, which is 'tpu-v5p-16' here" in messages[0]
    assert "Write 'tpu-v5p-2x2x1'" in messages[0]
    assert caught[0].filename == __file__, "the warning points at the decorated code"


def test_kinetic_run_reads_names_as_kinetic_does():
    @kinetic.run(accelerator="v5p-8")
    def f():
        return 1

    assert f.task.kinetic.accelerator.name == "tpu-v5p-16" and f.task.kinetic.accelerator.hosts == 2
    assert "accelerator:tpu-v5p-16" in f.task.tags
    assert kinetic.run(accelerator="l4", spot=True)(lambda: 0).task.kinetic.accelerator.spot


@pytest.mark.parametrize(
    "option, value, nearest",
    [
        ("zone", "us-central1-a", "work_pool='NAME'"),
        ("cluster", "research", "work_pool='NAME'"),
        ("backend", "pathways", "hosts=N"),
        ("base_image_repo", "me/kinetic", "base_image='IMAGE'"),
    ],
)
def test_options_without_an_equivalent_name_the_nearest(option, value, nearest):
    with pytest.raises(TypeError, match=re.escape(nearest)) as info:
        kinetic.run(accelerator="cpu", **{option: value})
    assert f"kinetic.run({option}={value!r})" in str(info.value)


def test_prefect_options_pass_through():
    @kinetic.run(accelerator="cpu", retries=2, tags=["sweep"])
    def f():
        return 1

    assert f.task.retries == 2 and "sweep" in f.task.tags


# --------------------------------------------------------------------------- Kinetic's examples, blocking calls


@pytest.mark.slow
def test_simple_demo():
    """examples/simple_demo.py: a Keras model trained in the job; a blocking call outside any flow."""

    @kinetic.run(accelerator="cpu")
    def train_keras_jax_model():
        import jax
        import keras
        import numpy as np

        print(f"Keras {keras.__version__}, backend {keras.config.backend()}, JAX devices {jax.devices()}")
        model = keras.Sequential(
            [
                keras.layers.Input(shape=(8, 8, 1)),
                keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(),
            optimizer=keras.optimizers.Adam(1e-3),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        )
        x = np.random.rand(64, 8, 8, 1).astype(np.float32)
        y = np.random.randint(0, 10, size=(64,)).astype(np.int32)
        history = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
        return history.history["loss"][-1]

    loss = train_keras_jax_model()
    assert isinstance(loss, float) and 0 < loss < 10


@pytest.mark.slow
def test_data_api(tmp_path):
    """examples/example_data_api.py: Data as a directory, a file (twice: the second upload is a cache hit), volumes
    at fixed paths, mixed with arguments, nested in a list."""
    Data = kinetic.Data
    dataset_dir = tmp_path / "dataset"
    dataset_dir.mkdir()
    (dataset_dir / "train.csv").write_text("feature,label\n1,100\n2,200\n3,300\n")
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({"lr": 0.01, "epochs": 10}))
    mounts = f"/tmp/kinetic-volumes-{uuid.uuid4().hex[:8]}"  # Kinetic's example mounts at /data and /weights

    @kinetic.run(accelerator="cpu")
    def test_data_arg(data_dir):
        with open(f"{data_dir}/train.csv") as f:
            return {"files": sorted(os.listdir(data_dir)), "content": f.read()}

    @kinetic.run(accelerator="cpu")
    def test_file_arg(config_path):
        with open(config_path) as f:
            return json.load(f)

    @kinetic.run(accelerator="cpu", volumes={f"{mounts}/data": Data(str(dataset_dir))})
    def test_volumes():
        with open(f"{mounts}/data/train.csv") as f:
            return {"files": sorted(os.listdir(f"{mounts}/data")), "content": f.read()}

    @kinetic.run(accelerator="cpu", volumes={f"{mounts}/weights": Data(str(dataset_dir))})
    def test_mixed(config_path, lr=0.001):
        with open(config_path) as f:
            return {"config": json.load(f), "lr": lr, "has_weights": os.path.isdir(f"{mounts}/weights")}

    @kinetic.run(accelerator="cpu")
    def test_nested(datasets):
        return [sorted(os.listdir(d)) for d in datasets]

    result = test_data_arg(Data(str(dataset_dir)))
    assert result["files"] == ["train.csv"] and "1,100" in result["content"]
    assert test_file_arg(Data(str(config_json)))["lr"] == 0.01
    assert test_file_arg(Data(str(config_json)))["lr"] == 0.01  # the same content: not uploaded again
    result = test_volumes()
    assert result["files"] == ["train.csv"] and "2,200" in result["content"]
    result = test_mixed(Data(str(config_json)), lr=0.01)
    assert result == {"config": {"lr": 0.01, "epochs": 10}, "lr": 0.01, "has_weights": True}
    assert test_nested(datasets=[Data(str(dataset_dir)), Data(str(dataset_dir))]) == [["train.csv"], ["train.csv"]]
    assert not os.path.lexists(f"{mounts}/data"), "the volume's link is removed after the call"


def test_checkpointing(tmp_path):
    """docs/guides/checkpointing.md: a job saves a checkpoint every step under KINETIC_OUTPUT_DIR (output_dir=),
    and the next job resumes from the latest one. (Kinetic's example saves with Orbax; numpy files here, as Orbax is
    not a dependency of this project.)"""
    output_dir = str(tmp_path / "run-outputs")

    @kinetic.run(accelerator="cpu", output_dir=output_dir)
    def train_with_checkpoints():
        import glob

        import numpy as np

        out = os.environ["KINETIC_OUTPUT_DIR"]
        steps = sorted(int(p.rsplit("-", 1)[1].split(".")[0]) for p in glob.glob(f"{out}/ckpt-*.npy"))
        start = steps[-1] + 1 if steps else 0
        weights = np.load(f"{out}/ckpt-{steps[-1]}.npy") if steps else np.zeros(3)
        for step in range(start, start + 3):
            weights = weights + 1
            np.save(f"{out}/ckpt-{step}.npy", weights)
        return {"start": start, "weights": weights.tolist()}

    assert train_with_checkpoints() == {"start": 0, "weights": [3.0, 3.0, 3.0]}
    assert train_with_checkpoints() == {"start": 3, "weights": [6.0, 6.0, 6.0]}


# --------------------------------------------------------------------------- batched jobs and collections


@pytest.mark.slow
def test_keras_training_batch():
    """docs/guides/batched_jobs.md, "A first batch": a Keras regression per learning rate, results in input order."""

    @kinetic.run(accelerator="cpu")
    def train(lr):
        import keras
        import numpy as np

        x = np.random.rand(200, 20).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential(
            [keras.layers.Input(shape=(20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=lr), loss="mse")
        history = model.fit(x, y, epochs=3, verbose=0)
        return {"lr": lr, "loss": history.history["loss"][-1]}

    batch = train.run_async_map([0.001, 0.01, 0.1])
    losses = batch.results(timeout=600)
    assert [r["lr"] for r in losses] == [0.001, 0.01, 0.1]
    assert all(isinstance(r["loss"], float) for r in losses)
    assert batch.status_counts() == {"SUCCEEDED": 3}


@pytest.mark.timeout(900)  # several processes and jobs; minutes on a loaded machine
@pytest.mark.slow
def test_collections(tmp_path):
    """examples/example_collections.py: a sweep of dict inputs with max_concurrent=2, reattached by group id, streamed
    with as_completed, failures with return_exceptions, a retry, and the clean-up."""

    @kinetic.run(accelerator="cpu")
    def train(lr, epochs):
        return {"lr": lr, "epochs": epochs, "loss": round(1.0 / (lr * epochs), 4)}

    configs = [
        {"lr": 0.001, "epochs": 5},
        {"lr": 0.005, "epochs": 10},
        {"lr": 0.01, "epochs": 10},
        {"lr": 0.05, "epochs": 5},
    ]
    batch = train.run_async_map(configs, max_concurrent=2)
    assert re.fullmatch(r"grp-[0-9a-f]{8}", batch.group_id)
    results = batch.results(timeout=600, cleanup=False)
    assert [(r["lr"], r["epochs"]) for r in results] == [(c["lr"], c["epochs"]) for c in configs]
    best = min(results, key=lambda r: r["loss"])
    assert best["lr"] == 0.05

    # from Prefect's records alone, as another process would
    reattached = kinetic.attach_batch(batch.group_id)
    assert [j.job_id for j in reattached.jobs] == [j.job_id for j in batch.jobs]
    assert reattached.status_counts() == {"SUCCEEDED": 4}
    assert reattached.results(timeout=60) == results  # cleanup=True: payloads and results go
    assert reattached.results(timeout=60) == [None] * 4 and set(reattached.unavailable_children) == {0, 1, 2, 3}
    reattached.cleanup()

    streamed = [
        job.result(cleanup=False)["lr"] for job in train.run_async_map([[0.01, 3], [0.02, 5]]).as_completed(timeout=600)
    ]
    assert sorted(streamed) == [0.01, 0.02]

    @kinetic.run(accelerator="cpu")
    def fragile_train(lr):
        if lr > 1.0:
            raise ValueError(f"Learning rate {lr} is too high!")
        return {"lr": lr, "loss": 1.0 - lr}

    failing = fragile_train.run_async_map([0.01, 0.1, 5.0, 0.5])
    results = failing.results(timeout=600, return_exceptions=True, cleanup=False)
    assert isinstance(results[2], ValueError) and "5.0 is too high" in str(results[2])
    assert "raise ValueError" in results[2].remote_traceback
    assert [r["loss"] for i, r in enumerate(results) if i != 2] == [0.99, 0.9, 0.5]
    assert [j.group_index for j in failing.failures()] == [2]
    with pytest.raises(kinetic.BatchError, match="1 of 4 jobs failed") as info:
        failing.results(timeout=60)
    assert info.value.partial_results[2] is None and info.value.failures[0].group_index == 2
    failing.cleanup()

    marker = tmp_path / "failed-once"

    @kinetic.run(accelerator="cpu")
    def flaky(value, marker_path):
        import pathlib

        if not pathlib.Path(marker_path).exists():
            pathlib.Path(marker_path).write_text("1")
            raise RuntimeError("first attempt fails")
        return value * 2

    retried = flaky.run_async_map([(21, str(marker))], retries=1)
    assert retried.results(timeout=600) == [42]
    with get_client(sync_client=True) as client:
        attempts = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"kinetic-group:{retried.group_id}"]))
        )
    assert sorted(r.state.name for r in attempts) == ["Completed", "Failed"], "a retry is a new job"

    with pytest.raises(ValueError, match="max_concurrent must be a positive integer"):
        train.run_async_map(configs, max_concurrent=0)
    with pytest.raises(TypeError, match="input_mode='kwargs' takes dicts"):
        train.run_async_map([1], input_mode="kwargs")


def _batch_run(group_id: str):
    """The flow run of a batch that rides in slots ("kinetic-batch", tagged with its group)."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"kinetic-group:{group_id}"]))
        )
    return [run for run in runs if "kinetic-batch" in run.tags]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_batch_rides_in_slots(monkeypatch):
    """Issue 33: run_async_map's 16 inputs on a pool whose jobs can be slots (kinetic-local, no polling worker) share
    a few slot job runs (KINETIC_SWEEP_SLOTS=4 at once) instead of a job run each; every value comes back in input
    order, an input's output is its handle's logs, and attach_batch rebuilds the handle (the same inputs, the values
    once)."""
    from test_spine import job_runs, unique
    from worker_fixture import new_pool

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "4")
    name = unique("batched")

    @kinetic.run(accelerator="cpu", work_pool=new_pool("batch-slots"), name=name)
    def square(x):
        print(f"squaring {x}", flush=True)
        return x * x

    started = time.monotonic()
    batch = square.run_async_map(range(16))
    assert batch.results(timeout=600, cleanup=False) == [x * x for x in range(16)]
    took = time.monotonic() - started
    runs = job_runs(name)
    # At most 4 slots at once; a slot that idles out while a late input's task run starts is replaced (4 or 5 runs
    # here on 2 loaded cores): far from a job run per input.
    assert 1 <= len(runs) <= 8 and all("kinetic-slot" in run.tags for run in runs), (
        f"{len(runs)} job runs ({sum('kinetic-slot' in run.tags for run in runs)} slots) in {took:.1f} s"
    )
    assert batch.status_counts() == {"SUCCEEDED": 16}
    [flow_run] = _batch_run(batch.group_id)
    assert flow_run.state.is_completed() and flow_run.flow_id is not None
    _wait_for(lambda: "squaring 3" in batch.jobs[3].logs(), 30, "input 3's line in its task run's logs")
    print(f"16 inputs in {len(runs)} slot job runs, {took:.1f} s")

    reattached = kinetic.attach_batch(batch.group_id)
    assert [j.job_id for j in reattached.jobs] == [j.job_id for j in batch.jobs]
    assert [j.group_index for j in reattached.jobs] == list(range(16))
    assert reattached.status_counts() == {"SUCCEEDED": 16}
    assert reattached.results(timeout=60) == [x * x for x in range(16)]  # cleanup=True: results go
    assert reattached.results(timeout=60) == [None] * 16 and set(reattached.unavailable_children) == set(range(16))
    reattached.cleanup()

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "0")  # no slots: a detached job per input, as before
    apart = square.run_async_map([2, 3])
    assert apart.results(timeout=300) == [4, 9]
    assert all(DETACHED_TAG in run.tags for run in job_runs(name)[len(runs) :]) and len(job_runs(name)) == len(runs) + 2
    assert not _batch_run(apart.group_id)


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_batch_in_slots_stops(monkeypatch):
    """A batch in slots stops as a batch of jobs does: cancel() ends every input not ended Cancelled (NOT_FOUND, as
    Kinetic says) well before the inputs would have ended; fail_fast with cancel_running_on_fail cancels the running
    inputs after the first failure. Identical inputs are each run (no cache hit between them)."""
    from test_spine import job_runs, unique
    from worker_fixture import new_pool

    from kinetic_prefect.errors import KineticJobCancelled

    monkeypatch.setenv("KINETIC_SWEEP_SLOTS", "3")
    pool = new_pool("batch-stops")
    name = unique("napping")

    @kinetic.run(accelerator="cpu", work_pool=pool, name=name)
    def nap(seconds, fail=False):
        import time as _time

        if fail:
            raise ValueError("this input fails")
        _time.sleep(seconds)
        return seconds

    batch = nap.run_async_map([45] * 6)
    _wait_for(lambda: any(run.state.is_running() for run in job_runs(name)), 300, "a slot job to run")
    time.sleep(2)  # the slots take their first inputs
    asked = time.monotonic()
    batch.cancel()
    batch.wait(timeout=120)
    assert time.monotonic() - asked < 40, "the inputs were stopped, not waited for"
    assert batch.status_counts() == {"NOT_FOUND": 6}
    results = batch.results(timeout=60, return_exceptions=True)
    assert all(isinstance(r, KineticJobCancelled) for r in results), results
    assert len(job_runs(name)) < 6  # the 3 slots (and at most a slot launched as the sweep stopped, never started)
    [flow_run] = _batch_run(batch.group_id)
    assert flow_run.state.is_final()

    started = time.monotonic()
    failing = nap.run_async_map(
        [{"seconds": 45, "fail": i == 0} for i in range(3)], fail_fast=True, cancel_running_on_fail=True
    )  # as many inputs as slots: the failing one is not queued behind a sleeping one
    results = failing.results(timeout=300, return_exceptions=True)
    assert time.monotonic() - started < 40, "the running inputs were cancelled, not waited for"
    assert isinstance(results[0], ValueError) and "this input fails" in str(results[0])
    assert all(isinstance(r, KineticJobCancelled) for r in results[1:]), results
    assert failing.statuses() == [
        (0, kinetic.JobStatus.FAILED),
        (1, kinetic.JobStatus.NOT_FOUND),
        (2, kinetic.JobStatus.NOT_FOUND),
    ]


# --------------------------------------------------------------------------- detached jobs across processes


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(900)  # several processes and jobs; minutes on a loaded machine
@pytest.mark.slow
def test_detached_jobs_outlive_their_script(worker_factory, tmp_path, monkeypatch, capsys):
    """docs/guides/async_jobs.md: a script submits with run_async() and exits; a second process collects the value
    (signature checked, payload deleted); `kinetic-prefect jobs` lists, follows and cancels a job."""
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "kinetic-api-test-key")  # the worker, both scripts and this process
    pool = worker_factory().start().pool
    env = {**os.environ, "KINETIC_WORK_POOL": pool}
    pid_file = tmp_path / "long-job.pid"
    submitted = _run([sys.executable, str(EXAMPLES / "detached_submit.py"), str(pid_file)], env)
    ids = json.loads(submitted.stdout.strip().splitlines()[-1])
    # the submitter has exited; the jobs are nobody's subflow, and run on the polling worker

    assert cli(["jobs", "list", "--pool", pool]) == 0
    listed = capsys.readouterr().out
    assert ids["a"] in listed and ids["b"] in listed and "train_model_a" in listed and "long_job" in listed

    collect = (
        f"from kinetic_prefect import kinetic; job = kinetic.attach({ids['a']!r}); "
        f"print(job.func_name, job.status().value, job.result(timeout=300), job.status().value)"
    )
    out = _run([sys.executable, "-c", collect], env).stdout.split()
    assert out[0] == "train_model_a" and out[-1] == "SUCCEEDED" and float(out[2]) > 0

    job_a = kinetic.attach(ids["a"])
    with get_client(sync_client=True) as client:
        run_a = client.read_flow_run(uuid.UUID(ids["a"]))
    assert DETACHED_TAG in run_a.tags and run_a.parent_task_run_id is None
    layout = RunLayout(run_a.job_variables["env"][Env.RUN_ID])
    store = Path(run_a.job_variables["store"])
    assert not (store / layout.payload).exists() and not (store / layout.result).exists(), "cleaned once collected"
    assert (store / layout.outcome).exists() and (store / (layout.outcome + ".sig")).exists()
    with pytest.raises(kinetic.ResultAlreadyCollected, match="already collected"):
        job_a.result(timeout=30)
    assert "Model A done" in job_a.logs()

    # follow the long job from a third process, then cancel it from the CLI
    follower = subprocess.Popen(
        [sys.executable, "-m", "kinetic_prefect.cli", "jobs", "logs", "-f", ids["b"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        job_pid = int(_wait_for(lambda: pid_file.exists() and pid_file.read_text(), 180, "the long job to start"))
        assert cli(["jobs", "status", ids["b"]]) == 0
        assert f"{ids['b']}  long_job  RUNNING" in capsys.readouterr().out
        _wait_for(lambda: "step 2" in kinetic.attach(ids["b"]).logs(), 60, "the long job's output")
        assert cli(["jobs", "cancel", ids["b"]]) == 0
        assert "Cancelled" in capsys.readouterr().out
        followed, _ = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 0 and "step 0" in followed and "step 2" in followed
    _wait_for(lambda: not Path(f"/proc/{job_pid}").exists(), 30, "the cancelled job's process to end")
    with get_client(sync_client=True) as client:
        run_b = client.read_flow_run(uuid.UUID(ids["b"]))
    layout_b = RunLayout(run_b.job_variables["env"][Env.RUN_ID])
    assert not (store / layout_b.payload).exists() and not (store / layout_b.result).exists(), "nobody collects them"
    assert kinetic.attach(ids["b"]).status() is kinetic.JobStatus.NOT_FOUND
    assert cli(["jobs", "result", ids["b"]]) == 1
    assert "KineticJobCancelled" in capsys.readouterr().err
    assert cli(["jobs", "list", "--pool", pool]) == 0
    assert "No live jobs" in capsys.readouterr().out
    assert cli(["jobs", "cleanup", ids["b"]]) == 0


@pytest.mark.slow
def test_a_tampered_result_is_refused(worker_factory, monkeypatch):
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "kinetic-api-test-key")
    monkeypatch.setenv("KINETIC_WORK_POOL", worker_factory().start().pool)

    @kinetic.run(accelerator="cpu")
    def answer():
        return 42

    job = answer.run_async()
    assert job.wait(timeout=300) is kinetic.JobStatus.SUCCEEDED
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(uuid.UUID(job.job_id))
    result = Path(flow_run.job_variables["store"]) / RunLayout(flow_run.job_variables["env"][Env.RUN_ID]).result
    import cloudpickle

    result.write_bytes(cloudpickle.dumps(666))
    from kinetic_prefect.errors import StoreTampered

    with pytest.raises(StoreTampered):
        job.result(timeout=30)


@pytest.mark.timeout(900)  # several processes and jobs; minutes on a loaded machine
@pytest.mark.slow
def test_a_killed_callers_job_is_collected_by_attach(shared_polling_worker):
    """`kinetic_prefect.attach(flow_run_id)`: the script that submitted a @kinetic_task job is killed (SIGKILL)
    while the job runs on a polling worker; the job runs to its end and another process collects its value."""
    pool = shared_polling_worker.pool
    script = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "task_submit.py")],
        env={**os.environ, "POOL": pool},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def running_job():
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["kinetic"])),
                    work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
                )
            return next((r for r in runs if r.state and r.state.is_running()), None)

        job_run = _wait_for(running_job, 240, "the job to run")
        script.send_signal(signal.SIGKILL)
        script.wait(30)
    finally:
        script.kill()
    collect = f"import kinetic_prefect; print(kinetic_prefect.attach({str(job_run.id)!r}).result(timeout=120))"
    assert _run([sys.executable, "-c", collect], dict(os.environ)).stdout.split()[-1] == "42"


@pytest.mark.timeout(900)  # several processes and jobs; minutes on a loaded machine
@pytest.mark.slow
def test_an_in_process_detached_job_stops_with_its_killed_submitter(tmp_path):
    """No worker polls the pool: the submitter runs the job itself (and warns), waits for it at exit, and when it is
    killed the job stops by itself and its run ends Cancelled."""
    from worker_fixture import new_pool

    pool, pid_file = new_pool("in-process"), tmp_path / "job.pid"
    script = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "in_process_submit.py"), str(pid_file)],
        env={**os.environ, "KINETIC_WORK_POOL": pool},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def started() -> str | bool:
            assert script.poll() is None, "the submitter waits for its in-process job:\n" + script.stderr.read()
            return pid_file.exists() and pid_file.read_text()

        job_pid = int(_wait_for(started, 240, "the job to start"))
        script.send_signal(signal.SIGKILL)
        out, err = script.communicate(timeout=30)
    finally:
        script.kill()
    assert "no worker polls pool" in err and "run inside this process" in err
    job = kinetic.attach(json.loads(out.strip().splitlines()[-1])["job"])
    started = time.monotonic()
    _wait_for(lambda: not Path(f"/proc/{job_pid}").exists(), 60, "the job to stop itself")
    _wait_for(lambda: job.status() is kinetic.JobStatus.NOT_FOUND, 60, "the job's run to end Cancelled")
    assert job.state().is_cancelled() and "died" in (job.state().message or "")
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_a_script_that_ends_before_its_in_process_detached_job_waits_for_it_cleanly(tmp_path):
    """The submitter of an in-process detached job ends its script while the job runs: it waits for the job at exit.
    Each log line of the job's last moments printed an 80-line "Logging error … can't register atexit after
    shutdown" (Prefect's log sender started during shutdown). It now exits 0 with no such error; the value waits.
    ≈ 20 s: a script's start (with its own embedded-server check) and a 3 s job it waits for at exit."""
    from worker_fixture import new_pool

    pool, pid_file = new_pool("in-process"), tmp_path / "job.pid"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "in_process_submit.py"), str(pid_file), "3"],
        env={**os.environ, "KINETIC_WORK_POOL": pool},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Logging error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    job = kinetic.attach(json.loads(proc.stdout.strip().splitlines()[-1])["job"])
    assert job.status() is kinetic.JobStatus.SUCCEEDED and job.result(timeout=30) == "slept 3 s"


# --------------------------------------------------------------------------- capture_env_vars, Kinetic's rule


@pytest.mark.slow
def test_kinetic_env_capture_example_forwards_what_the_guide_says():
    """Kinetic's env-capture guide as a script, run as its user runs it (a separate process, three calls, so three
    job processes): ≈ 20 s. Patterns skip the caller's own process configuration, exact names forward it, an unset
    exact name is left out with a warning instead of failing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAGGLE_", "WANDB_"))}
    env.update(
        KAGGLE_USERNAME="ada",  # KAGGLE_KEY stays unset: Kinetic skips it, and so do we, with a warning
        WANDB_PROJECT="land-cover",
        EXPERIMENT_TAG="run-7",
        CONDA_PREFIX="/nowhere/conda",
        SSH_AUTH_SOCK="/nowhere/agent.sock",
        PYTHONSAFEPATH="1",
    )
    proc = _run([sys.executable, str(EXAMPLES / "env_capture.py")], env)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["named"] == {"KAGGLE_USERNAME": "ada", "KAGGLE_KEY": None, "WANDB_PROJECT": "land-cover"}
    assert "KAGGLE_KEY not set in the calling process" in proc.stderr
    everything = seen["everything"]
    assert everything["EXPERIMENT_TAG"] == "run-7", "'*' forwards the user's own variables"
    assert everything["CONDA_PREFIX"] is None and everything["SSH_AUTH_SOCK"] is None, "the caller's machine's"
    assert everything["PYTHONSAFEPATH"] is None, "PYTHON* is the caller's interpreter's, not the job's"
    assert seen["exact"] == "/nowhere/conda", "an exact name forwards even what a pattern skips"


@pytest.mark.no_server
def test_a_batchs_inputs_are_read_as_kinetic_reads_them_and_bad_ones_fail_before_any_job():
    """run_async_map's input modes and option checks, which fail before the first submission (no job, no server)."""
    from kinetic_prefect.kinetic import batch

    assert batch._as_call({"lr": 0.1, "steps": 5}, "auto") == ((), {"lr": 0.1, "steps": 5})
    assert batch._as_call({"not a name": 1}, "auto") == (({"not a name": 1},), {}), "a dict that cannot be kwargs"
    assert batch._as_call((1, 2), "auto") == ((1, 2), {})
    assert batch._as_call((1, 2), "single") == (((1, 2),), {})
    assert batch._as_call("x", "auto") == (("x",), {})
    with pytest.raises(TypeError, match="input_mode='args' takes lists or tuples, not int"):
        batch.run_async_map(None, [1], input_mode="args")
    with pytest.raises(ValueError, match="max_concurrent must be a positive integer or None"):
        batch.run_async_map(None, [1], max_concurrent=0)
    with pytest.raises(ValueError, match="retries must be >= 0"):
        batch.run_async_map(None, [1], retries=-1)
    with pytest.raises(ValueError, match="input_mode='columns' is not one of"):
        batch.run_async_map(None, [1], input_mode="columns")
    with pytest.raises(TypeError, match=r"run_async_map\(project=/cluster=\) has no per-call equivalent"):
        batch.run_async_map(None, [1], project="p")
