"""The EuroSAT ViT flow (flows/eurosat_vit.py) on the shared 1,000-image sample zip.

Real Prefect server (conftest), real kinetic-local jobs. Models are tiny and runs are 1-2 epochs: these
check the pipeline (caching, resume after a kill, artifacts, outputs, bad inputs, predict), not accuracy
(bench/bench_eurosat.py measures that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from job_runs import jobs_of, task_runs_of

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
SAMPLE_ZIP = SHARED / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"
SAMPLE_SHA256 = "sha256:cd456252984ad18bd9a748a94e2c3fec0e102ebe98c835dabd9eae3606b2984d"

pytestmark = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"{SHARED} is absent (the EuroSAT sample ships with the CI machine only)"
)

sys.path.insert(0, str(ROOT / "flows"))
os.environ.setdefault("KERAS_BACKEND", "jax")

from eurosat import dataset as ds  # noqa: E402

TINY = {"model_size": "tiny", "batch_size": 64, "tta": True}


def _flow():
    import eurosat_vit

    return eurosat_vit


def _task_runs(flow_run_id):
    return task_runs_of(flow_run_id)


def _child_flow_runs(task_run_id):
    return jobs_of(task_run_id)


def _run_flow(**params):
    state = _flow().eurosat_vit(return_state=True, **params)
    return state.state_details.flow_run_id, state.result()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eurosat-cache")


@pytest.fixture(scope="module")
def first_run(prefect_server, cache_dir, tmp_path_factory):
    """The whole flow once on the sample: tiny model, 2 epochs, through kinetic-local."""
    out = tmp_path_factory.mktemp("eurosat-out")
    flow_run_id, result = _run_flow(
        source=str(SAMPLE_ZIP), checksum=SAMPLE_SHA256, epochs=2, cache_dir=str(cache_dir), output_dir=str(out), **TINY
    )
    return flow_run_id, result, out


@pytest.mark.slow
def test_flow_trains_evaluates_and_publishes(first_run):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    flow_run_id, result, out = first_run
    assert result["split_sizes"] == {"train": 800, "val": 100, "test": 100}
    assert result["epochs_run"] == 2 and len(result["history"]["val_accuracy"]) == 2
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["macro_f1"] <= 1.0
    metrics = result["metrics"]
    assert [row["class"] for row in metrics["per_class"]] == list(ds.CLASS_NAMES)
    assert sum(map(sum, metrics["confusion_matrix"])) == 100
    for name in ("eurosat_vit.keras", "confusion_matrix.png", "learning_curves.png", "metrics.json"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, f"{name} missing from the outputs"
    assert (out / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with zipfile.ZipFile(out / "eurosat_vit.keras") as zf:
        assert json.loads(zf.read("class_names.json")) == list(ds.CLASS_NAMES)
    assert Path(result["model_path"]) == out / "eurosat_vit.keras"

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        keys = {a.key for a in artifacts}
        assert {"eurosat-report", "eurosat-per-class-metrics", "eurosat-confusion-matrix"} <= keys, keys
        report = next(a for a in artifacts if a.key == "eurosat-report")
        assert f"{result['accuracy']:.4f}" in report.data
        # the kinetic job's outputs (KINETIC_OUTPUT_DIR) are listed as a table artifact on the train task run
        assert any(a.type == "table" and "eurosat_vit.keras" in json.dumps(a.data) for a in artifacts)

        # live progress: the job's per-epoch lines reached the Prefect logs
        [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("eurosat-train")]
        [job] = _child_flow_runs(train_run.id)
        deadline = time.time() + 15
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[job.id])), limit=200)
            # one Prefect log record may hold several lines: the worker forwards output in batches
            lines = [line for log in logs for line in log.message.splitlines()]
            if any("epoch 2/2" in line for line in lines):
                break
            assert time.time() < deadline, f"no per-epoch line in the job's logs: {lines[-10:]}"
            time.sleep(0.5)
    assert any(line.startswith("epoch 1/2 loss=") for line in lines)


@pytest.fixture(scope="module")
def resumed_run(first_run, cache_dir, tmp_path_factory):
    """A second run on the same source: its first job SIGKILLs itself after epoch 1 (kill_after_epoch, test-only),
    Prefect retries the task (retries=1), and the new job must resume from the checkpoint."""
    out = tmp_path_factory.mktemp("eurosat-out-resumed")
    flow_run_id, result = _run_flow(
        source=str(SAMPLE_ZIP),
        checksum=SAMPLE_SHA256,
        epochs=2,
        kill_after_epoch=1,
        retries=1,
        cache_dir=str(cache_dir),
        output_dir=str(out),
        **TINY,
    )
    return flow_run_id, result, out


@pytest.mark.slow
def test_second_run_fetch_decode_split_are_cache_hits(first_run, resumed_run):
    flow_run_id, result, _ = resumed_run
    states = {r.name.rsplit("-", 1)[0]: r.state.name for r in _task_runs(flow_run_id)}
    assert states["eurosat-fetch"] == "Cached", states
    assert states["eurosat-decode"] == "Cached", states
    assert states["eurosat-split"] == "Cached", states
    assert states["eurosat-train"] == "Completed", states
    # the same split: the same held-out test images
    assert result["split_sizes"] == first_run[1]["split_sizes"]
    first, second = first_run[1]["metrics"]["confusion_matrix"], result["metrics"]["confusion_matrix"]
    assert [sum(row) for row in first] == [sum(row) for row in second] == [10] * 10


@pytest.mark.slow
def test_killed_job_is_retried_and_resumes_from_the_last_epoch(resumed_run):
    flow_run_id, result, out = resumed_run
    assert result["resumed_from_epoch"] == 1, "the retry must start from the checkpoint of epoch 1"
    assert result["epochs_run"] == 2 and len(result["history"]["loss"]) == 2
    [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("eurosat-train")]
    assert train_run.run_count == 2 and train_run.state.is_completed()
    jobs = _child_flow_runs(train_run.id)
    assert len(jobs) == 2, [j.name for j in jobs]
    assert not jobs[0].state.is_completed(), f"the first job was SIGKILLed, yet it is {jobs[0].state.name}"
    assert jobs[1].state.is_completed()
    assert (out / "eurosat_vit.keras").is_file()


# --------------------------------------------------------------------------------------------- bad inputs


def _sample_members(per_class: int = 3) -> dict[str, bytes]:
    """A few images per class from the sample zip, keyed by their path in the zip."""
    picked: dict[str, bytes] = {}
    counts: dict[str, int] = {}
    with zipfile.ZipFile(SAMPLE_ZIP) as zf:
        for name in sorted(zf.namelist()):
            parts = name.split("/")
            if len(parts) == 3 and parts[2].endswith(".jpg") and counts.get(parts[1], 0) < per_class:
                counts[parts[1]] = counts.get(parts[1], 0) + 1
                picked[name] = zf.read(name)
    return picked


def _zip(path: Path, members: dict[str, bytes | None]) -> Path:
    """``None`` content: a directory entry."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            if data is None:
                zf.writestr(zipfile.ZipInfo(name.rstrip("/") + "/"), b"")
            else:
                zf.writestr(name, data)
    return path


def _prepare(path: Path, cache: Path):
    return ds.prepare(ds.fetch(str(path), None, cache), cache)


def _no_half_written_entries(cache: Path) -> None:
    leftovers = [p for p in cache.rglob("*") if p.name.startswith(".kp-tmp")]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    assert not any((cache / "decoded").glob("*/images.npy")) if (cache / "decoded").exists() else True


def test_corrupt_jpeg_is_named(tmp_path):
    members = _sample_members()
    bad = next(k for k in members if "/Highway/" in k)
    members[bad] = members[bad][:300]  # truncated: the header parses, the pixels do not
    with pytest.raises(ds.DatasetError, match=r"corrupt or unreadable image .*" + bad.replace(".", r"\.")) as info:
        _prepare(_zip(tmp_path / "corrupt.zip", members), tmp_path / "cache")
    assert info.value.path.endswith(bad)
    _no_half_written_entries(tmp_path / "cache")


def test_not_an_image_at_all_is_named(tmp_path):
    members = _sample_members()
    bad = next(k for k in members if "/River/" in k)
    members[bad] = b"this is not a jpeg"
    with pytest.raises(ds.DatasetError, match=bad.replace(".", r"\.")):
        _prepare(_zip(tmp_path / "text.zip", members), tmp_path / "cache")


def test_empty_class_folder_is_named(tmp_path):
    members = {k: v for k, v in _sample_members().items() if "/Forest/" not in k}
    members["EuroSAT_RGB/Forest/"] = None
    with pytest.raises(ds.DatasetError, match=r"class folder 'EuroSAT_RGB/Forest' is empty"):
        _prepare(_zip(tmp_path / "empty.zip", members), tmp_path / "cache")


def test_missing_class_folder_is_named(tmp_path):
    members = {k: v for k, v in _sample_members().items() if "/Pasture/" not in k}
    with pytest.raises(ds.DatasetError, match=r"class folder 'EuroSAT_RGB/Pasture' is missing"):
        _prepare(_zip(tmp_path / "missing.zip", members), tmp_path / "cache")


def test_empty_class_folder_in_a_directory_source(tmp_path):
    root = tmp_path / "data" / "EuroSAT_RGB"
    for name, data in _sample_members(1).items():
        if "/SeaLake/" in name:
            continue
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(data)
    (root / "SeaLake").mkdir()
    with pytest.raises(ds.DatasetError, match=r"class folder 'EuroSAT_RGB/SeaLake' is empty"):
        _prepare(tmp_path / "data", tmp_path / "cache")


@pytest.mark.parametrize("layout", ["flat", "nested", "top-level"])
def test_zip_with_the_wrong_layout(tmp_path, layout):
    members = _sample_members(1)
    if layout == "flat":  # EuroSAT_RGB/<image> without class folders
        members = {f"EuroSAT_RGB/{k.split('/')[-1]}": v for k, v in members.items()}
    elif layout == "nested":  # one folder too many
        members = {f"EuroSAT_RGB/{k}": v for k, v in members.items()}
    else:  # images at the top of the zip
        members = {k.split("/")[-1]: v for k, v in members.items()}
    with pytest.raises(ds.DatasetError, match=r"wrong layout") as info:
        _prepare(_zip(tmp_path / f"{layout}.zip", members), tmp_path / "cache")
    assert info.value.path and info.value.path.endswith(".jpg")


def test_unknown_class_is_named(tmp_path):
    members = _sample_members(1)
    members["EuroSAT_RGB/Glacier/Glacier_1.jpg"] = next(v for k, v in members.items() if "/SeaLake/" in k)
    with pytest.raises(ds.DatasetError, match=r"unknown class 'Glacier' .*Glacier_1\.jpg"):
        _prepare(_zip(tmp_path / "unknown.zip", members), tmp_path / "cache")


def test_checksum_mismatch_and_not_a_zip(tmp_path):
    with pytest.raises(ds.ChecksumMismatch, match="sha256"):
        ds.fetch(str(SAMPLE_ZIP), "sha256:" + "0" * 64, tmp_path)
    (tmp_path / "x.zip").write_text("hello")
    with pytest.raises(ds.DatasetError, match="neither a zip file nor a directory"):
        ds.fetch(str(tmp_path / "x.zip"), None, tmp_path)
    with pytest.raises(ds.DatasetError, match="does not exist"):
        ds.fetch(str(tmp_path / "nope.zip"), None, tmp_path)


def test_directory_source_decodes_like_the_zip(tmp_path):
    members = _sample_members(2)
    zipped = _prepare(_zip(tmp_path / "a.zip", members), tmp_path / "cache")
    for name, data in members.items():
        (tmp_path / "dir" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dir" / name).write_bytes(data)
    from_dir = _prepare(tmp_path / "dir", tmp_path / "cache")
    a, la, _ = ds.load_decoded(zipped.path)
    b, lb, _ = ds.load_decoded(from_dir.path)
    assert (a == b).all() and (la == lb).all() and a.shape == (20, 64, 64, 3)


def test_split_is_stratified_seeded_and_disjoint():
    import numpy as np

    labels = np.repeat(np.arange(10), [300, 300, 300, 250, 250, 200, 250, 300, 250, 300])
    a = ds.stratified_split(labels, 0.1, 0.1, seed=3)
    b = ds.stratified_split(labels, 0.1, 0.1, seed=3)
    assert all((a[k] == b[k]).all() for k in a)
    assert not set(a["train"]) & set(a["test"]) and not set(a["val"]) & set(a["test"])
    assert len(a["train"]) + len(a["val"]) + len(a["test"]) == len(labels)
    assert (np.bincount(labels[a["test"]]) == np.bincount(labels) // 10).all()
    c = ds.stratified_split(labels, 0.1, 0.1, seed=4)
    assert not (c["test"] == a["test"]).all()


@pytest.mark.slow
def test_flow_fails_on_a_corrupt_image_before_launching_a_job(cache_dir, tmp_path):
    members = _sample_members()
    bad = next(k for k in members if "/Industrial/" in k)
    members[bad] = members[bad][:200]
    path = _zip(tmp_path / "corrupt.zip", members)
    state = _flow().eurosat_vit(
        source=str(path), cache_dir=str(tmp_path / "cache"), output_dir=str(tmp_path / "o"), return_state=True, **TINY
    )
    assert state.is_failed()
    with pytest.raises(ds.DatasetError, match=bad.replace(".", r"\.")):
        state.result()
    runs = {r.name.rsplit("-", 1)[0]: r.state.name for r in _task_runs(state.state_details.flow_run_id)}
    assert runs.get("eurosat-decode") == "Failed" and "eurosat-train" not in runs, runs
    _no_half_written_entries(tmp_path / "cache")


# --------------------------------------------------------------------------------------------- predict


def _test_split_folder(cache_dir: Path, folder: Path) -> dict[str, int]:
    """The flow's held-out test images of the sample, as the original JPEG files; returns file -> label."""
    decoded = ds.prepare(ds.fetch(str(SAMPLE_ZIP), SAMPLE_SHA256, cache_dir), cache_dir)
    split_file, _sizes = ds.save_split(decoded, 0.1, 0.1, 0, cache_dir)  # the flow's defaults: a cache hit
    _images, labels, meta = ds.load_decoded(decoded.path)
    truth = {}
    with zipfile.ZipFile(SAMPLE_ZIP) as zf:
        for i in ds.load_split(split_file)["test"]:
            member = meta["files"][i]
            name = member.split("/")[-1]
            (folder / name).write_bytes(zf.read(member))
            truth[name] = int(labels[i])
    return truth


@pytest.mark.slow
def test_predict_reproduces_the_published_accuracy(first_run, cache_dir, tmp_path):
    """One scoring path: `predict` on the test split gives exactly the accuracy the flow published, with the
    model's own scoring (8-way TTA here) by default, and the published single-view figure with tta=False."""
    _flow_run_id, result, _out = first_run
    metrics = result["metrics"]
    assert metrics["scoring"] == "8-way TTA"
    truth = _test_split_folder(cache_dir, tmp_path)
    assert len(truth) == metrics["num_test"] == 100
    names = list(ds.CLASS_NAMES)

    def accuracy(rows):
        assert {row["file"] for row in rows} == set(truth)
        return round(sum(names.index(row["class"]) == truth[row["file"]] for row in rows) / len(rows), 4)

    assert accuracy(_flow().predict(result["model_path"], tmp_path)) == metrics["accuracy"]
    assert accuracy(_flow().predict(result["model_path"], tmp_path, tta=False)) == metrics["single_view"]["accuracy"]


def test_the_run_says_where_its_outputs_are(first_run):
    result = first_run[1]
    out = Path(result["model_path"]).parent
    for api, ui in (
        (None, "prefect server start"),
        ("http://127.0.0.1:4200/api", f"http://127.0.0.1:4200/runs/flow-run/{result['flow_run_id']}"),
    ):
        text = _flow().where_to_look(result, api_url=api)
        for needle in (
            str(out / "eurosat_vit.keras"),
            str(out / "confusion_matrix.png"),
            str(out / "metrics.json"),
            ui,
            f"{100 * result['accuracy']:.2f} %",
        ):
            assert needle in text, (needle, text)


# --------------------------------------------------------------------------------------------- recipe


def test_learning_rate_schedule_adapts_to_the_number_of_epochs():
    """Warm-up is a share of the run, so a 3-epoch run warms up, peaks and decays like a 30-epoch one."""
    from eurosat.train import TrainConfig, lr_at, schedule_progress

    steps = 143  # the dev split's steps per epoch at batch 128
    for epochs in (1, 3, 30):
        cfg = TrainConfig(epochs=epochs)
        total = epochs * steps
        lrs = [lr_at(cfg, schedule_progress(cfg, s, steps)) for s in range(total)]
        peak = max(lrs)
        assert peak > 0.95 * cfg.learning_rate, epochs
        assert lrs.index(peak) < 0.1 * total, f"{epochs} epochs: still warming up after 10 % of the run"
        assert lrs[-1] < 0.02 * cfg.learning_rate, f"{epochs} epochs: the last step is at {lrs[-1]:.2e}"
        assert all(b <= a + 1e-12 for a, b in zip(lrs[lrs.index(peak) :], lrs[lrs.index(peak) + 1 :])), "not decaying"
    # with a time budget the clock drives it: half the budget spent is half way down the same curve
    cfg = TrainConfig(epochs=100, time_budget_s=600)
    assert schedule_progress(cfg, 0, steps, elapsed_s=300) == 0.5
    assert lr_at(cfg, schedule_progress(cfg, 10, steps, elapsed_s=600)) == cfg.min_learning_rate


@pytest.mark.slow
def test_only_the_schedule_sets_the_learning_rate(cache_dir, tmp_path):
    """Every epoch's rate is the documented warm-up + cosine, even while validation loss stalls. With a
    ReduceLROnPlateau (patience 4) multiplied into it, a 60-minute run had its rate halved 5 times, 32x below the
    cosine from mid-run on (bench/results/eurosat_compare_alone.json against eurosat_compare_trial_noplateau.json)."""
    from eurosat.train import TrainConfig, lr_at, schedule_progress, train_and_evaluate

    decoded = ds.prepare(ds.fetch(str(SAMPLE_ZIP), SAMPLE_SHA256, cache_dir), cache_dir)
    split_file, _ = ds.save_split(decoded, 0.1, 0.1, 0, cache_dir)
    # a rate this small cannot move the validation loss: the stall a plateau callback reacts to
    train = dict(epochs=8, batch_size=128, learning_rate=1e-9, min_learning_rate=1e-11, augment=False, tta=False)
    result = train_and_evaluate(
        decoded.path,
        split_file,
        {"preset": "tiny"},
        train,
        output_dir=tmp_path / "out",
        checkpoint_dir=tmp_path / "ckpt",
        train_limit=512,
    )
    assert result["epochs_run"] == 8
    cfg, steps = TrainConfig(**train), result["steps_per_epoch"]
    last_set = max(b for b in range(steps) if b % 4 == 0)  # the schedule sets the rate every 4 steps
    cosine = [lr_at(cfg, schedule_progress(cfg, epoch * steps + last_set, steps)) for epoch in range(8)]
    assert result["history"]["lr"] == pytest.approx(cosine, rel=1e-4, abs=0)


def test_a_short_run_ends_decayed(first_run):
    """The flow's 2-epoch run (12 steps an epoch) ends near the floor, not at the peak of a warm-up."""
    from eurosat.train import TrainConfig

    lr = first_run[1]["history"]["lr"]
    assert len(lr) == 2 and lr[-1] < 0.1 * TrainConfig().learning_rate, lr


def test_auto_picks_the_larger_preset_and_mixed_precision_on_an_accelerator():
    import keras
    from eurosat.model import PRESETS, build_vit, select_precision, select_preset
    from eurosat.train import resolve_model

    assert select_preset("auto", "cpu") == "hybrid"
    assert select_preset("auto", "gpu") == select_preset("auto", "tpu") == "hybrid-large"
    assert select_preset("small", "gpu") == "small"
    assert select_precision("auto", "cpu") == "float32"
    assert select_precision("auto", "gpu") == select_precision("auto", "tpu") == "mixed_bfloat16"
    assert select_precision("float32", "gpu") == "float32"
    with pytest.raises(ValueError):
        select_precision("int8", "cpu")
    with pytest.raises(ValueError):
        select_preset("huge", "cpu")
    cfg, precision, platform = resolve_model({"preset": "auto", "depth": 2}, "auto", platform="gpu")
    assert (platform, precision) == ("gpu", "mixed_bfloat16")
    assert cfg == type(cfg).from_dict({**PRESETS["hybrid-large"].as_dict(), "depth": 2})
    assert PRESETS["hybrid-large"].dim > PRESETS["hybrid"].dim
    # the mixed-precision model builds: bf16 compute, float32 weights and logits
    previous = keras.mixed_precision.dtype_policy()
    try:
        keras.mixed_precision.set_dtype_policy(precision)
        model = build_vit(cfg)
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
    assert model.get_layer("block0_mlp1").compute_dtype == "bfloat16"
    assert model.get_layer("block0_mlp1").kernel.dtype == "float32"
    assert model.output.dtype == "float32"


@pytest.mark.slow
def test_predict_classifies_a_folder(first_run, tmp_path):
    model_path = first_run[1]["model_path"]
    folder = tmp_path / "images"
    folder.mkdir()
    for name, data in list(_sample_members(1).items()):
        (folder / name.split("/")[-1]).write_bytes(data)
    rows = _flow().predict(model_path, folder)
    assert len(rows) == 10
    assert {row["file"] for row in rows} == {p.name for p in folder.iterdir()}
    for row in rows:
        assert row["class"] in ds.CLASS_NAMES and 0.0 <= row["confidence"] <= 1.0
        assert abs(sum(row["probabilities"].values()) - 1.0) < 1e-3

    cli = subprocess.run(
        [sys.executable, str(ROOT / "flows" / "eurosat_vit.py"), "predict", model_path, str(folder)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    lines = [line.split("\t") for line in cli.stdout.strip().splitlines()]
    assert len(lines) == 10 and all(cls in ds.CLASS_NAMES for _f, cls, _c in lines)

    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff not really")
    with pytest.raises(ds.DatasetError, match="broken.jpg"):
        _flow().predict(model_path, folder)


def test_fetch_from_gcs_zip_and_folder(gcs_bucket, tmp_path):
    """gs:// sources: a zip object (checksum verified) and a folder of class folders, both decode."""
    from kinetic_prefect.storage import open_store

    members = _sample_members(1)
    store = open_store(gcs_bucket)
    zipped = _zip(tmp_path / "small.zip", members)
    store.put_file("datasets/small.zip", zipped)
    store.put_tree("datasets/tree", [(name, _write(tmp_path / "tree" / name, data)) for name, data in members.items()])

    sha = ds.file_digests(zipped)["sha256"]
    fetched = ds.fetch(f"{gcs_bucket}/datasets/small.zip", f"sha256:{sha}", tmp_path / "cache")
    assert fetched.kind == "zip" and fetched.sha256 == sha
    folder = ds.fetch(f"{gcs_bucket}/datasets/tree", None, tmp_path / "cache")
    assert folder.kind == "dir"
    a = ds.prepare(fetched, tmp_path / "cache")
    b = ds.prepare(folder, tmp_path / "cache")
    assert a.num_images == b.num_images == 10
    with pytest.raises(ds.ChecksumMismatch):
        ds.fetch(f"{gcs_bucket}/datasets/small.zip", "sha256:" + "1" * 64, tmp_path / "cache2")
    assert not [p for p in (tmp_path / "cache2").rglob("*") if p.is_file()], "a bad download must not stay cached"


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
