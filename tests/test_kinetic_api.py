"""The ``kinetic`` API (Keras Kinetic's surface on Prefect): names, options, and Kinetic's documented examples
(tests/kinetic_examples/), written here with the calls of Kinetic's docs, on kinetic-local against the session's
real Prefect server."""

from __future__ import annotations

import warnings

import pytest

from kinetic_prefect import accelerators
from kinetic_prefect import kinetic
from kinetic_prefect.kinetic import names


def test_smoke_blocking_and_async():
    @kinetic.run(accelerator="cpu")
    def add(a, b):
        return a + b

    assert add(1, 2) == 3
    job = add.run_async(2, 3)
    assert job.result(timeout=120) == 5
    assert job.status() is kinetic.JobStatus.SUCCEEDED
