"""A minimal kinetic flow: the body of `train` runs as a separate job launched by a kinetic worker."""

import os

from prefect import flow

from kinetic_prefect import kinetic_task


@kinetic_task(accelerator="cpu", retries=2)
def train(epochs: int) -> dict:
    import platform

    loss = 1.0
    for epoch in range(epochs):
        loss *= 0.5
        print(f"epoch {epoch + 1}/{epochs} loss={loss:.4f}")
    return {"loss": loss, "pid": os.getpid(), "python": platform.python_version()}


@flow(log_prints=True)
def pipeline(epochs: int = 3) -> dict:
    result = train(epochs)
    print(f"caller pid {os.getpid()}, job result {result}")
    return result


if __name__ == "__main__":
    pipeline()
