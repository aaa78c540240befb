"""The Keras callbacks of ``train.train_and_evaluate``: epoch numbering for the batches, the learning-rate
schedule and time budget, the per-epoch progress line, the resumable checkpoint, and the benchmarks' test curve.

Keras is imported at the top, so ``train`` imports this module only inside the job body (the flow's caller side
imports ``train`` without Keras). What both read is in ``config`` and ``scoring``, so neither imports the other's
names back.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np

from eurosat import dataset as ds
from eurosat import metrics as mt
from eurosat.config import CHECKPOINT_STATE, TrainConfig, lr_at, schedule_progress
from eurosat.scoring import predict_images


def _agree(value: float) -> float:
    """The coordinator's value on every process of a group (one value otherwise). Decisions taken from a clock
    (the learning rate of a time-budgeted run, when to stop) must be the same on every host: a replicated
    variable set differently per host, or one host stopping a step early, would break data-parallel training."""
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))


class EpochSetter(keras.callbacks.Callback):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.set_epoch(epoch)


class Schedule(keras.callbacks.Callback):
    """The learning rate of every step from ``lr_at`` (warm-up then cosine, see ``schedule_progress``).

    Progress is the share of the planned steps done or, with ``time_budget_s``, of the budget spent,
    whichever is ahead (so the rate never goes back up); training stops when the budget is spent, even in
    the middle of an epoch. Keeps any reduction ReduceLROnPlateau made (as a factor). The JAX trainer
    keeps the optimizer state outside the Keras variables during an epoch, so the callback syncs it
    (``jax_state_sync``) before assigning a new rate.
    """

    def __init__(self, cfg: TrainConfig, state: dict, steps_per_epoch: int, every: int = 4):
        super().__init__()
        self.cfg, self.state, self.steps, self.every = cfg, state, steps_per_epoch, every
        self.state.setdefault("lr_factor", 1.0)
        self.state.setdefault("planned_epochs", cfg.epochs)
        self._last_set = None
        self._last_batch_t = None
        self._epoch = 0

    def elapsed(self) -> float:
        return self.state.get("train_clock_s", 0.0) + (time.perf_counter() - self._t0) - self._paused()

    def _paused(self) -> float:
        return self.state.get("_paused_this_epoch", 0.0)

    def on_train_begin(self, logs=None):
        self._t0 = time.perf_counter()
        self.state["train_clock_s"] = self.state.get("train_clock_s", 0.0)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._t0 = time.perf_counter()
        self.state["_paused_this_epoch"] = 0.0
        opt = self.model.optimizer
        current = float(keras.ops.convert_to_numpy(opt.learning_rate))
        if self._last_set is not None and current < self._last_set * 0.999:  # ReduceLROnPlateau acted
            self.state["lr_factor"] *= current / self._last_set
        self._set(0)

    def _set(self, batch: int) -> None:
        step = self._epoch * self.steps + batch
        progress = _agree(schedule_progress(self.cfg, step, self.steps, self.elapsed()))
        lr = lr_at(self.cfg, progress) * self.state["lr_factor"]
        if hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()
        self.model.optimizer.learning_rate = lr
        self._last_set = lr

    def on_train_batch_begin(self, batch, logs=None):
        if batch and batch % self.every == 0:
            self._set(batch)

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch_t = time.perf_counter()
        budget = min(b for b in (self.cfg.time_budget_s, self.cfg.stop_after_s, math.inf) if b)
        if budget < math.inf and _agree(float(self.elapsed() + self.state.get("last_val_s", 0.0) >= budget)):
            self.state["stopped_by_time_budget"] = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.state["train_clock_s"] = self.elapsed()
        budget = self.cfg.time_budget_s
        if budget:
            done = self.state["train_clock_s"]
            per_epoch = max(done / (epoch + 1), 1e-9)
            left = math.ceil(max(0.0, budget - done) / per_epoch - 0.05)
            self.state["planned_epochs"] = int(min(self.cfg.epochs, epoch + 1 + left))
        if self._last_batch_t is not None:
            self.state["last_val_s"] = round(time.perf_counter() - self._last_batch_t - self._paused(), 3)
        limit = min(b for b in (budget, self.cfg.stop_after_s, math.inf) if b)
        if limit < math.inf:  # not even a few steps and a validation fit: do not start another epoch
            step_s = self.state["train_clock_s"] / max(1, (epoch + 1) * self.steps)
            if _agree(float(self.state["train_clock_s"] + self.state.get("last_val_s", 0.0) + 5 * step_s >= limit)):
                self.state["stopped_by_time_budget"] = True
                self.model.stop_training = True


class Curve(keras.callbacks.Callback):
    """Benchmarks only: after every epoch, test accuracy / macro F1 (single view) against the training
    clock, into ``state["curve"]``. The clock is paused meanwhile, so the curve costs the run no budget.
    Nothing here feeds back into training (model selection uses the validation split only)."""

    def __init__(self, state: dict, schedule, x_test, y_test, class_names, batch_size: int):
        super().__init__()
        self.state, self.schedule = state, schedule
        self.x_test, self.y_test, self.class_names, self.batch_size = x_test, y_test, class_names, batch_size

    def on_epoch_end(self, epoch, logs=None):
        t = time.perf_counter()
        clock = self.schedule.elapsed()
        probs = predict_images(self.model, self.x_test, self.batch_size, tta=False)
        m = mt.compute_metrics(self.y_test, probs.argmax(axis=1), self.class_names)
        point = {
            "epoch": epoch + 1,
            "train_clock_s": round(clock, 1),
            "test_accuracy": m["accuracy"],
            "test_macro_f1": m["macro_f1"],
            "val_accuracy": round(float((logs or {}).get("val_accuracy", 0)), 4),
        }
        self.state.setdefault("curve", []).append(point)
        print(f"curve: {point}", flush=True)
        self.state["_paused_this_epoch"] = self.state.get("_paused_this_epoch", 0.0) + time.perf_counter() - t


class Progress(keras.callbacks.Callback):
    """One line per epoch on stdout (the job's stdout is the flow run's log), and the epoch's time."""

    def __init__(self, cfg: TrainConfig, state: dict, steps: int, on_epoch=None):
        super().__init__()
        self.cfg, self.state, self.steps, self.on_epoch = cfg, state, steps, on_epoch

    def on_epoch_begin(self, epoch, logs=None):
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        dt = time.perf_counter() - self._t
        self.state.setdefault("epoch_seconds", []).append(round(dt, 3))
        logs = logs if logs is not None else {}
        logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        planned = self.state.get("planned_epochs", self.cfg.epochs)
        line = (
            f"epoch {epoch + 1}/{planned} loss={logs.get('loss', float('nan')):.4f} "
            f"acc={logs.get('accuracy', float('nan')):.4f} val_loss={logs.get('val_loss', float('nan')):.4f} "
            f"val_acc={logs.get('val_accuracy', float('nan')):.4f} lr={logs.get('lr', 0):.2e} "
            f"time={dt:.1f}s ({1000 * dt / self.steps:.0f} ms/step)"
        )
        print(line, flush=True)
        try:  # a progress artifact on the job's run (the worker turns this line into it)
            from kinetic_prefect.progress import report

            report(epoch + 1, planned, f"epoch {epoch + 1}/{planned} val_acc={logs.get('val_accuracy', 0):.4f}")
        except ImportError:  # the training function used without kinetic-prefect
            pass
        if self.on_epoch is not None:
            self.on_epoch(epoch, logs, line)


class Checkpoint(keras.callbacks.Callback):
    """Every epoch: weights + optimizer state + callback state + history into ``directory``, atomically.

    ``state.json`` is replaced last and names the weights file it belongs to, so a kill at any moment
    leaves the previous complete checkpoint. ``kill_after_epoch`` (tests only) SIGKILLs this process
    right after that epoch's checkpoint on the first attempt, like a preempted machine would.
    """

    def __init__(self, directory: Path, state: dict, history: dict, early, plateau, kill_after_epoch=None):
        super().__init__()
        self.dir, self.state, self.history = directory, state, history
        self.early, self.plateau, self.kill_after_epoch = early, plateau, kill_after_epoch

    def on_train_begin(self, logs=None):
        saved = self.state.get("callbacks")
        if saved:  # put back what EarlyStopping / ReduceLROnPlateau had (their on_train_begin reset it)
            e, p = saved["early"], saved.get("plateau")
            self.early.wait, self.early.best, self.early.best_epoch = e["wait"], e["best"], e["best_epoch"]
            best_file = self.dir / "best.weights.npz"
            if best_file.exists():
                with np.load(best_file) as z:
                    self.early.best_weights = [z[f"w{i}"] for i in range(len(z.files))]
            if self.plateau is not None and p:
                self.plateau.wait, self.plateau.best, self.plateau.cooldown_counter = (
                    p["wait"],
                    p["best"],
                    p["cooldown"],
                )

    def on_epoch_end(self, epoch, logs=None):
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(float(v))
        improved = self.early.best_epoch == epoch
        if improved:
            _save_arrays(self.dir / "best.weights.npz", self.model.get_weights())
        name = f"epoch-{epoch + 1:04d}.npz"
        _save_arrays(
            self.dir / name,
            self.model.get_weights()
            + [np.asarray(keras.ops.convert_to_numpy(v)) for v in self.model.optimizer.variables],
        )
        callbacks = {
            "early": {
                "wait": int(self.early.wait),
                "best": _num(self.early.best),
                "best_epoch": int(self.early.best_epoch),
            }
        }
        if self.plateau is not None:
            callbacks["plateau"] = {
                "wait": int(self.plateau.wait),
                "best": _num(self.plateau.best),
                "cooldown": int(self.plateau.cooldown_counter),
            }
        self.state.update(epoch=epoch + 1, weights=name, history=self.history, callbacks=callbacks)
        ds.atomic_write_json(self.dir / CHECKPOINT_STATE, self.state)
        for old in self.dir.glob("epoch-*.npz"):
            if old.name != name:
                old.unlink(missing_ok=True)
        if (
            self.kill_after_epoch is not None
            and epoch + 1 == self.kill_after_epoch
            and not self.state.get("resumed_from_epoch")
        ):
            print(
                f"kill_after_epoch={self.kill_after_epoch}: SIGKILL after checkpointing epoch {epoch + 1}",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


def _num(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else (1e30 if v > 0 else -1e30)


def _save_arrays(path: Path, arrays) -> None:
    import io

    buffer = io.BytesIO()
    np.savez(buffer, **{f"w{i}": a for i, a in enumerate(arrays)})
    ds.atomic_write_bytes(path, buffer.getvalue())
