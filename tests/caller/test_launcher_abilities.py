"""A call that needs what its pool's launcher cannot do is refused before anything is uploaded, naming the pool and
the ability (contract.launchers.LauncherAbilities, asked through caller.pools.abilities_of): warm jobs on
kinetic-vertex (a custom job runs one container to its end), spot capacity and reservations on kinetic-local (the
jobs run on the worker's own machine)."""

from __future__ import annotations

import uuid

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from worker_fixture import new_pool

from kinetic_prefect import kinetic_task


def _job_runs(task_name: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))


def _call(pool: str, **options) -> tuple[str, str]:
    """Call a task with ``options`` on ``pool`` in a flow: the error it raised, and the task's name."""
    name = f"abilities-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, **options)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(ValueError) as refused:
        pipeline()
    return str(refused.value), name


@pytest.mark.parametrize(
    "job_variables, setting",
    [({"keep_warm_seconds": 60}, "keep_warm_seconds=60"), ({"min_warm": 1}, "min_warm=1")],
)
def test_warm_jobs_on_a_launcher_without_warm_reuse_are_refused_before_upload(job_variables, setting):
    pool = new_pool("vertex", "kinetic-vertex")
    message, name = _call(pool, job_variables=job_variables)
    assert message.startswith(f"{setting}: pool {pool!r} (type 'kinetic-vertex') cannot keep jobs warm"), message
    assert "'kinetic-local' or 'kinetic-gke'" in message, message
    assert _job_runs(name) == []


@pytest.mark.parametrize(
    "options, setting",
    [
        ({"accelerator": "l4:spot"}, "accelerator='l4:spot'"),
        ({"accelerator": ["cpu", "t4:spot"]}, "accelerator='t4:spot'"),
        ({"spot_fallback": True}, "spot_fallback=True"),
    ],
)
def test_spot_capacity_on_a_launcher_without_spot_is_refused_before_upload(options, setting):
    pool = new_pool("local")
    message, name = _call(pool, **options)
    assert message.startswith(f"{setting}: pool {pool!r} (type 'kinetic-local') cannot run on spot capacity"), message
    assert "'kinetic-gke' or 'kinetic-vertex'" in message, message
    assert _job_runs(name) == []


@pytest.mark.parametrize(
    "job_variables, setting",
    [({"reservation": "r-1"}, "reservation='r-1'"), ({"flex_start": True}, "flex_start=True")],
)
def test_a_reservation_on_a_launcher_without_reservations_is_refused_before_upload(job_variables, setting):
    pool = new_pool("local")
    message, name = _call(pool, job_variables=job_variables)
    assert message.startswith(
        f"{setting}: pool {pool!r} (type 'kinetic-local') cannot consume a reservation or queued capacity"
    ), message
    assert _job_runs(name) == []


def test_the_same_settings_pass_the_check_on_a_launcher_that_has_the_abilities():
    """The check asks the pool's launcher, not a list of names: kinetic-gke has warm reuse, spot and reservations."""
    from types import SimpleNamespace

    from kinetic_prefect import accelerators
    from kinetic_prefect.caller.job_settings import check_abilities
    from kinetic_prefect.caller.options import KineticOptions
    from kinetic_prefect.caller.pools import abilities_of
    from kinetic_prefect.shared.image import ImageSpec

    options = KineticOptions(
        accelerator=accelerators.resolve("l4:spot"),
        image_spec=ImageSpec.create(None, family="gpu"),
        job_variables={"keep_warm_seconds": 60, "reservation": "r-1"},
        spot_fallback=True,
    )
    pool = SimpleNamespace(name="gke", type="kinetic-gke", base_job_template={"variables": {"properties": {}}})
    check_abilities(options, pool, abilities_of("kinetic-gke"))
    with pytest.raises(ValueError, match="cannot run on spot capacity"):
        check_abilities(options, pool, abilities_of("kinetic-local"))
