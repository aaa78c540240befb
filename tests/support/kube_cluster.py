"""Test-only: a real Kubernetes control plane on 127.0.0.1 with fake GKE accelerator nodes.

etcd (Debian's ``etcd-server``), kube-apiserver, kube-controller-manager and kube-scheduler, built from the Go module
``k8s.io/kubernetes`` by ``tests/support/kube/build.sh`` and cached under ``~/.cache/kinetic-prefect/kube/<version>``.
What is real: the API server's validation, admission, RBAC and service-account tokens; the scheduler's placement
decisions (node selectors, taints, extended resources such as ``nvidia.com/gpu``); the Job, TTL-after-finished and
garbage-collection controllers.  What is not: nodes have no kubelet — ``docker_kubelet.DockerKubelet`` plays it
for pods bound to the fake nodes (containers in the local Docker engine, pod status, and the kubelet's log endpoint,
which the API server proxies ``pods/log`` to).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binaries_dir(build: bool) -> Path | None:
    """The cached binaries; with ``build`` they are built first when missing (≈ 20 min once per machine)."""
    version = os.environ.get("KINETIC_KUBE_VERSION", "v1.36.3")
    cache = Path(os.environ.get("KINETIC_KUBE_CACHE", Path.home() / ".cache/kinetic-prefect/kube")) / version
    names = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
    if all((cache / n).exists() for n in names):
        return cache
    if not build:
        return None
    subprocess.run(["bash", str(HERE / "kube/build.sh")], check=True)
    return cache


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(pki: Path) -> None:
    """A CA, the API server's serving cert (127.0.0.1 and the in-cluster names), the service-account key pair,
    and a serving cert for the stand-in kubelet."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3",
        "-subj",
        "/CN=kinetic-test-ca",
        cwd=pki,
    )
    for name, sans in (
        (
            "apiserver",
            "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc",
        ),
        ("kubelet", "IP:127.0.0.1,DNS:localhost"),
    ):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=pki,
        )
        (pki / f"{name}.ext").write_text(f"subjectAltName={sans}\n")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "3",
            "-extfile",
            f"{name}.ext",
            cwd=pki,
        )
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig(server: str, ca_file: Path, token: str, context: str = "kinetic-test") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": context,
        "clusters": [
            {
                "name": context,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": context, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
    }


@dataclass
class ControlPlane:
    workdir: Path
    bin_dir: Path
    admin_token: str = "kinetic-admin-token"
    procs: list[subprocess.Popen] = field(default_factory=list)
    port: int = 0

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki/ca.crt"

    def _start(self, name: str, argv: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:  # the child writes through its own copy of the descriptor
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> ControlPlane:
        pki = self.workdir / "pki"
        make_certificates(pki)
        etcd_port, peer_port, self.port = free_port(), free_port(), free_port()
        self._start(
            "etcd",
            [
                ETCD,
                "--data-dir",
                str(self.workdir / "etcd"),
                "--name",
                "kinetic-test",
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"kinetic-test=http://127.0.0.1:{peer_port}",
            ],
        )
        (self.workdir / "tokens.csv").write_text(f"{self.admin_token},admin,1,system:masters\n")
        self._start(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                "--profiling=false",
            ],
        )
        self.write_kubeconfig(self.workdir / "admin.kubeconfig", self.admin_token)
        self.wait_ready(60)
        common = [
            f"--kubeconfig={self.workdir / 'admin.kubeconfig'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
        ]
        self._start(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                *common,
                f"--secure-port={free_port()}",
                # node lifecycle would mark kubelet-less nodes NotReady after ~40 s; nodeipam needs a pod CIDR
                "--controllers=*,-nodeipam,-nodelifecycle",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
            ],
        )
        self._start("kube-scheduler", [str(self.bin_dir / "kube-scheduler"), *common, f"--secure-port={free_port()}"])
        self.wait_for_default_service_account(90)
        return self

    def write_kubeconfig(self, path: Path, token: str, server: str | None = None) -> Path:
        path.write_text(json.dumps(kubeconfig(server or self.server, self.ca_file, token)))
        return path

    def kubeconfig_dict(self, token: str | None = None, server: str | None = None) -> dict:
        return kubeconfig(server or self.server, self.ca_file, token or self.admin_token)

    def _get(self, path: str):
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        with urllib.request.urlopen(request, context=context, timeout=5) as response:
            return response.read()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                if self._get("/readyz") == b"ok":
                    return
            except Exception:
                pass
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError(f"kube-apiserver not ready after {timeout}s:\n{self.tail('kube-apiserver')}")
            time.sleep(0.3)

    def wait_for_default_service_account(self, timeout: float) -> None:
        """Pods need the namespace's ``default`` ServiceAccount, which the controller-manager creates."""
        deadline = time.time() + timeout
        while True:
            try:
                self._get("/api/v1/namespaces/default/serviceaccounts/default")
                return
            except Exception:
                pass
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError(
                    f"no default ServiceAccount after {timeout}s:\n{self.tail('kube-controller-manager')}"
                )
            time.sleep(0.3)

    def check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{proc.args[0]} exited with {proc.returncode}:\n{self.tail(Path(proc.args[0]).name)}"
                )

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def api(self, token: str | None = None, server: str | None = None):
        from kubernetes import config

        return config.new_client_from_config_dict(self.kubeconfig_dict(token, server), context="kinetic-test")

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A bound token for a ServiceAccount (TokenRequest), as a pod running under it would get."""
        from kubernetes import client

        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": seconds},
        }
        response = client.CoreV1Api(self.api()).create_namespaced_service_account_token(name, namespace, request)
        return response.status.token

    def add_node(
        self,
        name: str,
        labels: dict[str, str],
        capacity: dict[str, str],
        taints: list[dict] | None = None,
        kubelet_port: int = 10250,
    ) -> None:
        """A Ready node labelled like a GKE node pool; the real scheduler then binds matching pods to it."""
        from kubernetes import client

        core = client.CoreV1Api(self.api())
        resources = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi", **capacity}
        core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
                "spec": {"taints": taints or []},
            }
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "docker kubelet",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ],
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": name},
                    ],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": "v1.36.3",
                        "containerRuntimeVersion": "docker://test",
                        "kernelVersion": "",
                        "osImage": "",
                        "kubeProxyVersion": "",
                        "machineID": name,
                        "systemUUID": name,
                        "bootID": name,
                    },
                }
            },
        )
        # TaintNodesByCondition adds not-ready at creation; with no node-lifecycle controller nothing lifts it.
        node = core.read_node(name)
        kept = [t for t in node.spec.taints or [] if not t.key.startswith("node.kubernetes.io/")]
        core.patch_node(name, {"spec": {"taints": [client.ApiClient().sanitize_for_serialization(t) for t in kept]}})

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


GKE_NODE_POOLS = {
    # name: (labels, capacity, taints) — labels and taints as GKE sets them on accelerator node pools
    "gke-l4-pool-1": (
        {"cloud.google.com/gke-accelerator": "nvidia-l4", "cloud.google.com/gke-nodepool": "l4-pool"},
        {"nvidia.com/gpu": "1"},
        [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    ),
    "gke-tpu-v5e-pool-1": (
        {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "1x1",
            "cloud.google.com/gke-nodepool": "tpu-pool",
        },
        {"google.com/tpu": "1"},
        [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}],
    ),
    # a multi-host slice, tpu-v5p-16: 2 hosts of 4 chips, topology 2x2x2
    **{
        f"gke-tpu-v5p-16-{i}": (
            {
                "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                "cloud.google.com/gke-tpu-topology": "2x2x2",
                "cloud.google.com/gke-nodepool": "v5p-16",
            },
            {"google.com/tpu": "4"},
            [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}],
        )
        for i in range(2)
    },
    "gke-cpu-pool-1": ({"cloud.google.com/gke-nodepool": "default-pool"}, {}, []),
}
