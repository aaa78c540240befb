"""The pool templates come from one typed model per worker type, and the caller, the templates and the workers
agree on it: the committed ``work_pools/*.json`` are what the models generate, every variable the caller sends
is in the model, and what a worker's job configuration reads back is what was sent."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from kinetic_prefect import accelerators
from kinetic_prefect.caller.calls import KineticOptions, PreparedCall
from kinetic_prefect.caller.job_settings import build_job_variables
from kinetic_prefect.config import work_pools_dir
from kinetic_prefect.contract import RunLayout
from kinetic_prefect.contract.job_variables import OPTIONAL_CALL_VARIABLES, CallVariables
from kinetic_prefect.shared.image import ImageSpec
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.variables import JOB_BACKOFF_LIMIT, KineticGKEVariables
from kinetic_prefect.workers.gke.worker import KineticGKEWorker
from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration
from kinetic_prefect.workers.local.variables import KineticLocalVariables
from kinetic_prefect.workers.local.worker import KineticLocalWorker
from kinetic_prefect.workers.templates import WORKER_TYPES, generated_template, main, template_text
from kinetic_prefect.workers.vertex.configuration import KineticVertexJobConfiguration
from kinetic_prefect.workers.vertex.variables import KineticVertexVariables
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

pytestmark = pytest.mark.no_server

WORKERS = {
    "kinetic-local": (KineticLocalWorker, KineticLocalJobConfiguration, KineticLocalVariables),
    "kinetic-gke": (KineticGKEWorker, KineticGKEJobConfiguration, KineticGKEVariables),
    "kinetic-vertex": (KineticVertexWorker, KineticVertexJobConfiguration, KineticVertexVariables),
}


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_the_committed_template_is_the_generated_one(worker_type: str) -> None:
    committed = (work_pools_dir() / f"{worker_type}.json").read_text()
    assert committed == template_text(worker_type), (
        f"work_pools/{worker_type}.json differs from its model: run `python -m kinetic_prefect.workers.templates`"
    )
    worker, _, variables = WORKERS[worker_type]
    assert worker.job_configuration_variables is variables
    assert worker.get_default_base_job_template() == json.loads(committed)


def test_the_check_command_names_a_stale_template(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for worker_type in WORKER_TYPES:
        (tmp_path / f"{worker_type}.json").write_text(template_text(worker_type))
    monkeypatch.setattr("kinetic_prefect.config.work_pools_dir", lambda: tmp_path)
    assert main(["--check"]) == 0
    (tmp_path / "kinetic-gke.json").write_text("{}")
    assert main(["--check"]) == 1
    assert "kinetic-gke.json" in capsys.readouterr().err
    assert main([]) == 0 and main(["--check"]) == 0  # rewritten


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_every_variable_reaches_the_job_configuration_and_every_field_has_a_variable(worker_type: str) -> None:
    _, configuration, variables = WORKERS[worker_type]
    template = generated_template(worker_type)
    placeholders = set(re.findall(r"\{\{ *(\w+) *\}\}", json.dumps(template["job_configuration"])))
    assert placeholders == set(variables.model_fields), "a variable no field reads, or a placeholder with no variable"
    # a Job manifest (kinetic-gke) and prefect-gcp's job spec (kinetic-vertex) are templates made of the variables
    fields = set(configuration.model_fields) - {"job_manifest", "job_spec"}
    assert fields <= set(variables.model_fields), f"fields without a variable: {fields - set(variables.model_fields)}"
    assert set(CallVariables.model_fields) <= set(variables.model_fields)


def _sent(accelerator: str, pool_variables: set[str], **options: Any) -> dict[str, Any]:
    spec = accelerators.resolve(accelerator)
    kinetic = KineticOptions(
        accelerator=spec, image_spec=ImageSpec(requirements=("numpy",), family=spec.family), **options
    )
    call = PreparedCall(
        layout=RunLayout("run-1"), payload=b"", payload_sha256="0" * 64, code_archive=None, env={}, data=[]
    )
    return build_job_variables(kinetic, call, "gs://bucket/prefix", pool_variables)


@pytest.mark.parametrize(
    "worker_type, accelerator, options",
    [
        ("kinetic-local", "cpu", {"hosts": 2}),
        ("kinetic-gke", "l4", {"image": "img:1", "hosts": 2, "job_variables": {"spot": True, "namespace": "ml"}}),
    ],
)
def test_what_the_caller_sends_is_the_model_and_what_the_worker_reads(
    worker_type: str, accelerator: str, options: dict[str, Any]
) -> None:
    _, configuration_class, variables = WORKERS[worker_type]
    sent = _sent(accelerator, set(variables.model_fields), **options)
    unknown = set(sent) - set(variables.model_fields)
    assert not unknown, f"sent but not in the model: {unknown}"
    assert set(CallVariables.model_fields) - {"name", "labels", "command"} - OPTIONAL_CALL_VARIABLES <= set(sent)
    variables.model_validate(sent)  # the types too
    template = generated_template(worker_type)
    configuration = asyncio.run(configuration_class.from_template_and_values(template, sent, client=None))
    for name, value in sent.items():
        if name in configuration_class.model_fields:
            assert getattr(configuration, name) == value, name


def test_a_pool_without_the_optional_variables_is_sent_none_of_them() -> None:
    pool_variables = set(KineticLocalVariables.model_fields) - OPTIONAL_CALL_VARIABLES
    assert not OPTIONAL_CALL_VARIABLES & set(_sent("cpu", pool_variables, hosts=2))


def test_the_gke_host_count_is_the_catalogs() -> None:
    """One rule for both workers (accelerators.host_count): kinetic-gke used to run one pod for hosts=0."""

    def configuration(**values: Any) -> KineticGKEJobConfiguration:
        return KineticGKEJobConfiguration(**values)

    assert configuration(accelerator="cpu", hosts=3).host_count == 3
    assert configuration(accelerator="tpu-v5litepod-16").host_count == 4
    with pytest.raises(ValueError, match="at least one host"):
        _ = configuration(accelerator="cpu", hosts=0).host_count
    assert (
        generated_template("kinetic-gke")["job_configuration"]["job_manifest"]["spec"]["backoffLimit"]
        == JOB_BACKOFF_LIMIT
        == 0
    )
