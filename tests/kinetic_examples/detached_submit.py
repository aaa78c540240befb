"""Kinetic's detached-jobs example (docs/guides/async_jobs.md), ported by its import line: submit two jobs with
``run_async()``, print their ids, exit. Any other process collects them (tests/kinetic_api/test_kinetic_api.py). A third
argument names a file where the slow job writes its process id (the test checks it is gone after a cancel)."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

from kinetic_prefect import kinetic  # was: import kinetic


@kinetic.run(accelerator="cpu")
def train_model_a():
    """Train a small dense model; return the final loss."""
    import keras
    import numpy as np

    model = keras.Sequential(
        [keras.layers.Input(shape=(10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    x, y = np.random.randn(64, 10), np.random.randn(64, 1)
    print("Training model A...")
    history = model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    final_loss = history.history["loss"][-1]
    print(f"Model A done, loss: {final_loss}")
    return final_loss


@kinetic.run(accelerator="cpu")
def long_job(pid_file):
    """A job that would run for a long time; printing its progress."""
    import pathlib
    import time

    pathlib.Path(pid_file).write_text(str(os.getpid()))
    for step in range(600):
        print(f"step {step}", flush=True)
        time.sleep(1)
    return "never"


if __name__ == "__main__":
    job_a = train_model_a.run_async()
    job_b = long_job.run_async(sys.argv[1])
    print(json.dumps({"a": job_a.job_id, "b": job_b.job_id}), flush=True)
