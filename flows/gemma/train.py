"""The job: LoRA fine-tuning of a Gemma 3 preset with keras-hub, generations before and after.

Runs inside a kinetic job (``KINETIC_OUTPUT_DIR``, ``KINETIC_CHECKPOINT_DIR``), or as a plain function (then
temporary folders are used). Steps:

1. ``Gemma3CausalLM.from_preset(preset)`` (a Kaggle name, a local folder, or a gs:// folder localised by the
   caller as ``Data``), in ``mixed_bfloat16`` on GPUs with bf16 (compute capability >= 8) and TPUs,
   ``mixed_float16`` on older GPUs, ``float32`` on CPU (``dtype="auto"``).
2. Tokenize and pack the examples (``tokens.pack``): loss on the response tokens only.
3. ``backbone.enable_lora(rank)``; greedy generations on the held-out prompts (the "before" column: LoRA B
   starts at zero, so this is the base model).
4. Train epoch by epoch (AdamW, loss averaged over response tokens), printing a line every ``log_every``
   steps and per epoch; after each epoch the LoRA weights, the optimizer state and the history go to
   ``KINETIC_CHECKPOINT_DIR`` (written first, ``state.json`` last), and a retry of the task run resumes there.
5. Generations after training; ``gemma_lora.lora.h5`` (``save_lora_weights``) and ``merged_preset/``
   (``save_to_preset``: the LoRA deltas merged into the kernels, loadable with ``from_preset(folder)``) are
   written to ``KINETIC_OUTPUT_DIR`` with ``generations.jsonl`` and ``train_summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import read_jsonl
from .tokens import Packed, describe, make_tokenize, pack, segment

DEFAULTS = dict(
    lora_rank=4,
    sequence_length=512,
    epochs=1,
    batch_size=4,
    learning_rate=1e-4,
    weight_decay=0.01,
    max_new_tokens=64,
    eval_batch_size=16,
    eval_before=True,
    num_samples=8,
    seed=0,
    dtype="auto",
    log_every=10,
)
LORA_FILE = "gemma_lora.lora.h5"
MERGED_DIR = "merged_preset"


def _print(*args) -> None:
    print(*args, flush=True)


def hide_accelerators_from_tensorflow() -> None:
    """keras-hub's tokenizers run on TensorFlow ops; left alone, TensorFlow would reserve the GPU's memory that
    JAX (the training backend) needs. Call before keras-hub is imported."""
    try:
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")
    except Exception:  # no TensorFlow, or already initialised: nothing to do
        pass


def choose_dtype(requested: str = "auto") -> str:
    """bf16 mixed precision where the accelerator has it, float32 on CPU."""
    if requested != "auto":
        return requested
    import keras

    if keras.backend.backend() != "jax":
        return "float32"
    import jax

    device = jax.devices()[0]
    if device.platform == "tpu":
        return "mixed_bfloat16"
    if device.platform == "gpu":
        capability = getattr(device, "compute_capability", None)
        try:
            major = int(str(capability).split(".")[0])
        except ValueError:
            major = 8
        return "mixed_bfloat16" if major >= 8 else "mixed_float16"
    return "float32"


def _signature(config: dict, data_dir: Path) -> str:
    """What a checkpoint must match to be resumed: the training settings and the data."""
    keys = ("lora_rank", "sequence_length", "batch_size", "learning_rate", "weight_decay", "seed", "epochs")
    digest = hashlib.sha256(json.dumps({k: config[k] for k in keys}, sort_keys=True).encode())
    for name in ("train.jsonl",):
        digest.update((data_dir / name).read_bytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(ckpt_dir: Path, lm, epoch: int, history: dict, signature: str, step_ms: list[float]) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    lora = ckpt_dir / f"epoch{epoch}.lora.h5"
    tmp = ckpt_dir / f".tmp-epoch{epoch}.lora.h5"
    lm.backbone.save_lora_weights(str(tmp))
    os.replace(tmp, lora)
    opt = ckpt_dir / f"epoch{epoch}-optimizer.npz"
    tmp_opt = ckpt_dir / f".tmp-epoch{epoch}-optimizer.npz"
    with open(tmp_opt, "wb") as fh:
        np.savez(fh, *[np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in lm.optimizer.variables])
    os.replace(tmp_opt, opt)
    state = {
        "epoch": epoch,
        "history": history,
        "signature": signature,
        "lora": lora.name,
        "optimizer": opt.name,
        "optimizer_variables": len(lm.optimizer.variables),
        "step_ms": step_ms,
    }
    tmp_state = ckpt_dir / ".tmp-state.json"
    tmp_state.write_text(json.dumps(state))
    os.replace(tmp_state, ckpt_dir / "state.json")  # the marker, written last
    for old in ckpt_dir.glob("epoch*"):
        if old.name not in (lora.name, opt.name):
            old.unlink(missing_ok=True)


def restore_checkpoint(ckpt_dir: Path, lm, signature: str) -> dict | None:
    state_path = ckpt_dir / "state.json"
    if not state_path.is_file():
        return None
    state = json.loads(state_path.read_text())
    if state.get("signature") != signature:
        _print(f"checkpoint in {ckpt_dir} is from other settings or data: ignored, starting from epoch 0")
        return None
    lm.backbone.load_lora_weights(str(ckpt_dir / state["lora"]))
    optimizer = lm.optimizer
    if not optimizer.built:
        optimizer.build(lm.trainable_variables)
    with np.load(ckpt_dir / state["optimizer"]) as saved:
        values = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    if len(values) != len(optimizer.variables):
        _print(
            f"checkpoint optimizer state has {len(values)} variables, the optimizer {len(optimizer.variables)}: "
            "starting from epoch 0"
        )
        return None
    for variable, value in zip(optimizer.variables, values):
        variable.assign(value)
    return state


# ------------------------------------------------------------------------------------------- generation


def _to_text(value) -> str:
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        value = value.item() if value.shape == () else value.tolist()
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return str(value)


def generate(
    lm, tokenizer, packed, indices: list[int], batch_size: int, max_new_tokens: int, stop_ids: tuple[int, ...]
) -> dict[int, str]:
    """Greedy continuations of the packed prompts at ``indices``; batches of similar length, fixed shapes."""
    order = sorted(indices, key=lambda i: int(packed.lengths[i]))
    full = packed.token_ids.shape[1]
    texts: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = chunk + [chunk[-1]] * (batch_size - len(chunk))  # a fixed batch shape: one compilation
        longest = int(max(packed.lengths[i] for i in chunk))
        width = min(full, -(-(longest + max_new_tokens) // 32) * 32)
        inputs = {
            "token_ids": packed.token_ids[rows, :width],
            "padding_mask": packed.padding_mask[rows, :width],
            # text only: zero images (keras-hub 0.32 cannot batch a None "images" output)
            "images": np.zeros((len(rows), 0, 1, 1, 3), dtype="float32"),
        }
        result = lm.generate(inputs, stop_token_ids=stop_ids)
        tokens = np.asarray(result["token_ids"])
        for row, i in enumerate(chunk):
            start_at = int(packed.lengths[i])
            new = tokens[row, start_at : start_at + max_new_tokens].tolist()
            for position, token in enumerate(new):
                if token in stop_ids:
                    new = new[:position]
                    break
            texts[i] = _to_text(tokenizer.detokenize(new)).strip() if new else ""
    return texts


# ------------------------------------------------------------------------------------------- training


def _count(weights) -> int:
    return int(sum(int(np.prod(w.shape)) for w in weights))


def run(data_dir: Path, preset: str | Path, config: dict, kill_after_epoch: int | None = None) -> dict:
    cfg = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    data_dir = Path(data_dir)
    out_dir, ckpt_dir = _job_dirs()
    t_start = time.perf_counter()
    lm, preprocessor, dtype = _load_preset(preset, cfg)
    load_s = time.perf_counter() - t_start
    examples = _tokenized_examples(lm, preprocessor.tokenizer, data_dir, cfg)
    trainable_params, total_params = _enable_lora(lm, int(cfg["lora_rank"]))
    _compile(lm, cfg)

    before: dict[int, str] = {}
    t_gen = time.perf_counter()
    if cfg["eval_before"] and examples.eval_indices:
        before = examples.generate(lm, int(cfg["eval_batch_size"]))
        _print(f"generated {len(before)} answers before fine-tuning in {time.perf_counter() - t_gen:.1f} s")

    trained = _train(lm, examples.train, cfg, ckpt_dir, _signature(cfg, data_dir), kill_after_epoch)

    t_gen = time.perf_counter()
    after = examples.generate(lm, int(cfg["eval_batch_size"])) if examples.eval_indices else {}
    _print(f"generated {len(after)} answers after fine-tuning in {time.perf_counter() - t_gen:.1f} s")

    _save_lora_and_merged_preset(lm, preprocessor, out_dir, examples.sequence_length)
    generations = _write_generations(out_dir, examples, before, after)
    summary = {
        "preset": cfg.get("preset_name") or str(preset),
        "dtype": dtype,
        "config": cfg,
        "epochs_run": len(trained.history["loss"]),
        "resumed_from_epoch": trained.start_epoch,
        "history": trained.history,
        "ms_per_step": round(float(np.median(trained.step_ms)), 1) if trained.step_ms else None,
        "first_step_ms": round(trained.first_step_ms, 1) if trained.first_step_ms else None,
        "steps_per_epoch": trained.steps,
        "train_seconds": round(trained.seconds, 2),
        "load_seconds": round(load_s, 2),
        "trainable_params": trainable_params,
        "total_params": total_params,
        "token_stats": {"train": examples.train.stats, "eval": examples.eval.stats},
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    return {**summary, "generations": generations, "files": files, "output_dir": str(out_dir)}


def _job_dirs() -> tuple[Path, Path]:
    """The job's output and checkpoint folders; temporary ones for a plain call."""
    out_dir = Path(os.environ.get("KINETIC_OUTPUT_DIR") or tempfile.mkdtemp(prefix="gemma-lora-out-"))
    ckpt_dir = Path(os.environ.get("KINETIC_CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="gemma-lora-ckpt-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, ckpt_dir


def _load_preset(preset: str | Path, cfg: dict):
    """(the causal LM without its preprocessor, the preprocessor, the dtype policy). The job feeds token ids:
    packing and loss masking are ours, so the LM's preprocessor is detached (and put back before saving)."""
    hide_accelerators_from_tensorflow()
    import keras
    import keras_hub

    keras.utils.set_random_seed(int(cfg["seed"]))
    dtype = choose_dtype(cfg["dtype"])
    _print(
        f"loading preset {preset} (dtype {dtype}, keras {keras.__version__}, keras-hub {keras_hub.__version__}, "
        f"backend {keras.backend.backend()})"
    )
    lm = keras_hub.models.Gemma3CausalLM.from_preset(str(preset), dtype=dtype)
    preprocessor = lm.preprocessor
    lm.preprocessor = None
    return lm, preprocessor, dtype


@dataclass(frozen=True)
class Examples:
    """The training examples packed for fitting, the held-out prompts packed for generation."""

    tokenizer: object
    train: Packed
    eval: Packed
    eval_rows: list[dict]
    stop_ids: tuple[int, ...]
    sequence_length: int
    max_new_tokens: int

    @property
    def eval_indices(self) -> list[int]:
        return list(range(len(self.eval_rows)))

    def generate(self, lm, batch_size: int) -> dict[int, str]:
        return generate(
            lm, self.tokenizer, self.eval, self.eval_indices, batch_size, self.max_new_tokens, self.stop_ids
        )


def _tokenized_examples(lm, tokenizer, data_dir: Path, cfg: dict) -> Examples:
    tokenize = make_tokenize(tokenizer)
    bos, pad = int(tokenizer.start_token_id), int(tokenizer.pad_token_id)
    stop_ids = tuple(int(t) for t in (tokenizer.end_token_id, tokenizer.token_to_id("<end_of_turn>")))
    seq_len, max_new = int(cfg["sequence_length"]), int(cfg["max_new_tokens"])
    train_rows, eval_rows = read_jsonl(data_dir / "train.jsonl"), read_jsonl(data_dir / "eval.jsonl")
    train_packed = pack(segment(train_rows, tokenize), seq_len, bos, pad, what="training")
    eval_packed = pack(segment(eval_rows, tokenize), seq_len, bos, pad, generate_tokens=max_new, what="evaluation")
    _print(describe(train_packed.stats))
    _print(describe(eval_packed.stats))
    vocab = lm.backbone.vocabulary_size
    if train_packed.token_ids.size and int(train_packed.token_ids.max()) >= vocab:
        raise ValueError(
            f"the tokenizer produced id {int(train_packed.token_ids.max())} >= the backbone's "
            f"vocabulary_size {vocab}: the preset's tokenizer and model do not match"
        )
    return Examples(tokenizer, train_packed, eval_packed, eval_rows, stop_ids, seq_len, max_new)


def _enable_lora(lm, rank: int) -> tuple[int, int]:
    """(trainable, total) parameters of the backbone once LoRA of ``rank`` is on."""
    lm.backbone.enable_lora(rank=rank)
    total_params = _count(lm.backbone.weights)
    trainable_params = _count(lm.backbone.trainable_weights)
    _print(
        f"LoRA rank {rank}: {trainable_params:,} trainable of {total_params:,} parameters "
        f"({100 * trainable_params / max(total_params, 1):.3f}%)"
    )
    return trainable_params, total_params


def _compile(lm, cfg: dict) -> None:
    """AdamW (no weight decay on biases and norm scales); the loss is averaged over the response tokens, which
    the sample weights select."""
    import keras

    optimizer = keras.optimizers.AdamW(
        learning_rate=float(cfg["learning_rate"]), weight_decay=float(cfg["weight_decay"])
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        sampler="greedy",
    )


@dataclass
class Trained:
    history: dict[str, list[float]]
    step_ms: list[float]
    first_step_ms: float | None
    start_epoch: int
    steps: int
    seconds: float


def _train(lm, packed: Packed, cfg: dict, ckpt_dir: Path, signature: str, kill_after_epoch: int | None) -> Trained:
    """Epoch by epoch from the last checkpoint of the same settings and data, a checkpoint after each.
    ``kill_after_epoch`` (a test hook) SIGKILLs the first attempt after that epoch's checkpoint."""
    import keras

    epochs, batch_size = int(cfg["epochs"]), int(cfg["batch_size"])
    history: dict[str, list[float]] = {"loss": [], "accuracy": []}
    step_ms: list[float] = []
    start_epoch = 0
    state = restore_checkpoint(ckpt_dir, lm, signature)
    if state is not None:
        start_epoch, history, step_ms = int(state["epoch"]), state["history"], list(state.get("step_ms", []))
        _print(f"resumed from the checkpoint of epoch {start_epoch}/{epochs} in {ckpt_dir}")

    n = len(packed.token_ids)
    steps = max(1, -(-n // batch_size))
    progress = _progress_callback(keras, epochs, steps, int(cfg["log_every"]))
    first_step_ms = None
    t_train = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        progress.epoch = epoch + 1
        loss, acc = _fit_epoch(lm, packed, epoch, steps, batch_size, int(cfg["seed"]), progress)
        history["loss"].append(loss)
        history["accuracy"].append(acc)
        times = progress.times
        if first_step_ms is None and times and epoch == start_epoch:  # the first step compiles: kept apart
            first_step_ms = times[0]
            times = times[1:]
        step_ms.extend(times)
        save_checkpoint(ckpt_dir, lm, epoch + 1, history, signature, step_ms)
        _print(
            f"epoch {epoch + 1}/{epochs} loss={loss:.4f} accuracy={acc:.4f} "
            f"({np.median(times) if times else float('nan'):.0f} ms/step, checkpoint saved)"
        )
        if kill_after_epoch is not None and epoch + 1 == kill_after_epoch and start_epoch == 0:
            _print(f"kill_after_epoch={kill_after_epoch}: SIGKILL (test hook)")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return Trained(history, step_ms, first_step_ms, start_epoch, steps, time.perf_counter() - t_train)


def _fit_epoch(lm, packed: Packed, epoch: int, steps: int, batch_size: int, seed: int, progress) -> tuple[float, float]:
    """One epoch over a permutation seeded by (seed, epoch), so a resumed run sees the batches the uninterrupted
    one would have; next-token targets, weighted to the response tokens. (loss, token accuracy)."""
    n = len(packed.token_ids)
    rng = np.random.default_rng(seed * 1000 + epoch)
    order = rng.permutation(n)
    if len(order) < steps * batch_size:  # full batches only: one compiled shape
        order = np.concatenate([order, rng.choice(n, steps * batch_size - len(order))])
    ids, mask, resp = packed.token_ids[order], packed.padding_mask[order], packed.response_mask[order]
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, weights = ids[:, 1:], resp[:, 1:].astype("float32")
    fit = lm.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=batch_size,
        epochs=epoch + 1,
        initial_epoch=epoch,
        shuffle=False,
        verbose=0,
        callbacks=[progress],
    )
    return float(fit.history["loss"][-1]), float(fit.history["accuracy"][-1])


def _save_lora_and_merged_preset(lm, preprocessor, out_dir: Path, sequence_length: int) -> None:
    lm.backbone.save_lora_weights(str(out_dir / LORA_FILE))
    lm.preprocessor = preprocessor
    preprocessor.sequence_length = sequence_length
    if lm.backbone.dtype_policy.name.startswith("mixed_"):
        # keras-hub 0.32 cannot reload a preset whose config names a mixed policy; the variables are float32.
        lm.backbone.dtype_policy = lm.backbone.dtype_policy.variable_dtype
    lm.save_to_preset(str(out_dir / MERGED_DIR))  # LoRA merged into the kernels


def _write_generations(out_dir: Path, examples: Examples, before: dict, after: dict) -> list[dict]:
    """generations.jsonl: each held-out example with its generations before and after fine-tuning."""
    rows = examples.eval_rows
    generations = [
        {
            "id": rows[i]["id"],
            "input": rows[i]["input"],
            "target": rows[i]["target"],
            "references": rows[i]["references"],
            "before": before.get(i),
            "after": after.get(i),
        }
        for i in examples.eval_indices
    ]
    with open(out_dir / "generations.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(g, ensure_ascii=False) + "\n" for g in generations)
    return generations


def _progress_callback(keras, epochs: int, steps: int, every: int):
    class Progress(keras.callbacks.Callback):
        """One line every ``every`` steps (streams into the flow run's logs); step times, synchronised."""

        def __init__(self):
            super().__init__()
            self.epoch, self.times, self._t = 0, [], 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            loss = float(np.asarray((logs or {}).get("loss", np.nan)))  # forces the step to finish
            self.times.append((time.perf_counter() - self._t) * 1000)
            if (batch + 1) % max(every, 1) == 0 or batch + 1 == steps:
                _print(
                    f"epoch {self.epoch}/{epochs} step {batch + 1}/{steps} loss={loss:.4f} ({self.times[-1]:.0f} ms)"
                )

    return Progress()
