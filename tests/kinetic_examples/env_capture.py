"""Kinetic's "Forward Environment Variables" guide (docs/guides/env_vars.md), as a Kinetic user wrote it, with the
one line that changes when porting: the import. The test runs it with some of the named variables set and others
not, and reads the JSON it prints: what the job saw."""

import json
import os

from kinetic_prefect import kinetic  # was: import kinetic


@kinetic.run(accelerator="cpu", capture_env_vars=["KAGGLE_USERNAME", "KAGGLE_KEY", "WANDB_*"])
def train_model():
    import os

    return {name: os.environ.get(name) for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "WANDB_PROJECT")}


# "*" captures the whole local environment, less the names that describe the caller's machine.
@kinetic.run(accelerator="cpu", capture_env_vars=["*"])
def everything():
    import os

    names = ("EXPERIMENT_TAG", "CONDA_PREFIX", "SSH_AUTH_SOCK", "PYTHONSAFEPATH")
    return {name: os.environ.get(name) for name in names}


# An exact name forwards even a name a wildcard skips.
@kinetic.run(accelerator="cpu", capture_env_vars=["CONDA_PREFIX"])
def conda():
    import os

    return os.environ.get("CONDA_PREFIX")


if __name__ == "__main__":
    print(json.dumps({"named": train_model(), "everything": everything(), "exact": conda(), "pid": os.getpid()}))
