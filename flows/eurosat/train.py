"""Training on decoded uint8 arrays: numpy-fed batches, cheap augmentation, resumable per-epoch checkpoints.

``train_and_evaluate`` is the whole job body: it runs the same inside a ``@kinetic_task`` job and as a
plain function (the benchmark compares the two). It prints one line per epoch (the job's stdout streams
into the Prefect logs), checkpoints every epoch into ``checkpoint_dir`` and resumes from the last finished
epoch when it finds a checkpoint there, evaluates on the held-out test split, and writes the ``.keras``
model (with its class names), plots and metrics into ``output_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

from eurosat import dataset as ds  # noqa: E402
from eurosat import metrics as mt  # noqa: E402
from eurosat.config import CHECKPOINT_STATE, TrainConfig  # noqa: E402
from eurosat.config import lr_at as lr_at  # noqa: E402 - the schedule, read here by the tests and benchmarks
from eurosat.config import schedule_progress as schedule_progress  # noqa: E402
from eurosat.scoring import PREDICT_BATCH_SIZE, TTA_VIEWS, predict_images  # noqa: E402
from eurosat.scoring import predict_logits as predict_logits  # noqa: E402 - the old name

MODEL_FILE = "eurosat_vit.keras"


# ------------------------------------------------------------------------------------------- augmentation


class Augmenter:
    """Vectorized numpy augmentation on uint8 batches: one gather does zoom + shift + flips + rotations."""

    def __init__(self, cfg: TrainConfig, size: int, num_classes: int):
        self.cfg, self.size, self.num_classes = cfg, size, num_classes
        self.base = np.arange(size, dtype=np.float32)

    def __call__(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        cfg, n, s = self.cfg, x.shape[0], self.size
        # zoom-in by scale z >= 1 around a random centre, then shift: sampling grids per sample
        z = 1.0 + rng.uniform(0, cfg.zoom, n).astype(np.float32)
        span = s / z
        max_off = (s - span)[:, None]
        off_r = rng.uniform(0, 1, n).astype(np.float32)[:, None] * max_off
        off_c = rng.uniform(0, 1, n).astype(np.float32)[:, None] * max_off
        shift = cfg.shift * s
        off_r = off_r + rng.uniform(-shift, shift, (n, 1)).astype(np.float32)
        off_c = off_c + rng.uniform(-shift, shift, (n, 1)).astype(np.float32)
        rows = off_r + self.base[None, :] / z[:, None] + 0.5 / z[:, None] - 0.5
        cols = off_c + self.base[None, :] / z[:, None] + 0.5 / z[:, None] - 0.5
        rows = _reflect(np.rint(rows).astype(np.int32), s)
        cols = _reflect(np.rint(cols).astype(np.int32), s)
        # dihedral: swap rows/cols (transpose) and reverse them (flips), still one gather
        k = rng.integers(0, 8, n)
        flip_r, flip_c, transpose = (k & 2) > 0, (k & 1) > 0, (k & 4) > 0
        rows = np.where(flip_r[:, None], rows[:, ::-1], rows)
        cols = np.where(flip_c[:, None], cols[:, ::-1], cols)
        b = np.arange(n)[:, None, None]
        r_idx = np.where(transpose[:, None, None], cols[:, None, :], rows[:, :, None])
        c_idx = np.where(transpose[:, None, None], rows[:, :, None], cols[:, None, :])
        r_idx, c_idx = np.broadcast_arrays(r_idx, c_idx)
        out = x[b, r_idx, c_idx].astype(np.float32)
        if cfg.color_jitter:
            j = cfg.color_jitter
            brightness = rng.uniform(1 - j, 1 + j, (n, 1, 1, 1)).astype(np.float32)
            contrast = rng.uniform(1 - j, 1 + j, (n, 1, 1, 1)).astype(np.float32)
            mean = out.mean(axis=(1, 2, 3), keepdims=True)
            out = np.clip((out - mean) * contrast + mean * brightness, 0, 255)
        onehot = np.eye(self.num_classes, dtype=np.float32)[y]
        if cfg.mix_prob and rng.uniform() < cfg.mix_prob:
            out, onehot = self._mix(out, onehot, rng)
        return out, onehot

    def _mix(self, x, y, rng):
        perm = rng.permutation(x.shape[0])
        lam = float(rng.beta(1.0, 1.0))
        if rng.uniform() < 0.5:  # MixUp
            return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]
        s = self.size  # CutMix: paste a box from another sample, labels by area
        h = int(s * math.sqrt(1 - lam))
        r, c = rng.integers(0, s - h + 1, 2)
        x = x.copy()
        x[:, r : r + h, c : c + h] = x[perm, r : r + h, c : c + h]
        area = h * h / (s * s)
        return x, (1 - area) * y + area * y[perm]


def _reflect(idx: np.ndarray, size: int) -> np.ndarray:
    idx = np.abs(idx)
    return np.where(idx >= size, 2 * size - 2 - idx, idx).clip(0, size - 1)


def make_batches(images, labels, cfg: TrainConfig, num_classes: int, host: int = 0, hosts: int = 1):
    """A keras PyDataset over uint8 arrays; epoch e uses a permutation seeded by (seed, e), so a resumed
    run sees exactly the batches the uninterrupted run would have. With ``hosts`` > 1 (data-parallel over a
    group of processes) every host walks the same global batches and yields its own ``1/hosts`` slice of each;
    Keras joins the slices into the global batch."""
    import keras

    local = cfg.batch_size // hosts

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=1, use_multiprocessing=False)
            self.epoch = 0
            self._order_epoch = None
            self.augment = Augmenter(cfg, images.shape[1], num_classes)

        def __len__(self):
            return max(1, len(labels) // cfg.batch_size)  # drop the ragged last batch: one compiled shape

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __getitem__(self, index):
            if self._order_epoch != self.epoch:
                self.order = np.random.default_rng([cfg.seed, self.epoch]).permutation(len(labels))
                self._order_epoch = self.epoch
            idx = self.order[index * cfg.batch_size : (index + 1) * cfg.batch_size]
            idx = np.sort(idx[host * local : (host + 1) * local])
            x, y = images[idx], labels[idx]
            if cfg.augment:
                rng = np.random.default_rng([cfg.seed, self.epoch, index, 1, *([host] if hosts > 1 else [])])
                return self.augment(x, y, rng)
            return x.astype(np.float32), np.eye(num_classes, dtype=np.float32)[y]

    return Batches()


# ------------------------------------------------------------------------------------------- the job body


def build_compiled_model(model_cfg, cfg: TrainConfig, mean, std):
    import keras

    from eurosat.model import build_vit

    model = build_vit(model_cfg, mean=mean, std=std)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, clipnorm=1.0),
        loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=cfg.label_smoothing),
        metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
    )
    return model


def channel_stats(images: np.ndarray, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 images, in chunks (no float64 copy of the whole training set)."""
    total = np.zeros(3)
    squares = np.zeros(3)
    count = 0
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk].reshape(-1, 3).astype(np.float32)
        total += x.sum(axis=0, dtype=np.float64)
        squares += np.square(x).sum(axis=0, dtype=np.float64)
        count += x.shape[0]
    mean = total / max(count, 1)
    std = np.sqrt(np.maximum(squares / max(count, 1) - mean**2, 0.0)) + 1e-6
    return mean, std


def resolve_model(model_config: dict, precision: str = "auto", platform: str | None = None):
    """(ViTConfig, dtype policy, platform) for this machine. ``model_config`` is a preset name under
    ``"preset"`` (``auto`` picks by device, see ``model.select_preset``) refined by any ViTConfig field."""
    from eurosat.model import PRESETS, ViTConfig, device_platform, select_precision, select_preset

    platform = platform or device_platform()
    options = dict(model_config)
    preset = options.pop("preset", None)
    base = PRESETS[select_preset(preset, platform)].as_dict() if preset else {}
    return ViTConfig.from_dict({**base, **options}), select_precision(precision, platform), platform


def train_and_evaluate(
    dataset_dir: str | Path,
    split_file: str | Path,
    model_config: dict,
    train_config: dict,
    output_dir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    kill_after_epoch: int | None = None,
    train_limit: int | None = None,
    test_curve: bool = False,
) -> dict:
    """Train the ViT on the split's train part (validation: its val part), evaluate on its test part.

    Returns a JSON-able dict: history, epochs, timings, split sizes, test labels/predictions/probabilities,
    metrics, and the names of the files written to ``output_dir`` (model, plots, metrics.json).
    """
    import keras

    t_start = time.perf_counter()
    cfg = TrainConfig(**train_config)
    output_dir, checkpoint_dir = _output_dirs(output_dir, checkpoint_dir)
    data = _load_split_data(dataset_dir, split_file, cfg.seed, train_limit)
    mean, std = channel_stats(data.x_train[::4])  # every 4th image: the same constants, a quarter of the time
    model_cfg, precision, platform = resolve_model(model_config, cfg.precision)
    model_cfg = dataclasses.replace(model_cfg, num_classes=len(data.class_names))
    keras.mixed_precision.set_dtype_policy(precision)
    host, hosts = _join_group(cfg.batch_size)
    print(f"device: {platform}; model {model_config.get('preset') or 'custom'} -> precision {precision}", flush=True)
    print(data.describe(), flush=True)

    keras.utils.set_random_seed(cfg.seed)
    model = build_compiled_model(model_cfg, cfg, mean, std)
    print(
        f"model: ViT {model_cfg.as_dict()}, {model.count_params():,} parameters, {model_cfg.tokens} tokens + [CLS]",
        flush=True,
    )
    state, history, initial_epoch = _resume(
        model, checkpoint_dir, {"model": model_cfg.as_dict(), "train": cfg.as_dict()}
    )
    batches = make_batches(data.x_train, data.y_train, cfg, len(data.class_names), host, hosts)
    early, callbacks = _callbacks(
        cfg, state, history, batches, checkpoint_dir, kill_after_epoch, data if test_curve and hosts == 1 else None
    )
    train_seconds = _fit(model, batches, data, cfg, initial_epoch, state, callbacks)
    _keep_best_and_mark_finished(model, early, state, checkpoint_dir)
    if hosts > 1:
        model = _leave_group(model, host, model_cfg, cfg, mean, std)
        if model is None:
            return {
                "host": host,
                "hosts": hosts,
                "epochs_run": len(history.get("loss", [])),
                "train_seconds": round(train_seconds, 2),
            }

    scored = _score_test_split(model, data, cfg.tta)
    files = _write_outputs(model, output_dir, data.class_names, scored.metrics, history, cfg.tta)
    result = {
        "class_names": data.class_names,
        "split_sizes": data.sizes,
        **_training_summary(history, state, early, cfg.epochs, len(batches), train_seconds),
        "eval_seconds": round(scored.seconds, 2),
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "parameters": int(model.count_params()),
        "model_config": model_cfg.as_dict(),
        "train_config": cfg.as_dict(),
        "test": scored.as_dict(data.y_test),
        "metrics": scored.metrics,
        "output_dir": str(output_dir),
        "files": files,
        "run_prefix": os.environ.get("KINETIC_RUN_PREFIX"),
        "hosts": hosts,
        "global_batch": cfg.batch_size,
    }
    (output_dir / "metrics.json").write_text(json.dumps({k: result[k] for k in METRICS_JSON_KEYS}, indent=1))
    return result


# what metrics.json in the outputs holds: the result without the per-image test predictions
METRICS_JSON_KEYS = (
    "metrics",
    "split_sizes",
    "epochs_run",
    "best_epoch",
    "resumed_from_epoch",
    "train_seconds",
    "ms_per_step",
    "model_config",
    "train_config",
    "history",
)


def _training_summary(history: dict, state: dict, early, epochs: int, steps: int, train_seconds: float) -> dict:
    """The result's account of training: epochs run (best, resumed from), the history and the timings."""
    epoch_seconds = state.get("epoch_seconds", [])
    return {
        "epochs_run": len(history.get("loss", [])),
        "epochs_requested": epochs,
        "best_epoch": int(early.best_epoch) + 1 if early.best_weights is not None else None,
        "resumed_from_epoch": int(state.get("resumed_from_epoch", 0)),
        "stopped_by_time_budget": bool(state.get("stopped_by_time_budget")),
        "history": history,
        "epoch_seconds": epoch_seconds,
        "ms_per_step": round(1000 * float(np.median(epoch_seconds)) / steps, 1) if epoch_seconds else None,
        "steps_per_epoch": steps,
        "train_seconds": round(train_seconds, 2),
    }


def _output_dirs(output_dir: str | Path | None, checkpoint_dir: str | Path | None) -> tuple[Path, Path]:
    """The output and checkpoint folders, created: the arguments, else the job's ``KINETIC_*`` folders, else
    ``eurosat-outputs`` (checkpoints under it) for a plain call."""
    output_dir = Path(output_dir or os.environ.get("KINETIC_OUTPUT_DIR") or "eurosat-outputs")
    checkpoint_dir = Path(checkpoint_dir or os.environ.get("KINETIC_CHECKPOINT_DIR") or output_dir / "checkpoints")
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    return output_dir, checkpoint_dir


@dataclass(frozen=True)
class SplitData:
    """The decoded images cut by the split. Validation images are float32 already (Keras feeds them as they
    are); train and test stay uint8 (augmentation and ``predict_images`` convert per batch)."""

    class_names: list[str]
    num_images: int
    sizes: dict[str, int]
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def describe(self) -> str:
        return (
            f"data: {self.num_images} images, {len(self.class_names)} classes; train {self.sizes['train']}, "
            f"val {self.sizes['val']}, test {self.sizes['test']} (held out until the end)"
        )


def _load_split_data(dataset_dir: str | Path, split_file: str | Path, seed: int, train_limit: int | None) -> SplitData:
    images, labels, meta = ds.load_decoded(dataset_dir)
    split = ds.load_split(split_file)
    train_idx, val_idx, test_idx = split["train"], split["val"], split["test"]
    if train_limit:  # for quick runs: a stratified-looking subset (the split's order is by class)
        train_idx = np.sort(np.random.default_rng(seed).permutation(train_idx)[:train_limit])
    return SplitData(
        class_names=list(meta["class_names"]),
        num_images=len(images),
        sizes={"train": int(len(train_idx)), "val": int(len(val_idx)), "test": int(len(test_idx))},
        x_train=images[train_idx],
        y_train=labels[train_idx],
        x_val=images[val_idx].astype(np.float32),
        y_val=labels[val_idx],
        x_test=images[test_idx],
        y_test=labels[test_idx],
    )


def _join_group(batch_size: int) -> tuple[int, int]:
    """(host, hosts) of the JAX group; with more than one host, training becomes data-parallel over the group's
    devices: weights replicated, each global batch split by host."""
    host, hosts = _group()
    if hosts == 1:
        return host, hosts
    if batch_size % hosts:
        raise ValueError(f"batch_size={batch_size} does not split over {hosts} hosts: use a multiple of {hosts}")
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # make_batches already yields this host's slice
    keras.distribution.set_distribution(distribution)
    print(
        f"group: host {host} of {hosts}, data-parallel over {len(jax.devices())} devices; global batch "
        f"{batch_size} = {hosts} x {batch_size // hosts}",
        flush=True,
    )
    return host, hosts


def _resume(model, checkpoint_dir: Path, config: dict) -> tuple[dict, dict, int]:
    """(state, history, first epoch to run). A checkpoint of the same configuration puts its weights and
    optimizer state into ``model`` and its state is carried on; anything else starts from scratch."""
    state: dict = {"config": config}
    history: dict = {}
    initial_epoch = 0
    state_file = checkpoint_dir / CHECKPOINT_STATE
    if state_file.exists():
        saved = json.loads(state_file.read_text())
        if saved.get("config") != state["config"]:
            print("checkpoint found but its configuration differs; starting from scratch", flush=True)
        elif saved.get("epoch", 0) >= 1:
            _load_weights_and_optimizer(model, checkpoint_dir / saved["weights"])
            state, history, initial_epoch = saved, saved.get("history", {}), saved["epoch"]
            state["resumed_from_epoch"] = initial_epoch
            state["resumes"] = state.get("resumes", 0) + 1
            print(f"resuming from the checkpoint of epoch {initial_epoch} in {checkpoint_dir}", flush=True)
    state.setdefault("resumed_from_epoch", 0)
    return state, history, initial_epoch


def _load_weights_and_optimizer(model, weights_file: Path) -> None:
    """A checkpoint's arrays: the model's weights first, then the optimizer's variables (see ``Checkpoint``)."""
    with np.load(weights_file) as z:
        arrays = [z[f"w{i}"] for i in range(len(z.files))]
    n_model = len(model.get_weights())
    model.set_weights(arrays[:n_model])
    model.optimizer.build(model.trainable_variables)
    for var, value in zip(model.optimizer.variables, arrays[n_model:]):
        var.assign(value)


def _callbacks(
    cfg: TrainConfig,
    state: dict,
    history: dict,
    batches,
    checkpoint_dir: Path,
    kill_after_epoch: int | None,
    curve_data: SplitData | None,
) -> tuple:
    """(the EarlyStopping callback, every callback in the order ``fit`` runs them). ``curve_data``: the
    benchmarks' per-epoch test curve on its test part (None: no curve)."""
    import keras

    from eurosat.callbacks import Checkpoint, Curve, EpochSetter, Progress, Schedule

    steps = len(batches)
    early = keras.callbacks.EarlyStopping(
        monitor="val_accuracy", mode="max", patience=cfg.early_stopping_patience, restore_best_weights=True, verbose=0
    )
    plateau = (
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss",
            factor=cfg.plateau_factor,
            patience=cfg.plateau_patience,
            min_lr=cfg.min_learning_rate,
            verbose=0,
        )
        if cfg.plateau_patience > 0
        else None
    )
    schedule = Schedule(cfg, state, steps)
    curve = (
        [Curve(state, schedule, curve_data.x_test, curve_data.y_test, curve_data.class_names, PREDICT_BATCH_SIZE)]
        if curve_data is not None
        else []
    )
    callbacks = [
        EpochSetter(batches),
        Progress(cfg, state, steps),
        *curve,
        schedule,
        early,
        *([plateau] if plateau is not None else []),
        Checkpoint(checkpoint_dir, state, history, early, plateau, kill_after_epoch),
    ]
    return early, callbacks


def _fit(model, batches, data: SplitData, cfg: TrainConfig, initial_epoch: int, state: dict, callbacks) -> float:
    """Train from ``initial_epoch`` unless the checkpoint says training finished; the seconds it took."""
    import keras

    t_train = time.perf_counter()
    if initial_epoch < cfg.epochs and not state.get("finished"):
        model.fit(
            batches,
            validation_data=(data.x_val, keras.utils.to_categorical(data.y_val, len(data.class_names))),
            validation_batch_size=cfg.eval_batch_size,
            epochs=cfg.epochs,
            initial_epoch=initial_epoch,
            callbacks=callbacks,
            verbose=0,
        )
    return time.perf_counter() - t_train


def _keep_best_and_mark_finished(model, early, state: dict, checkpoint_dir: Path) -> None:
    if early.best_weights is not None:  # EarlyStopping restores only when it stopped; always use the best
        model.set_weights(early.best_weights)
    state["finished"] = True
    ds.atomic_write_json(checkpoint_dir / CHECKPOINT_STATE, state)


def _leave_group(model, host: int, model_cfg, cfg: TrainConfig, mean, std):
    """Training is the group's work; scoring and the outputs are the coordinator's, on a local copy of the
    model (the distributed one would expect every host's share of each batch). None on the other hosts."""
    import keras

    weights = model.get_weights()
    keras.distribution.set_distribution(None)
    if host != 0:
        print(f"host {host}: training done; the coordinator scores the model", flush=True)
        return None
    model = build_compiled_model(model_cfg, cfg, mean, std)
    model.set_weights(weights)
    return model


@dataclass(frozen=True)
class HeldOutScores:
    probs: np.ndarray
    y_pred: np.ndarray
    metrics: dict
    seconds: float

    def as_dict(self, y_true: np.ndarray) -> dict:
        return {
            "y_true": y_true.tolist(),
            "y_pred": self.y_pred.tolist(),
            "probabilities": np.round(self.probs, 5).tolist(),
        }


def _score_test_split(model, data: SplitData, tta: bool) -> HeldOutScores:
    """Score the held-out test split the way the saved model's ``predict`` will (``tta``)."""
    t_eval = time.perf_counter()
    views: list = []
    probs = predict_images(model, data.x_test, PREDICT_BATCH_SIZE, tta=tta, views=views)
    y_pred = probs.argmax(axis=1)
    eval_seconds = time.perf_counter() - t_eval
    metrics = mt.compute_metrics(data.y_test, y_pred, data.class_names)
    # the published figure is the saved model's own scoring (what ``predict`` does by default); the other
    # mode's figure goes beside it. With TTA on, the single-view one is its first pass: no extra cost.
    single = mt.compute_metrics(data.y_test, views[0].argmax(axis=1), data.class_names)
    metrics["scoring"] = scoring_name(tta)
    metrics["single_view"] = {"accuracy": single["accuracy"], "macro_f1": single["macro_f1"]}
    metrics["scoring_ms_per_image"] = round(1000 * eval_seconds / max(1, len(data.y_test)), 3)
    print(
        f"test: accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['macro_f1']:.4f}, weighted F1 "
        f"{metrics['weighted_f1']:.4f} on {len(data.y_test)} held-out images ({metrics['scoring']}, "
        f"{metrics['scoring_ms_per_image']} ms/image); single view: accuracy {single['accuracy']:.4f}, "
        f"macro F1 {single['macro_f1']:.4f}",
        flush=True,
    )
    return HeldOutScores(probs, y_pred, metrics, eval_seconds)


def _write_outputs(model, output_dir: Path, class_names: list[str], metrics: dict, history: dict, tta: bool) -> list:
    """The model with its class names and scoring, the plots and class_names.json; the files' names (with
    metrics.json, which the caller writes last)."""
    files = [MODEL_FILE, "confusion_matrix.png", "learning_curves.png", "metrics.json", "class_names.json"]
    save_model(model, output_dir / MODEL_FILE, class_names, scoring={"tta": bool(tta)})
    mt.plot_confusion_matrix(metrics["confusion_matrix"], class_names, output_dir / "confusion_matrix.png")
    mt.plot_learning_curves(history, output_dir / "learning_curves.png")
    (output_dir / "class_names.json").write_text(json.dumps(class_names))
    return files


def _group() -> tuple[int, int]:
    """(this process's index, the number of processes) of the JAX group the job runs in: (0, 1) for one host."""
    import jax

    return jax.process_index(), jax.process_count()


def scoring_name(tta: bool) -> str:
    return f"{TTA_VIEWS}-way TTA" if tta else "single view"


def save_model(model, path: Path, class_names: list[str], scoring: dict | None = None) -> None:
    """``model.save`` to a temporary name, add ``class_names.json`` (and ``scoring.json``: how the flow
    scored it, which ``predict`` repeats by default) inside the .keras zip, rename into place."""
    import zipfile

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".kp-tmp.{path.stem}.keras")
    model.save(tmp)
    with zipfile.ZipFile(tmp, "a") as zf:
        zf.writestr("class_names.json", json.dumps(class_names))
        zf.writestr("scoring.json", json.dumps(scoring or {"tta": False}))
    os.replace(tmp, path)


def load_scoring(path: str | Path) -> dict:
    """How the flow scored this model (``{"tta": bool}``); models saved before this existed: single view."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        try:
            return json.loads(zf.read("scoring.json"))
        except KeyError:
            return {"tta": False}


def load_model(path: str | Path):
    """The model and its class names (from inside the .keras file)."""
    import zipfile

    import keras

    import eurosat.model  # noqa: F401  registers the custom layer

    path = Path(path)
    with zipfile.ZipFile(path) as zf:
        try:
            class_names = json.loads(zf.read("class_names.json"))
        except KeyError:
            raise ds.DatasetError(
                f"{path} has no class_names.json: not a model saved by this pipeline", str(path)
            ) from None
    return keras.saving.load_model(path, compile=False), class_names
