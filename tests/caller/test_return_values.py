"""Every kind of return value comes back as itself: ``None`` (what most training steps return), falsy values and
nested ones, through a plain call, ``.submit()`` and ``.map()``, inside a flow and outside one, on both submission
paths (in the calling process, and through a polling ``prefect worker start``).

A plain call that returned ``None`` raised ``AttributeError: 'NoneType' object has no attribute 'result'`` in the
caller once the job had Completed: the lookup of the Completed states that carry a run's capacity summary took
``None`` for one of its own. The worker path starts a polling worker (the session's shared one, ≈ 8 s once)."""

from __future__ import annotations

import pytest
from prefect import flow
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task

VALUES = [None, 0, 0.0, "", b"", [], {}, (), False, {"loss": None, "steps": [None, 0, ""]}, [None], (None, False)]


@pytest.fixture(params=["in-process", "worker"])
def route(request):
    if request.param == "worker":
        return request.getfixturevalue("shared_polling_worker").pool, "worker"
    return new_pool("returns"), "in-process"


def _tasks(route):
    pool, submission = route

    @kinetic_task(name="returns-nothing", work_pool=pool, submission=submission, ship_project=False)
    def train_step(steps: int) -> None:
        total = 0
        for step in range(steps):
            total += step

    @kinetic_task(name="returns-value", work_pool=pool, submission=submission, ship_project=False)
    def value_at(index: int):
        return VALUES[index]

    return train_step, value_at


def test_a_task_that_returns_none_completes_its_flow(route):
    train_step, value_at = _tasks(route)

    @flow
    def pipeline():
        plain = train_step(3)
        submitted = train_step.submit(2).result()
        nested = value_at(len(VALUES) - 3)
        return plain, submitted, nested

    assert pipeline() == (None, None, {"loss": None, "steps": [None, 0, ""]})
    assert train_step(1) is None, "a call outside a flow"


def test_falsy_and_nested_values_come_back_as_themselves(route):
    _, value_at = _tasks(route)

    @flow
    def pipeline():
        return [future.result() for future in value_at.map(list(range(len(VALUES))))]

    returned = pipeline()
    assert returned == VALUES
    assert [type(v) for v in returned] == [type(v) for v in VALUES]
    assert value_at(4) == b"" and value_at(8) is False, "plain calls outside a flow"
