"""What `kinetic-prefect up` / `pool add` ask GKE for, from the catalog, and the input they refuse before any request
(pure logic: the requests are container_v1 protos, built and read back here, never sent)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from google.cloud import container_v1

from kinetic_prefect import accelerators
from kinetic_prefect.workers.gke.provision import plan
from kinetic_prefect.workers.gke.provision.plan import ProvisionError

pytestmark = pytest.mark.no_server

PROJECT, ZONE = "my-project-1", "us-central1-a"


def _buildable():
    for spec in accelerators.catalog():
        if spec.family != "cpu" and not (spec.multi_host and spec.gke_accelerator == "tpu7x"):
            yield spec


def test_a_gpu_pool_scales_from_zero_with_the_catalog_machine_and_its_gpus():
    request = plan.node_pool_request(plan.node_pool_spec("l4x2", spot=True))
    assert request.name == "kp-l4x2-spot"
    assert (request.initial_node_count, request.autoscaling.enabled) == (0, True)
    assert (request.autoscaling.min_node_count, request.autoscaling.max_node_count) == (0, 10)
    assert request.config.machine_type == "g2-standard-24" and request.config.spot is True
    (gpu,) = request.config.accelerators
    assert (gpu.accelerator_type, gpu.accelerator_count) == ("nvidia-l4", 2)
    assert gpu.gpu_driver_installation_config.gpu_driver_version.name == "DEFAULT"  # GKE installs the driver
    assert request.config.workload_metadata_config.mode.name == "GKE_METADATA"
    assert not request.placement_policy.tpu_topology


def test_a_multi_host_tpu_slice_is_one_compact_pool_with_its_topology():
    pool = plan.node_pool_spec("tpu-v5litepod-16")
    request = plan.node_pool_request(pool)
    assert request.config.machine_type == "ct5lp-hightpu-4t" and not list(request.config.accelerators)
    assert request.placement_policy.type_ == container_v1.NodePool.PlacementPolicy.Type.COMPACT
    assert request.placement_policy.tpu_topology == "4x4"
    assert (request.autoscaling.min_node_count, request.autoscaling.max_node_count) == (0, 4)
    kept = plan.node_pool_request(plan.node_pool_spec("tpu-v5litepod-16", min_nodes=4))
    assert (kept.initial_node_count, kept.autoscaling.min_node_count, kept.autoscaling.max_node_count) == (4, 4, 4)


def test_a_single_host_tpu_has_no_placement_policy():
    request = plan.node_pool_request(plan.node_pool_spec("v6e-4"))
    assert request.config.machine_type == "ct6e-standard-4t"
    assert not request.placement_policy.tpu_topology and request.autoscaling.max_node_count == 10


def test_a_reservation_is_a_specific_affinity_and_its_own_pool_name():
    pool = plan.node_pool_spec("h100x8", reservation="my-h100s", min_nodes=1)
    affinity = plan.node_pool_request(pool).config.reservation_affinity
    assert affinity.consume_reservation_type.name == "SPECIFIC_RESERVATION"
    assert (affinity.key, list(affinity.values)) == ("compute.googleapis.com/reservation-name", ["my-h100s"])
    assert pool.name.startswith("kp-h100x8-r") and pool.name != plan.node_pool_spec("h100x8").name
    assert (pool.min_nodes, pool.max_nodes) == (1, 11)


def test_the_cluster_has_workload_identity_and_the_gcs_fuse_driver():
    request = plan.cluster_request(plan.settings(PROJECT, ZONE))
    assert request.workload_identity_config.workload_pool == f"{PROJECT}.svc.id.goog"
    assert request.addons_config.gcs_fuse_csi_driver_config.enabled is True
    (default_pool,) = request.node_pools
    assert default_pool.config.machine_type == "e2-standard-4" and default_pool.autoscaling.min_node_count == 1
    assert plan.cluster_shortfalls(request, PROJECT) == []
    request.addons_config.gcs_fuse_csi_driver_config.enabled = False
    assert ["GcsFuseCsiDriver=ENABLED" in s for s in plan.cluster_shortfalls(request, PROJECT)] == [True]


@pytest.mark.parametrize("spot", [False, True])
def test_every_catalog_accelerator_makes_a_pool_read_back_as_itself(spot):
    """`pool list` / `pool remove` find an accelerator's pools from the pool's config alone."""
    for spec in _buildable():
        pool = plan.node_pool_spec(spec.name, spot=spot, reservation=None if spot else "a-reservation-name-x")
        assert len(pool.name) <= 40, pool.name
        assert plan.accelerator_of(plan.node_pool_request(pool)) == spec.with_spot(spot), spec.name


def test_names_follow_the_settings():
    settings = plan.settings(PROJECT, ZONE, "team-a", ["l4", "l4"])
    assert settings.region == "us-central1" and len(settings.node_pools) == 1
    assert settings.image_repository == f"us-central1-docker.pkg.dev/{PROJECT}/kn-team-a"
    assert settings.store == f"gs://{PROJECT}-kn-team-a-jobs/kinetic-prefect"
    assert settings.pool_defaults()["kube_context"] == f"gke_{PROJECT}_{ZONE}_team-a"


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"project": None}, "--project PROJECT_ID"),
        ({"project": "My Project"}, "is not a project ID"),
        ({"zone": "us-central1"}, "--zone 'us-central1' is not a zone"),
        ({"cluster": "Team_A"}, "--cluster 'Team_A'"),
        ({"accelerator_names": ["l5"]}, "Unknown accelerator 'l5'"),
        ({"accelerator_names": ["cpu"]}, "cpu jobs run on the cluster's own"),
        ({"accelerator_names": ["l4"], "spot": True, "reservation": "r1"}, "drop --spot"),
        ({"accelerator_names": ["l4"], "min_nodes": -1}, "--min-nodes -1"),
        ({"accelerator_names": ["v6e-16"], "min_nodes": 2}, "give --min-nodes 0"),
        ({"accelerator_names": ["tpu7x-16"]}, "workload policy"),
        ({"project": "a-project-id-with-thirty-chars", "cluster": "a-cluster-of-26-characters"}, "shorter --cluster"),
    ],
)
def test_bad_input_names_the_culprit_and_the_fix(kwargs, culprit):
    arguments = {"project": PROJECT, "zone": ZONE, **kwargs}
    with pytest.raises(ProvisionError, match=re.escape(culprit)):
        plan.settings(
            arguments.pop("project"),
            arguments.pop("zone"),
            arguments.pop("cluster", "kinetic-cluster"),
            arguments.pop("accelerator_names", ()),
            **arguments,
        )


def test_the_clusters_table_of_coming_from_kinetic_names_real_commands_and_flags():
    """docs/coming-from-kinetic.md's Clusters table: every `uv run kinetic-prefect ...` there is a command with those
    flags."""
    from pathlib import Path

    import typer

    from kinetic_prefect.cli import app

    doc = (Path(__file__).resolve().parents[2] / "docs" / "coming-from-kinetic.md").read_text()
    section = doc.split("## Clusters", 1)[1].split("\n## ", 1)[0]
    root = typer.main.get_command(app)
    spans = [m.removeprefix("uv run ") for m in re.findall(r"`((?:uv run )?kinetic-prefect [^`]+)`", section)] + [
        f"kinetic-prefect up {flag}" for flag in re.findall(r"\| `(--[a-z-]+)", section)
    ]
    assert len(spans) >= 8, section
    for span in spans:
        words = span.split()[1:]
        command: Any = root
        while words and hasattr(command, "commands") and words[0] in command.commands:
            command = command.commands[words.pop(0)]
        assert not hasattr(command, "commands"), f"{span!r}: not a command"
        flags = {opt for param in command.params for opt in param.opts}
        for flag in (w for w in words if w.startswith("--")):
            assert flag in flags, f"{span!r}: {command.name} has no {flag}"
