"""EuroSAT land-cover classification with a Vision Transformer, as a Prefect flow.

    # minutes: the README's first command (hybrid-mini, flips/rotations only, a 1.5-minute training budget)
    uv run --extra ml python flows/eurosat_vit.py run --source ../shared/data/eurosat/EuroSAT_RGB_dev.zip \
        --time-budget-minutes 1.5 --model-size hybrid-mini --batch-size 64 --augment dihedral
    # the full recipe (model_size auto: hybrid on CPU, hybrid-large + mixed_bfloat16 on a GPU/TPU)
    uv run --extra ml python flows/eurosat_vit.py run --source ../shared/data/eurosat/EuroSAT_RGB_dev.zip \
        --time-budget-minutes 60 --epochs 200
    uv run --extra ml python flows/eurosat_vit.py predict eurosat-outputs/<run>/eurosat_vit.keras FOLDER [--no-tta]

Steps (each a Prefect task):

1. ``fetch``  -- the official zip (Zenodo record 7711810, checksum verified), a local zip or directory, or
   gs://; cached by source + checksum (+ size/mtime of a local source), so a rerun fetches nothing.
2. ``decode`` -- validate the ``<root>/<Class>/<image>.jpg`` layout and decode every image once to a uint8
   array on disk (cached by content); a corrupt image, a missing/empty class folder, a wrong layout or an
   unknown class fails here with the file named, before any job is launched.
3. ``split``  -- stratified train/validation/test indices, seeded, computed once and cached; the test part
   is never seen by training.
4. ``train``  -- a ``@kinetic_task`` job on ``accelerator``: the decoded data and the split go in as
   ``kinetic_prefect.Data``; it prints one line per epoch (streamed to the flow run's logs), checkpoints
   every epoch into ``KINETIC_CHECKPOINT_DIR`` (a retry resumes from the last finished epoch), evaluates
   on the test split and writes the ``.keras`` model, plots and metrics into ``KINETIC_OUTPUT_DIR``.
5. ``evaluate`` -- metrics recomputed on the caller from the job's test predictions.
6. ``publish``  -- Prefect artifacts (tables + markdown) and the job's output files copied to ``output_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `eurosat` imports the same way in tests and scripts
os.environ.setdefault("KERAS_BACKEND", "jax")
# Prefect's temporary server gets 20 s to start by default; on 2 busy cores that is sometimes too little
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

from eurosat import dataset as ds  # noqa: E402
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import INPUTS, TASK_SOURCE  # noqa: E402

from kinetic_prefect import Data, kinetic_task  # noqa: E402

CACHE_POLICY = INPUTS + TASK_SOURCE


def _cache_dir(cache_dir: str | None) -> str:
    return str(Path(cache_dir).expanduser().resolve() if cache_dir else ds.default_cache_dir())


@task(name="eurosat-fetch", cache_policy=CACHE_POLICY, persist_result=True)
def fetch(source: str, checksum: str | None, fingerprint: str, cache_dir: str) -> dict:
    """``fingerprint`` (size/mtime of a local source) is only part of the cache key."""
    fetched = ds.fetch(source, checksum, cache_dir)
    get_run_logger().info(f"fetched {source} -> {fetched.path} ({fetched.kind}, sha256 {fetched.sha256[:12]})")
    return fetched.as_dict()


@task(name="eurosat-decode", cache_policy=CACHE_POLICY, persist_result=True)
def decode(fetched: dict, cache_dir: str, class_names: list[str]) -> dict:
    decoded = ds.prepare(ds.Fetched(**fetched), cache_dir, tuple(class_names))
    get_run_logger().info(
        f"decoded {decoded.num_images} images into {decoded.path}; per class "
        + ", ".join(f"{n} {c}" for n, c in zip(decoded.class_names, decoded.class_counts))
    )
    return decoded.as_dict()


@task(name="eurosat-split", cache_policy=CACHE_POLICY, persist_result=True)
def split(decoded: dict, val_fraction: float, test_fraction: float, seed: int, cache_dir: str) -> dict:
    path, sizes = ds.save_split(
        ds.Decoded(
            **{**decoded, "class_names": tuple(decoded["class_names"]), "class_counts": tuple(decoded["class_counts"])}
        ),
        val_fraction,
        test_fraction,
        seed,
        cache_dir,
    )
    get_run_logger().info(f"split (seed {seed}): {sizes}; stored in {path}")
    return {"path": path, "sizes": sizes}


def _flows_dir() -> Path:
    """Where ``eurosat`` lives: the job runs in the restored project (cwd), a plain call next to this file."""
    for candidate in (Path.cwd() / "flows", Path(__file__).resolve().parent):
        if (candidate / "eurosat" / "__init__.py").exists():
            return candidate
    raise RuntimeError(f"cannot find the eurosat package (cwd {Path.cwd()})")


@kinetic_task(name="eurosat-train", accelerator="cpu", retries=2, retry_delay_seconds=0)
def train(
    dataset: Path,
    split_file: Path,
    model_config: dict,
    train_config: dict,
    kill_after_epoch: int | None = None,
    train_limit: int | None = None,
) -> dict:
    """The job: train, checkpoint every epoch, evaluate on the test split, write outputs."""
    flows_dir = str(_flows_dir())
    if flows_dir not in sys.path:
        sys.path.insert(0, flows_dir)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    from eurosat.train import train_and_evaluate

    result = train_and_evaluate(
        dataset, split_file, model_config, train_config, kill_after_epoch=kill_after_epoch, train_limit=train_limit
    )
    result["store"] = os.environ.get("KINETIC_STORE")
    return result


@task(name="eurosat-evaluate")
def evaluate(trained: dict) -> dict:
    """Metrics from the job's test-split predictions (recomputed here, on the caller)."""
    from eurosat import metrics as mt

    test = trained["test"]
    metrics = mt.compute_metrics(test["y_true"], test["y_pred"], trained["class_names"])
    job = trained["metrics"]
    if metrics["accuracy"] != job["accuracy"]:
        raise RuntimeError(f"the job's test predictions give {metrics['accuracy']}, it reported {job['accuracy']}")
    for key in ("scoring", "single_view", "scoring_ms_per_image"):
        if key in job:
            metrics[key] = job[key]
    other = metrics.get("single_view", {})
    get_run_logger().info(
        f"test accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f}, weighted F1 "
        f"{metrics['weighted_f1']:.4f} ({metrics['num_test']} images, {metrics.get('scoring', 'single view')}: "
        f"what `predict` delivers by default); single view {other.get('accuracy', float('nan')):.4f}"
    )
    return metrics


def _download_outputs(trained: dict, output_dir: Path) -> list[str]:
    """Copy what the job left in KINETIC_OUTPUT_DIR (now in the store under outputs/<run id>/) to output_dir."""
    from kinetic_prefect.storage import open_store

    store_url, prefix = trained.get("store"), trained.get("run_prefix")
    output_dir.mkdir(parents=True, exist_ok=True)
    if not store_url or not prefix:  # called as a plain function: the files are already local
        return [str(Path(trained["output_dir"]) / f) for f in trained["files"]]
    store = open_store(store_url)
    run_id = prefix.rstrip("/").rsplit("/", 1)[-1]
    copied = []
    for name in trained["files"]:
        store.get_file(f"outputs/{run_id}/{name}", output_dir / name)  # atomic per file
        copied.append(str(output_dir / name))
    return copied


@task(name="eurosat-publish")
def publish(trained: dict, metrics: dict, output_dir: str, data_source: str) -> dict:
    """Prefect artifacts for the run, and the model/plots/metrics copied into ``output_dir``."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    files = _download_outputs(trained, Path(output_dir))
    create_table_artifact(
        key="eurosat-per-class-metrics",
        table=metrics["per_class"],
        description=f"EuroSAT ViT: per-class precision/recall/F1 on the held-out test split ({metrics['num_test']} images)",
    )
    names = metrics["class_names"]
    create_table_artifact(
        key="eurosat-confusion-matrix",
        table=[
            {"true \\ predicted": names[i], **{n: int(v) for n, v in zip(names, row)}}
            for i, row in enumerate(metrics["confusion_matrix"])
        ],
        description="EuroSAT ViT: confusion matrix on the test split (rows: true class, columns: predicted)",
    )
    history = trained["history"]
    curve = "\n".join(
        f"| {i + 1} | {history['loss'][i]:.4f} | {history['accuracy'][i]:.4f} | {history['val_loss'][i]:.4f} | "
        f"{history['val_accuracy'][i]:.4f} |"
        for i in range(len(history.get("loss", [])))
    )
    sizes = trained["split_sizes"]
    single = metrics.get("single_view", {})
    markdown = f"""# EuroSAT ViT

| metric | value |
| --- | --- |
| test accuracy ({metrics.get("scoring", "single view")}: what `predict` delivers by default) | **{metrics["accuracy"]:.4f}** |
| macro F1 | **{metrics["macro_f1"]:.4f}** |
| single view (`predict --no-tta`): accuracy / macro F1 | {single.get("accuracy", metrics["accuracy"]):.4f} / {single.get("macro_f1", metrics["macro_f1"]):.4f} |
| scoring cost | {metrics.get("scoring_ms_per_image", "n/a")} ms per image |
| weighted F1 | {metrics["weighted_f1"]:.4f} |
| split (train / val / test) | {sizes["train"]} / {sizes["val"]} / {sizes["test"]} |
| epochs run (best) | {trained["epochs_run"]} ({trained["best_epoch"]}) |
| resumed from epoch | {trained["resumed_from_epoch"]} |
| training time | {trained["train_seconds"]:.0f} s ({trained["ms_per_step"]} ms/step) |
| parameters | {trained["parameters"]:,} |

Data: `{data_source}`. Model: `{json.dumps(trained["model_config"])}`.

## Learning curve

| epoch | loss | accuracy | val loss | val accuracy |
| ---: | ---: | ---: | ---: | ---: |
{curve}

## Files

""" + "\n".join(f"- `{f}`" for f in files)
    create_markdown_artifact(key="eurosat-report", markdown=markdown, description="EuroSAT ViT training report")
    # The plots themselves, in the UI: a markdown artifact renders data: URIs (file paths do not).
    pngs = [f for f in files if f.endswith(".png")]
    if pngs:
        import base64

        create_markdown_artifact(
            key="eurosat-plots",
            description="EuroSAT ViT: confusion matrix and learning curves",
            markdown="\n\n".join(
                f"## {Path(f).stem.replace('_', ' ')}\n\n![{Path(f).stem}](data:image/png;base64,"
                f"{base64.b64encode(Path(f).read_bytes()).decode()})"
                for f in pngs
            ),
        )
    model_path = next(f for f in files if f.endswith(".keras"))
    return {"files": files, "model_path": model_path}


def _resolve_configs(model_size: str, model_overrides: dict | None, train_settings: dict) -> tuple[dict, dict]:
    from eurosat.model import PRESETS, ViTConfig, select_precision
    from eurosat.train import TrainConfig

    if model_size != "auto" and model_size not in PRESETS:
        raise ValueError(f"model_size={model_size!r}: choose auto or one of {', '.join(PRESETS)}")
    # the job resolves the preset (``auto`` picks by the device it finds); overrides refine it there
    model_config = {"preset": model_size, **(model_overrides or {})}
    model_config.pop("num_classes", None)
    ViTConfig.from_dict({**PRESETS["tiny"].as_dict(), **(model_overrides or {})})  # unknown options fail here
    select_precision(train_settings.get("precision", "auto"), "cpu")
    TrainConfig(**train_settings)
    return model_config, train_settings


AUGMENT_LEVELS = {"full": {}, "dihedral": {"zoom": 0.0, "shift": 0.0, "color_jitter": 0.0}, "none": {}}


@flow(name="eurosat-vit", log_prints=True)
def eurosat_vit(
    source: str = ds.OFFICIAL_URL,
    checksum: str | None = None,
    accelerator: str = "cpu",
    epochs: int = 30,
    batch_size: int = 128,
    model_size: str = "auto",
    model_overrides: dict | None = None,
    learning_rate: float | None = None,
    weight_decay: float | None = None,
    label_smoothing: float | None = None,
    augment: bool | str = True,
    mix_prob: float = 0.0,
    tta: bool = True,
    precision: str = "auto",
    time_budget_minutes: float | None = None,
    early_stopping_patience: int = 10,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    retries: int = 2,
    output_dir: str | None = None,
    cache_dir: str | None = None,
    train_limit: int | None = None,
    kill_after_epoch: int | None = None,
    hosts: int = 1,
) -> dict:
    """Fetch -> decode -> split -> train (a kinetic job on ``accelerator``) -> evaluate -> publish.

    ``augment``: True / ``"full"`` (flips, rotations, zoom, shift, colour jitter), ``"dihedral"`` (flips and
    rotations only: for minutes-long runs, where the rest only slows fitting), ``"none"`` / False.
    ``model_size``: auto | tiny | seed | small | medium | base | hybrid | hybrid-large
    (``flows/eurosat/model.py``; ``auto``, resolved in the job: ``hybrid`` on CPU, ``hybrid-large`` on a
    GPU/TPU), refined by ``model_overrides`` (e.g. ``{"depth": 6}``). ``precision``: auto (mixed_bfloat16 on
    a GPU/TPU, float32 on CPU) or a Keras dtype policy. Unset optimisation settings take the recipe's values
    (``eurosat.train.TrainConfig``). ``time_budget_minutes``: training stops after that much time and the
    warm-up + cosine schedule follows the clock. ``tta``: score with 8 flips/rotations averaged; the
    published accuracy is the saved model's scoring, which ``predict`` repeats by default (the single-view
    figure is published beside it). ``kill_after_epoch`` is for tests: the first job attempt SIGKILLs itself after
    checkpointing that epoch, and the retry must resume from it. ``hosts``: the slice shape, how many hosts train
    data-parallel as one ``jax.distributed`` group (``batch_size`` is the global batch, split evenly over them;
    on kinetic-local, that many processes on this machine); a multi-host ``accelerator`` brings its own count.
    """
    from prefect.context import get_run_context

    decoded, parts = _prepare_data(source, checksum, _cache_dir(cache_dir), val_fraction, test_fraction, seed)
    model_config, train_config = _resolve_configs(
        model_size,
        model_overrides,
        dict(
            epochs=epochs,
            batch_size=batch_size,
            augment=augment != "none" and augment is not False,
            mix_prob=mix_prob,
            tta=tta,
            seed=seed,
            precision=precision,
            early_stopping_patience=early_stopping_patience,
            time_budget_s=time_budget_minutes * 60 if time_budget_minutes else None,
            **_optional_settings(
                augment, learning_rate=learning_rate, weight_decay=weight_decay, label_smoothing=label_smoothing
            ),
        ),
    )
    if hosts < 1 or batch_size % hosts:
        raise ValueError(f"hosts={hosts} with batch_size={batch_size}: hosts must be >= 1 and divide the global batch")
    trainer = train.with_options(accelerator=accelerator, retries=retries, hosts=hosts if hosts > 1 else None)
    trained = trainer(
        Data(decoded["path"]),
        Data(parts["path"]),
        model_config,
        train_config,
        kill_after_epoch=kill_after_epoch,
        train_limit=train_limit,
    )
    metrics = evaluate(trained)
    run_name = get_run_context().flow_run.name
    out = Path(output_dir or Path.cwd() / "eurosat-outputs" / run_name).resolve()
    published = publish(trained, metrics, str(out), source)
    return _flow_result(metrics, parts, trained, published, run_name, str(get_run_context().flow_run.id))


def _prepare_data(
    source: str, checksum: str | None, cache: str, val_fraction: float, test_fraction: float, seed: int
) -> tuple[dict, dict]:
    """The fetch, decode and split tasks: (decoded, split). A cached result whose files are gone (the cache
    entry outlived them) is computed again."""
    fingerprint = ds.source_fingerprint(source)
    fetched = fetch(source, checksum, fingerprint, cache)
    if not Path(fetched["path"]).exists():
        fetched = fetch.with_options(refresh_cache=True)(source, checksum, fingerprint, cache)
    decoded = decode(fetched, cache, list(ds.CLASS_NAMES))
    if not (Path(decoded["path"]) / "COMPLETE").exists():
        decoded = decode.with_options(refresh_cache=True)(fetched, cache, list(ds.CLASS_NAMES))
    parts = split(decoded, val_fraction, test_fraction, seed, cache)
    if not Path(parts["path"]).exists():
        parts = split.with_options(refresh_cache=True)(decoded, val_fraction, test_fraction, seed, cache)
    return decoded, parts


def _optional_settings(augment: bool | str, **optional) -> dict:
    """The ``TrainConfig`` settings of the ``augment`` level, and those of ``optional`` that are set (the rest
    keep the recipe's values)."""
    optional = {**optional, **AUGMENT_LEVELS.get(augment, {})}
    if augment not in AUGMENT_LEVELS and not isinstance(augment, bool):
        raise ValueError(f"augment={augment!r}: choose True/False or one of {', '.join(AUGMENT_LEVELS)}")
    return {k: v for k, v in optional.items() if v is not None}


def _flow_result(metrics: dict, parts: dict, trained: dict, published: dict, run_name: str, run_id: str) -> dict:
    return {
        "accuracy": metrics["accuracy"],
        "macro_f1": metrics["macro_f1"],
        "weighted_f1": metrics["weighted_f1"],
        "metrics": metrics,
        "split_sizes": parts["sizes"],
        "epochs_run": trained["epochs_run"],
        "best_epoch": trained["best_epoch"],
        "resumed_from_epoch": trained["resumed_from_epoch"],
        "history": trained["history"],
        "train_seconds": trained["train_seconds"],
        "ms_per_step": trained["ms_per_step"],
        "model_path": published["model_path"],
        "files": published["files"],
        "class_names": trained["class_names"],
        "flow_run_name": run_name,
        "flow_run_id": run_id,
    }


# ------------------------------------------------------------------------------------------- predict


def predict(
    model_path: str | Path, folder: str | Path, batch_size: int | None = None, tta: bool | None = None
) -> list[dict]:
    """Classify every image under ``folder`` with a saved model; one dict per file (sorted by path).

    By default it scores as the flow scored the model (``tta`` stored in the model: the published accuracy
    is what this delivers); ``tta=False`` forces the single view (8x cheaper; its figure is published too).
    """
    from eurosat.predict import predict_folder

    return predict_folder(model_path, folder, batch_size=batch_size, tta=tta)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="EuroSAT ViT: train (run) or classify images (predict)")
    sub = parser.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="run the flow")
    run.add_argument("--source", default=ds.OFFICIAL_URL, help="URL, gs://..., local zip or directory")
    run.add_argument("--checksum", default=None, help="sha256:<hex> or md5:<hex> of the zip")
    run.add_argument("--accelerator", default="cpu")
    run.add_argument("--epochs", type=int, default=30)
    run.add_argument("--batch-size", type=int, default=128)
    run.add_argument("--model-size", default="auto", help="auto (hybrid on CPU, hybrid-large on a GPU/TPU) or a preset")
    run.add_argument("--precision", default="auto", help="auto (mixed_bfloat16 on a GPU/TPU) or a Keras dtype policy")
    run.add_argument(
        "--augment",
        default="full",
        choices=list(AUGMENT_LEVELS),
        help="full (default), dihedral (flips/rotations only: for minutes-long runs) or none",
    )
    run.add_argument(
        "--no-tta",
        dest="tta",
        action="store_false",
        help="score (and let predict score) single views instead of 8 flips/rotations averaged",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--time-budget-minutes", type=float, default=None)
    run.add_argument("--output-dir", default=None)
    run.add_argument("--train-limit", type=int, default=None)
    run.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="train data-parallel on this many hosts (kinetic-local: processes), one jax.distributed group",
    )
    pred = sub.add_parser("predict", help="classify a folder of images with a saved .keras model")
    pred.add_argument("model")
    pred.add_argument("folder")
    pred.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pred.add_argument(
        "--tta",
        dest="tta",
        action="store_true",
        default=None,
        help="average 8 flips/rotations (8x the compute); default: as the flow scored the model",
    )
    pred.add_argument("--no-tta", dest="tta", action="store_false", help="single view (8x cheaper)")
    args = parser.parse_args(argv)
    if args.cmd == "predict":
        rows = predict(args.model, args.folder, tta=args.tta)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for row in rows:
                print(f"{row['file']}\t{row['class']}\t{row['confidence']:.3f}")
        return
    if args.cmd is None:
        args = parser.parse_args(["run", *(argv or sys.argv[1:])])
    result = eurosat_vit(
        source=args.source,
        checksum=args.checksum,
        accelerator=args.accelerator,
        epochs=args.epochs,
        batch_size=args.batch_size,
        model_size=args.model_size,
        seed=args.seed,
        time_budget_minutes=args.time_budget_minutes,
        output_dir=args.output_dir,
        train_limit=args.train_limit,
        tta=args.tta,
        precision=args.precision,
        augment=args.augment,
        hosts=args.hosts,
    )
    print(
        json.dumps(
            {k: result[k] for k in ("accuracy", "macro_f1", "weighted_f1", "split_sizes", "epochs_run", "model_path")},
            indent=1,
        )
    )
    print(where_to_look(result))


def _api_url() -> str | None:
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().api.url
    except Exception:  # noqa: BLE001 - the summary must not fail the run
        return os.environ.get("PREFECT_API_URL")


def where_to_look(result: dict, api_url: str | None | bool = True) -> str:
    """The closing summary: the score, where the model, plots and metrics are, and how to see the run.
    ``api_url``: the Prefect API the run used (``True``: read it from the current settings; ``None``: none, it
    ran on Prefect's temporary server)."""
    m = result["metrics"]
    out = Path(result["model_path"]).parent
    single = m.get("single_view", {})
    scoring = m.get("scoring", "single view")
    lines = [
        f"test accuracy {100 * m['accuracy']:.2f} %, macro F1 {m['macro_f1']:.3f} ({m['num_test']} held-out "
        f"test images, {scoring}; single view {100 * single.get('accuracy', m['accuracy']):.2f} %)",
        f"model:   {result['model_path']}",
        f"plots:   {out / 'confusion_matrix.png'}, {out / 'learning_curves.png'}",
        f"metrics: {out / 'metrics.json'} (also the Prefect artifacts eurosat-report, eurosat-per-class-metrics,"
        " eurosat-confusion-matrix)",
        f"predict: uv run --extra ml python flows/eurosat_vit.py predict {result['model_path']} FOLDER   ({scoring}, "
        "as scored above)",
    ]
    api = _api_url() if api_url is True else api_url
    if api:
        ui = api.rstrip("/").removesuffix("/api")
        run = result.get("flow_run_id")
        lines.append(f"UI:      {ui}/runs/flow-run/{run}" if run else f"UI:      {ui}")
    else:
        lines.append(
            "UI:      this run used Prefect's temporary server, gone now. To keep runs and browse them: "
            "`uv run prefect server start` in another terminal, then "
            "`uv run prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api` and run again; "
            "the run, its logs and artifacts are at http://127.0.0.1:4200"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
