"""Test-only: kmock's Kubernetes API emulator over HTTP, for `kinetic-prefect doctor`'s node checks, which only
read Node objects (tests/cli/test_cli.py).  Everything that runs Jobs is tested against the real control plane
(tests/support/kube_cluster.py, tests/gke/test_gke_cluster.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import kmock
from kubernetes import client


class KubeEmulator:
    def __init__(self, workdir: Path):
        self._state: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while "url" not in self._state:
            if time.time() > deadline:
                raise RuntimeError("kmock did not start")
            time.sleep(0.05)
        self.url = self._state["url"].rstrip("/")
        self.kubeconfig_path = workdir / "kubeconfig.json"
        self.kubeconfig_path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test"}}],
                    "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
                }
            )
        )

    def _serve(self) -> None:
        async def main() -> None:
            emulator = kmock.KubernetesEmulator()
            for resource in ("batch/v1/jobs", "v1/pods", "v1/events", "v1/secrets"):
                emulator.resources[resource] = {}
            async with kmock.Server(emulator):
                self._state.update(emulator=emulator, url=str(emulator.url))
                while not self._stop.is_set():
                    await asyncio.sleep(0.05)

        asyncio.run(main())

    def set_log(self, namespace: str, pod: str, text: str) -> None:
        (
            self._state["emulator"][f"get /api/v1/namespaces/{namespace}/pods/{pod}/log"] << text.encode()
        )  # raw bytes: kmock would JSON-encode a str for this client

    def api(self) -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
