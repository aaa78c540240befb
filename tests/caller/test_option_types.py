"""A yes/no option given anything but True or False (``debug="false"``, ``ship_project="no"``, ``spot_fallback=1``)
is refused at decoration, naming the option and the fix, on every way in: ``@kinetic_task``, ``with_options`` and
``kinetic.run``. Read by truthiness, ``debug="false"`` made a job wait 600 s for a debugger."""

from __future__ import annotations

import pytest

from kinetic_prefect import kinetic, kinetic_task

pytestmark = pytest.mark.no_server

NOT_BOOLS = ["false", "no", "True", 0, 1, 1.0]


def _body() -> int:
    return 1


@pytest.mark.parametrize("value", NOT_BOOLS)
@pytest.mark.parametrize("option", ["debug", "ship_project", "spot_fallback"])
def test_a_yes_no_option_that_is_not_a_bool_is_refused_at_decoration(option, value):
    with pytest.raises(ValueError) as refused:
        kinetic_task(name="typed", **{option: value})(_body)
    message = str(refused.value)
    assert message.startswith(f"{option}={value!r}:"), message
    assert "True or False" in message, message


@pytest.mark.parametrize("option", ["debug", "ship_project", "spot_fallback"])
def test_with_options_refuses_it_too(option):
    task = kinetic_task(name="typed")(_body)
    with pytest.raises(ValueError, match=f"^{option}='no': .*True or False"):
        task.with_options(**{option: "no"})


def test_kinetic_run_refuses_a_debug_or_spot_that_is_not_a_bool():
    with pytest.raises(ValueError, match="^debug='false': .*True or False"):
        kinetic.run(accelerator="cpu", debug="false")(_body)
    with pytest.raises(ValueError, match="^spot='no': .*True or False"):
        kinetic.run(accelerator="cpu", spot="no")(_body)


def test_true_false_and_none_where_the_pool_decides_are_taken():
    task = kinetic_task(name="typed", debug=False, ship_project=False, spot_fallback=None)(_body)
    assert (task.kinetic.debug, task.kinetic.ship_project, task.kinetic.spot_fallback) == (False, False, None)
    task = task.with_options(debug=True, ship_project=True, spot_fallback=False)
    assert (task.kinetic.debug, task.kinetic.ship_project, task.kinetic.spot_fallback) == (True, True, False)
    with pytest.raises(ValueError, match="^debug=None: "):
        kinetic_task(name="typed", debug=None)(_body)  # no pool default to fall back on: say True or False
