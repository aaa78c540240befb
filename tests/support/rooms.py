"""Which room of the package each test module covers: the folder it lives in, and a ``room_<name>`` marker on its
tests.

A test module lives in ``tests/<folder>/`` of its room (``FOLDERS``), helpers in ``tests/support/``.
``uv run pytest tests/pod`` or ``-m room_pod`` runs the pod side's tests, ``-m "room_pod and no_server"`` its
pure-logic ones. ``tests/house/test_rooms.py`` fails on a test module not listed here or in another room's folder,
so a new module says its room when it lands. The rooms are the sides of docs/ARCHITECTURE.md, plus: ``gke`` (the
kinetic-gke worker, a part of the worker side with a cluster of its own), ``end-to-end`` (a call through every side:
caller, worker, job), ``flows`` (the pipelines) and ``house`` (checks over the whole repository: imports, contract
literals, function length, docs, packaging).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOM_NAMES = {
    "contract": "contract/: store keys, names, settings, the pools' typed variables",
    "leaves": "storage, signing, errors, accelerators, config",
    "pod": "pod/: what runs in a job (the runner, Data, outputs, progress)",
    "shared": "shared/: runs, outages, sweeps, capacity, cost, images",
    "caller": "caller/: the decorator, a call prepared, submitted, waited for and collected, the payload",
    "kinetic": "kinetic/: the Kinetic-compatible API",
    "worker": "workers/: the lifecycle and kinetic-local",
    "gke": "workers/gke/: kinetic-gke, against a real control plane or its manifests",
    "vertex": "workers/vertex/: kinetic-vertex, its requests and a Vertex AI stand-in running jobs in Docker",
    "provision": "workers/gke/provision/: kinetic-prefect up / down / pool (GKE's provisioning)",
    "cli": "cli/: the kinetic-prefect command",
    "end-to-end": "a call through every side, as a user makes it",
    "flows": "flows/: the pipelines",
    "house": "the repository's own rules: imports, contract literals, function length, docs, packaging",
}

ROOMS = {
    "test_accelerators.py": "leaves",
    "test_api_outages.py": "end-to-end",
    "test_archive_exclusions.py": "caller",
    "test_api_retries.py": "end-to-end",
    "test_async_tasks.py": "caller",
    "test_builders.py": "shared",
    "test_cache_isolation.py": "caller",
    "test_cancelled_calls.py": "end-to-end",
    "test_capacity.py": "shared",
    "test_capacity_local.py": "worker",
    "test_checkpoint_signing.py": "end-to-end",
    "test_cli.py": "cli",
    "test_contract.py": "contract",
    "test_core_install.py": "house",
    "test_cost.py": "worker",
    "test_cost_estimate.py": "cli",
    "test_cleanup_blocks.py": "cli",
    "test_data.py": "pod",
    "test_debug.py": "caller",
    "test_deployments.py": "end-to-end",
    "test_docs.py": "house",
    "test_env_capture.py": "caller",
    "test_eurosat.py": "flows",
    "test_fallback_checks.py": "caller",
    "test_fanout.py": "caller",
    "test_first_run.py": "end-to-end",
    "test_function_length.py": "house",
    "test_fuse_data.py": "pod",
    "test_gcp_blocks.py": "shared",
    "test_gcs.py": "end-to-end",
    "test_gemma.py": "flows",
    "test_vertex_eurosat.py": "vertex",
    "test_vertex_fallback.py": "vertex",
    "test_vertex_provision.py": "vertex",
    "test_vertex_requests.py": "vertex",
    "test_vertex_stand_in.py": "vertex",
    "test_vertex_stopping.py": "vertex",
    "test_gke_autoscaling.py": "gke",
    "test_gke_capacity.py": "gke",
    "test_gke_cold_start.py": "gke",
    "test_gke_follower.py": "gke",
    "test_gke_cluster.py": "gke",
    "test_gke_kueue.py": "gke",
    "test_gke_manifests.py": "gke",
    "test_gke_security.py": "gke",
    "test_gke_settings.py": "gke",
    "test_gke_stopping.py": "gke",
    "test_groups_local.py": "worker",
    "test_imports.py": "house",
    "test_job_variables.py": "contract",
    "test_kinetic_api.py": "kinetic",
    "test_launcher_abilities.py": "caller",
    "test_launcher_abilities_worker.py": "worker",
    "test_launcher_commands.py": "cli",
    "test_leftovers.py": "end-to-end",
    "test_lifecycle.py": "worker",
    "test_local_isolation.py": "worker",
    "test_log_resume.py": "worker",
    "test_logs.py": "worker",
    "test_option_types.py": "caller",
    "test_packaging.py": "caller",
    "test_payload_concurrency.py": "caller",
    "test_payload_secrets.py": "caller",
    "test_payload_sharing.py": "caller",
    "test_payload_size_warning.py": "caller",
    "test_pool_form.py": "worker",
    "test_provision.py": "provision",
    "test_provision_plan.py": "provision",
    "test_requirements_files.py": "shared",
    "test_result_signing.py": "caller",
    "test_return_values.py": "caller",
    "test_rooms.py": "house",
    "test_worker_type_names.py": "house",
    "test_settings.py": "contract",
    "test_signing.py": "leaves",
    "test_trust_handovers.py": "pod",
    "test_trust_store.py": "caller",
    "test_trust_debugger.py": "kinetic",
    "test_trust_local_store.py": "leaves",
    "test_trust_pool_variables.py": "worker",
    "test_trust_deployments.py": "worker",
    "test_trust_env_block.py": "worker",
    "test_trust_warm_runner.py": "worker",
    "test_key_rotation.py": "worker",
    "test_signing_scopes.py": "leaves",
    "test_slots.py": "caller",
    "test_spine.py": "end-to-end",
    "test_storage.py": "leaves",
    "test_sweep_interrupts.py": "shared",
    "test_sweep_endings.py": "caller",
    "test_sweep_scale.py": "shared",
    "test_sweeps.py": "shared",
    "test_timeout.py": "end-to-end",
    "test_ui.py": "end-to-end",
    "test_ui_cost.py": "end-to-end",
    "test_unhappy_store.py": "end-to-end",
    "test_ui_truth.py": "end-to-end",
    "test_warm_pods.py": "gke",
    "test_weight.py": "house",
    "test_warm_runners.py": "worker",
    "test_working_copy.py": "pod",
    "test_worker.py": "worker",
    "test_worker_image.py": "gke",
}


# A room's folder under tests/: its name, where that would shadow an importable name (flows/, kinetic) or is no
# identifier.
FOLDERS = {
    room: {"end-to-end": "end_to_end", "flows": "pipelines", "kinetic": "kinetic_api"}.get(room, room)
    for room in ROOM_NAMES
}


def marker_name(room: str) -> str:
    return "room_" + room.replace("-", "_")


def pytest_configure(config: pytest.Config) -> None:
    for room, what in ROOM_NAMES.items():
        config.addinivalue_line("markers", f"{marker_name(room)}: tests of {what} (tests/support/rooms.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        room = ROOMS.get(Path(str(item.fspath)).name)
        if room is not None:
            item.add_marker(marker_name(room))
