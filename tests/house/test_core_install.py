"""The core install (no k8s/gcp extras; the README's first command installs only `ml`) must work: a caller
imports the worker types, runs on kinetic-local, and is told what to install for kinetic-gke."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_EXTRAS = textwrap.dedent("""
    import importlib.abc, sys

    class NoExtras(importlib.abc.MetaPathFinder):
        # as if prefect-kubernetes and the kubernetes client were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("prefect_kubernetes", "kubernetes", "kubernetes_asyncio"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoExtras())
""")


def test_without_the_k8s_extra_local_works_and_gke_names_the_install():
    script = BLOCK_EXTRAS + textwrap.dedent("""
        from prefect.workers.base import BaseWorker
        import kinetic_prefect.workers as workers
        from kinetic_prefect.caller import _prefect

        assert BaseWorker.get_worker_class_from_type("kinetic-local") is workers.KineticLocalWorker
        assert _prefect.worker_class_for("kinetic-local") is workers.KineticLocalWorker
        try:
            _prefect.worker_class_for("kinetic-gke")
        except _prefect.WorkPoolError as exc:
            print("REFUSED", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED work pool type 'kinetic-gke' needs the k8s and gcp extras" in proc.stdout
    assert "uv sync --inexact --extra gcp --extra k8s" in proc.stdout
