"""caller/env_capture.py: which caller variables a call forwards (``env=``, Kinetic's ``capture_env_vars``)."""

import pytest

from kinetic_prefect.caller.decorator import kinetic_task
from kinetic_prefect.caller.env_capture import forwarded_environment

pytestmark = pytest.mark.no_server

CALLER = {
    "PATH": "/caller/bin",
    "HOME": "/home/ada",
    "VIRTUAL_ENV": "/home/ada/.venv",
    "LD_PRELOAD": "libfoo.so",
    "PYTHONPATH": "/home/ada/src",
    "KERAS_BACKEND": "torch",
    "KINETIC_WORK_POOL": "ada-pool",
    "PREFECT_API_URL": "http://127.0.0.1:4200/api",
    "WANDB_API_KEY": "k",
    "WANDB_PROJECT": "p",
    "HF_TOKEN": "t",
}


def test_a_star_forwards_the_users_variables_and_none_of_the_process_configuration():
    assert forwarded_environment(("*",), environ=CALLER) == {
        "WANDB_API_KEY": "k",
        "WANDB_PROJECT": "p",
        "HF_TOKEN": "t",
    }


def test_any_glob_skips_the_process_configuration_but_an_exact_name_forwards_it():
    assert forwarded_environment(("KERAS_*", "LD_*"), environ=CALLER) == {}
    assert forwarded_environment(("KERAS_BACKEND", "KERAS_*", "P?TH"), environ=CALLER) == {"KERAS_BACKEND": "torch"}
    assert forwarded_environment(("WANDB_*",), environ=CALLER) == {"WANDB_API_KEY": "k", "WANDB_PROJECT": "p"}


def test_an_unset_exact_name_fails_by_default_and_is_left_out_with_warn(caplog):
    with pytest.raises(ValueError, match=r"'KAGGLE_KEY' is not set.*env_missing='warn'"):
        forwarded_environment(("HF_TOKEN", "KAGGLE_KEY"), environ=CALLER)
    with caplog.at_level("WARNING", logger="kinetic_prefect"):
        assert forwarded_environment(("HF_TOKEN", "KAGGLE_KEY"), "warn", environ=CALLER) == {"HF_TOKEN": "t"}
    assert "KAGGLE_KEY not set in the calling process" in caplog.text


def test_bad_entries_fail_at_decoration():
    with pytest.raises(ValueError, match="'WANDB_API_KEY=k' is not a variable name"):
        kinetic_task(env=["WANDB_API_KEY=k"], name="noop")(lambda: None)
    with pytest.raises(ValueError, match="env_missing='skip'"):
        kinetic_task(env=["X"], env_missing="skip", name="noop")(lambda: None)
