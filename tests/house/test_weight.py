"""What a command or a call imports is what it uses: a launcher's cloud clients (aiplatform, prefect-gcp, the
Kubernetes clients, google-cloud-build and -storage) load only when a pool of that type is used, and the commands
that need no server import no Prefect at all. Counted in modules, not seconds, so no launcher can bring the weight
back unseen: a call on kinetic-local used to load kinetic-vertex's prefect-gcp and both of aiplatform's API
versions (a 29-s gap in the UI before the first kinetic call; ``kinetic-prefect --help`` took 17 s).

Each case is a fresh interpreter (a module list is only true of a fresh one); the call case runs one job on the
session's server, a few seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Top-level packages and package modules that belong to one cloud launcher.
CLOUD = (
    "google.cloud.aiplatform",
    "google.cloud.aiplatform_v1",
    "google.cloud.aiplatform_v1beta1",
    "google.cloud.storage",
    "google.cloud.devtools",
    "google.cloud.logging",
    "google.auth",
    "googleapiclient",
    "prefect_gcp",
    "prefect_kubernetes",
    "kubernetes",
    "kubernetes_asyncio",
    "kinetic_prefect.workers.gke.worker",
    "kinetic_prefect.workers.gke.launcher",
    "kinetic_prefect.workers.vertex.worker",
    "kinetic_prefect.workers.vertex.configuration",
)

DUMP = textwrap.dedent("""
    import atexit, json, os, sys
    atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
""")


def _modules(tmp_path, body: str, *args: str) -> set[str]:
    out = tmp_path / "modules.json"
    script = tmp_path / "script.py"
    script.write_text(DUMP + textwrap.dedent(body))
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MODULES_OUT": str(out), "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return set(json.loads(out.read_text()))


def _loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


CLI = """
    import sys
    from kinetic_prefect.cli import main
    status = main(sys.argv[1:])
    assert status == 0, status
"""


@pytest.mark.no_server
@pytest.mark.parametrize(
    "args",
    [["--help"], ["cost", "--estimate", "tpu-v6e-8", "--minutes", "30"], ["accelerators"], ["up", "--help"]],
    ids=" ".join,
)
def test_commands_that_need_no_server_import_no_prefect_and_no_cloud_client(tmp_path, args):
    modules = _modules(tmp_path, CLI, *args)
    assert _loaded(modules, CLOUD) == []
    assert _loaded(modules, ("prefect",)) == [], "these commands need no Prefect"


@pytest.mark.no_server
def test_registering_the_worker_types_imports_no_launcher():
    """``import kinetic_prefect.workers`` (the registry every side reads) imports no worker class."""
    code = "import sys, kinetic_prefect.workers; print([m for m in sys.modules if m.startswith('prefect')])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_a_call_on_kinetic_local_imports_no_cloud_client(tmp_path):
    modules = _modules(
        tmp_path,
        """
        from prefect import flow
        from kinetic_prefect import kinetic_task

        @kinetic_task(accelerator="cpu", ship_project=False)
        def step(x):
            return None

        @flow
        def pipeline():
            return step(1), step.submit(2).result(), [f.result() for f in step.map([3, 4])]

        assert pipeline() == (None, None, [None, None])
        """,
    )
    assert "kinetic_prefect.workers.local.worker" in modules, "the call ran through kinetic-local's worker class"
    assert _loaded(modules, CLOUD) == []


def test_the_collection_entry_point_registers_every_installed_launcher():
    """Prefect's own lookups (``prefect worker start --type``, ``get_worker_class_from_type``) still find every
    kinetic type: the ``prefect.collections`` entry point imports the installed ones."""
    code = textwrap.dedent("""
        from prefect.workers.base import BaseWorker
        from kinetic_prefect import workers
        for worker_type in workers.LAUNCHERS:
            cls = BaseWorker.get_worker_class_from_type(worker_type)
            assert cls is not None and cls is workers.find(worker_type), worker_type
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
