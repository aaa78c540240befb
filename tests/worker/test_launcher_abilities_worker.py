"""The worker side decides by its launcher's abilities (contract.launchers.LauncherAbilities): ``runs_here`` lets an
accelerator the machine lacks run on its CPU (and say so), ``price_source`` names the built-in price table a job is
metered at, ``extras`` agrees with the line that registers the launcher."""

from __future__ import annotations

import pytest

from kinetic_prefect import accelerators, workers
from kinetic_prefect.shared import cost
from kinetic_prefect.workers.attempts import plan_for
from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration

pytestmark = pytest.mark.no_server


def _registered() -> list:
    return [workers.find(worker_type) for worker_type in workers.LAUNCHERS]


def test_an_accelerator_this_machine_lacks_runs_on_its_cpu_only_where_the_launcher_runs_jobs_here():
    missing = next(
        n
        for n in ("tpu-v6e-8", "h100x8")
        if not accelerators.local_platform_available(accelerators.resolve(n).jax_platform)
    )
    configuration = KineticLocalJobConfiguration(accelerator=missing)
    here = plan_for(configuration, runs_here=True)
    assert here.instead_of == missing and here.current.name == "cpu"
    elsewhere = plan_for(configuration, runs_here=False)  # a cloud launcher: the node has what was asked for
    assert elsewhere.instead_of is None and elsewhere.current.name == missing


@pytest.mark.parametrize("worker", _registered(), ids=lambda w: getattr(w, "type", "not installed"))
def test_each_launcher_names_a_price_source_with_a_built_in_table(worker):
    if worker is None:
        pytest.skip("its extras are not installed")
    assert worker.abilities.price_source in cost.TABLES, worker.abilities.price_source
    # the table the job is metered at is that source's: an accelerator priced there is priced for the job
    l4 = accelerators.resolve("l4")
    assert cost.price_for(l4, {}, worker.abilities.price_source) is cost.TABLES[worker.abilities.price_source]["l4"]


def test_a_launcher_whose_class_states_other_extras_than_its_registration_is_not_registered(monkeypatch):
    """The install command for a missing extra comes from workers.LAUNCHERS (the class cannot be imported to be
    asked); the class's own ``extras`` may not drift from it."""
    import dataclasses

    from kinetic_prefect.workers.local.worker import KineticLocalWorker

    for worker_type, line in workers.LAUNCHERS.items():
        cls = workers.find(worker_type)
        if cls is not None:
            assert set(cls.abilities.extras) == set(line.extras), worker_type
    monkeypatch.setattr(
        KineticLocalWorker, "abilities", dataclasses.replace(KineticLocalWorker.abilities, extras=("gcp",))
    )
    line = workers.LAUNCHERS["kinetic-local"]
    with pytest.raises(TypeError, match=r"KineticLocalWorker.abilities.extras \('gcp',\) differs"):
        workers._register("kinetic-local", line.worker, line.extras)
