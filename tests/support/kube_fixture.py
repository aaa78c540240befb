"""pytest plugin: the real Kubernetes control plane (``kube_cluster``) with fake GKE accelerator nodes whose pods run
in Docker (``docker_kubelet``).  One per test session: start-up takes ≈ 5 s once the binaries are cached.

Without the binaries the tests skip on a workstation (``bash tests/support/kube/build.sh`` builds them, ≈ 20 min once)
and
fail under CI, where ``.ci/run`` builds them first."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from docker_kubelet import DockerKubelet
from kube_cluster import GKE_NODE_POOLS, ControlPlane, binaries_dir


@dataclass
class Cluster:
    plane: ControlPlane
    kubelet: DockerKubelet

    def api(self, token: str | None = None, server: str | None = None):
        return self.plane.api(token, server)


@pytest.fixture(scope="session")
def kube(tmp_path_factory, docker_engine):
    bin_dir = binaries_dir(build=False)
    if bin_dir is None:
        message = "the Kubernetes control plane is not built: run `bash tests/support/kube/build.sh` (≈ 20 min once)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: .ci/run builds it)", pytrace=False)
        pytest.skip(message)
    plane = ControlPlane(tmp_path_factory.mktemp("kube"), bin_dir).start()
    kubelet = DockerKubelet(plane, docker_engine.cli, set(GKE_NODE_POOLS))
    try:
        for name, (labels, capacity, taints) in GKE_NODE_POOLS.items():
            plane.add_node(name, labels, capacity, taints, kubelet_port=kubelet.port)
        yield Cluster(plane, kubelet)
    finally:
        kubelet.stop()
        plane.stop()
