"""kinetic-vertex at the client boundary: the ``CustomJob`` request a call becomes, in google-cloud-aiplatform's own
types, built from the pool's generated template (no server, no Vertex)."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from google.cloud.aiplatform_v1 import types as vertex
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators
from kinetic_prefect.workers.vertex import custom_job, machines
from kinetic_prefect.workers.vertex.configuration import KineticVertexJobConfiguration
from kinetic_prefect.workers.vertex.worker import KineticVertexWorker

pytestmark = pytest.mark.no_server


def _configuration(**values) -> KineticVertexJobConfiguration:
    template = KineticVertexWorker.get_default_base_job_template()
    base = {"gcp_project": "proj", "region": "us-central1", "image": "us-docker.pkg.dev/proj/repo/job:abc"}
    configuration = asyncio.run(KineticVertexJobConfiguration.from_template_and_values(template, {**base, **values}))
    flow_run = FlowRun(flow_id=uuid.uuid4(), name="brave-otter")
    configuration.prepare_for_flow_run(flow_run)
    configuration.env["KINETIC_PAYLOAD_SHA256"] = "0" * 64
    return configuration, flow_run


def test_an_l4_spot_call_is_a_g2_machine_with_one_l4_at_spot_prices_and_no_retries_by_vertex():
    configuration, flow_run = _configuration(accelerator="l4", spot=True, maximum_run_time_hours=2)
    request = custom_job.custom_job(configuration, flow_run)
    assert isinstance(request, vertex.CustomJob)
    [pool] = request.job_spec.worker_pool_specs
    assert pool.machine_spec.machine_type == "g2-standard-8"
    assert pool.machine_spec.accelerator_type == vertex.AcceleratorType.NVIDIA_L4
    assert pool.machine_spec.accelerator_count == 1
    assert pool.replica_count == 1
    assert request.job_spec.scheduling.strategy == vertex.Scheduling.Strategy.SPOT
    assert request.job_spec.scheduling.timeout.total_seconds() == 7200  # prefect-gcp's maximum_run_time_hours
    assert request.job_spec.scheduling.disable_retries, "retries and preemptions belong to the lifecycle"
    assert list(pool.container_spec.command) == ["python", "-u", "-m", "kinetic_prefect.pod.runner"]
    assert request.labels["kinetic-flow-run"] == str(flow_run.id)
    # what goes over the wire is the library's own JSON of the request
    wire = json.loads(vertex.CustomJob.to_json(request))
    assert wire["jobSpec"]["workerPoolSpecs"][0]["machineSpec"]["acceleratorType"] in ("NVIDIA_L4", 11)


def test_the_job_gets_the_kinetic_env_and_never_the_workers_prefect_settings(monkeypatch):
    monkeypatch.setenv("PREFECT_API_KEY", "worker-secret")
    configuration, flow_run = _configuration(accelerator="cpu", env={"PREFECT_API_KEY": "x", "MY_SETTING": "1"})
    configuration.set_secret_env({"FORWARDED": "value"})
    env = {
        e.name: e.value
        for e in custom_job.custom_job(configuration, flow_run).job_spec.worker_pool_specs[0].container_spec.env
    }
    assert env["KINETIC_RUN_ID"] == str(flow_run.id)
    assert env["MY_SETTING"] == "1" and env["FORWARDED"] == "value"
    assert not [name for name in env if name.startswith("PREFECT_API")], "the worker's key and server stay its own"


def test_the_custom_job_holds_only_its_runs_derived_keys_never_the_master_key():
    """A custom job's env is part of its spec, readable by whoever may read the job (aiplatform.customJobs.get):
    what that exposes is the job's own run's derived keys, never the worker's master key or its previous ones, even
    when the pool's env names them (docs/security.md, row 21)."""
    from kinetic_prefect import signing
    from kinetic_prefect.contract import RunLayout

    master, previous = "the-master-key-" + uuid.uuid4().hex, "the-previous-key-" + uuid.uuid4().hex
    configuration, flow_run = _configuration(
        accelerator="l4", env={"KINETIC_SIGNING_KEY": master, "KINETIC_SIGNING_KEY_PREVIOUS": previous}
    )
    configuration.hand_over_signing_keys(signing.parse_keys(master, previous))
    request = custom_job.custom_job(configuration, flow_run)
    wire = vertex.CustomJob.to_json(request)
    assert master not in wire and previous not in wire, "no master key in the job's spec"
    [value] = [e.value for e in request.job_spec.worker_pool_specs[0].container_spec.env if e.name == signing.KEY_ENV]
    held = signing.parse_keys(value)
    assert held is not None and not held.is_master
    assert sorted(held.scoped) == sorted(signing.run_scopes(str(flow_run.id)))
    another_run = signing.scope_of_prefix(RunLayout(str(uuid.uuid4())).prefix)
    with pytest.raises(signing.OutOfScope):
        held.key_for(another_run)


def test_a_kinetic_vertex_jobs_cost_is_metered_at_vertex_trainings_table_not_compute_engines(monkeypatch):
    """The worker meters a job at its launcher's price source (``abilities.price_source``): kinetic-vertex's is
    Vertex training's table, whose figure an entry takes when it has one; an entry without one is priced at its
    Compute Engine figure, and its cost record says so."""
    from kinetic_prefect.contract.launchers import PriceSource
    from kinetic_prefect.shared import cost, prices
    from kinetic_prefect.workers import metering

    source = KineticVertexWorker.abilities.price_source
    assert source == PriceSource.VERTEX_CATALOG
    configuration, _ = _configuration(accelerator="l4")
    meter = metering.JobMeter(None, "projects/p/locations/l/customJobs/1", configuration, source)
    [row] = metering.cost_table(meter, "train")[1]
    assert row["price"].startswith(prices.VERTEX_FALLBACK), row
    assert meter.price.on_demand == prices.PRICES["l4"].on_demand, "no Vertex figure yet: the fallback's"

    vertex_rate = prices.vertex_prices({"l4": ((0.1234, 0.0567), "Vertex AI pricing, a test's figure")})
    monkeypatch.setitem(cost.TABLES, PriceSource.VERTEX_CATALOG, vertex_rate)
    meter = metering.JobMeter(None, "projects/p/locations/l/customJobs/2", configuration, source)
    assert (meter.price.on_demand, meter.price.spot) == (0.1234, 0.0567)
    assert metering.cost_table(meter, "train")[1][0]["price"] == "Vertex AI pricing, a test's figure"
    gke = metering.JobMeter(None, "job", configuration, PriceSource.CLOUD_CATALOG)
    assert gke.price.on_demand == prices.PRICES["l4"].on_demand and gke.price.source == prices.PRICES["l4"].source


def test_a_tpu_v5e_4_is_a_ct5lp_host_with_its_topology_and_a_reservation_is_specific():
    reservation = "projects/proj/zones/us-central1-a/reservations/r1"
    configuration, flow_run = _configuration(accelerator="tpu-v5litepod-4", reservation=reservation)
    spec = custom_job.custom_job(configuration, flow_run).job_spec.worker_pool_specs[0].machine_spec
    assert (spec.machine_type, spec.accelerator_type, spec.accelerator_count, spec.tpu_topology) == (
        "ct5lp-hightpu-4t",
        vertex.AcceleratorType.TPU_V5_LITEPOD,
        4,
        "2x2",
    )
    affinity = spec.reservation_affinity
    assert affinity.reservation_affinity_type == vertex.ReservationAffinity.Type.SPECIFIC_RESERVATION
    assert list(affinity.values) == [reservation]


def test_flex_start_waits_for_capacity_with_its_maximum_wait():
    configuration, flow_run = _configuration(accelerator="h100x8", flex_start=True, max_wait_duration_seconds=1800)
    scheduling = custom_job.custom_job(configuration, flow_run).job_spec.scheduling
    assert scheduling.strategy == vertex.Scheduling.Strategy.FLEX_START
    assert scheduling.max_wait_duration.total_seconds() == 1800


def test_hosts_4_is_a_primary_replica_and_a_pool_of_three_that_join_its_group():
    configuration, flow_run = _configuration(accelerator="l4x2", hosts=4)
    pools = custom_job.custom_job(configuration, flow_run).job_spec.worker_pool_specs
    assert [p.replica_count for p in pools] == [1, 3]
    command = list(pools[1].container_spec.command)
    assert command[:2] == ["python", "-c"] and command[3:] == ["python", "-u", "-m", "kinetic_prefect.pod.runner"]
    assert {e.name: e.value for e in pools[1].container_spec.env}["KINETIC_NUM_HOSTS"] == "4"


@pytest.mark.parametrize(
    ("entry", "reason", "nearest"),
    [
        ("tpu-v6e-8", "no TPU v6e accelerator type", "tpu-v5litepod-8"),
        ("tpu-v5litepod-16", "multi-host TPU slice", "tpu-v5litepod-8"),
        ("tpu-v4-8", "not v4", "tpu-v5litepod-4"),
    ],
)
def test_an_entry_vertex_cannot_run_is_refused_with_the_reason_and_the_nearest_entry(entry, reason, nearest):
    with pytest.raises(machines.NotOnVertex) as refused:
        machines.machine_for(entry)
    assert reason in str(refused.value) and refused.value.nearest == nearest
    with pytest.raises(ValueError, match=nearest):
        KineticVertexWorker.check_pool_settings("vx", {"image": "img"}, {"accelerator": entry})


def test_every_gpu_entry_has_a_vertex_accelerator_type_of_the_installed_client():
    for spec in accelerators.catalog():
        if spec.family == "gpu":
            machine = machines.machine_for(spec)
            assert vertex.AcceleratorType[machine.accelerator_type].name == machine.accelerator_type
            assert machine.accelerator_count == spec.chips_per_host


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"requirements": ["--index-url=https://evil.example/simple", "numpy"]}, "requirements"),
        ({"requirements": ["numpy; import os"]}, "requirements"),
        ({"python_version": "3.11; rm -rf /"}, "python_version"),
        ({"base_image": "python:3.11 --build-arg X=1"}, "base_image"),
    ],
)
def test_crafted_build_variables_are_refused_before_anything_is_built(variables, named):
    from kinetic_prefect.workers.vertex.launcher import VertexJobLauncher

    configuration, _ = _configuration(accelerator="cpu", image=None, image_builder="docker", **variables)
    configuration.image_repository = "127.0.0.1:1/never-used"  # a build would fail loudly; the check comes first
    with pytest.raises(ValueError, match=named):
        VertexJobLauncher.ensure_image(configuration, log=lambda line: None)


def test_an_accelerator_entry_naming_a_pool_starts_the_next_pool_of_the_call():
    from kinetic_prefect.caller.options import TaskOptions

    options = TaskOptions(accelerator=["a100x4", "l4:spot", "vx/l4", "vx/t4"], work_pool="gke").resolve()
    assert options.work_pool == "gke"
    assert [s.name for s in options.accelerator_choices] == ["a100x4", "l4"] and options.accelerator_choices[1].spot
    following = options.on_next_pool()
    assert following.work_pool == "vx" and [s.name for s in following.accelerator_choices] == ["l4", "t4"]
    assert following.pool_fallbacks == ()
    assert TaskOptions(accelerator="l4", work_pool="gke").resolve().pool_fallbacks == ()
    with pytest.raises(accelerators.UnknownAcceleratorError):
        TaskOptions(accelerator=["l4", "vx/l44"]).resolve()  # every pool's entries are checked at decoration
