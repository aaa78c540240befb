"""Test-only: real Kueue (``sigs.k8s.io/kueue``) on the control plane of the tests (tests/support/kube_cluster.py).

``tests/support/kube/build_kueue.sh`` builds the manager from the Go module proxy and caches it with the manifests of
the same
module source (CRDs, their conversion patches, the webhook configurations).  The manager runs here as Kueue's own
Deployment runs it, minus the cluster: its binary in a container (host network, so it reaches the API server on
127.0.0.1 and the API server reaches its webhooks there), with ``internalCertManagement`` off and a certificate of
ours.  A container and not a plain process because the manager reads its metrics certificate from the fixed path
``/etc/kueue/metrics/certs`` when it manages no certificates itself (cmd/kueue/main.go): the container's mount puts
ours there without touching the machine's /etc.

The webhook configurations and the CRDs' conversion webhooks name Kueue's in-cluster Service; they are rewritten to
``url: https://127.0.0.1:<port>/<path>`` with our CA.  Only Kueue's own webhooks and the ``batch/job`` integration's are
installed, and the Job webhooks only see Jobs that carry a queue name (an ``objectSelector``): the session's other
tests share the control plane and never meet Kueue.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kube_cluster import HERE, ControlPlane, free_port, openssl

VERSION = os.environ.get("KINETIC_KUEUE_VERSION", "v0.17.0")
GROUP, API = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WEBHOOK_PREFIX = "kinetic-kueue-"
START_TIMEOUT = 90.0


def kueue_dir(build: bool) -> Path | None:
    """The cached manager and manifests; with ``build`` they are built first when missing."""
    cache = Path(os.environ.get("KINETIC_KUEUE_CACHE", Path.home() / ".cache/kinetic-prefect/kueue")) / VERSION
    if (cache / "kueue").exists() and (cache / "webhooks.yaml").exists():
        return cache
    if not build:
        return None
    subprocess.run(["bash", str(HERE / "kube/build_kueue.sh")], check=True)
    return cache


def _serving_certificate(pki: Path) -> None:
    """A CA and a serving certificate for 127.0.0.1: the webhook server's, and the metrics server's."""
    pki.mkdir(parents=True, exist_ok=True)
    subject = ["-nodes", "-days", "3", "-newkey", "rsa:2048"]
    openssl("req", "-x509", *subject, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kueue-test-ca", cwd=pki)
    openssl("req", *subject, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=kueue-webhook", cwd=pki)
    (pki / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "3",
        "-extfile", "san.ext", "-out", "tls.crt", cwd=pki,
    )  # fmt: skip
    for name in ("tls.key", "tls.crt"):
        (pki / name).chmod(0o644)  # read by the container's user


@dataclass
class Kueue:
    """The Kueue manager on a control plane: ``start()`` installs and starts it, ``stop()`` takes it away."""

    plane: ControlPlane
    workdir: Path
    manifests: Path
    image: str
    docker: str
    webhook_port: int = 0
    container: str = field(default_factory=lambda: f"kinetic-kueue-{uuid.uuid4().hex[:10]}")
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "kueue.log"

    @property
    def ca_bundle(self) -> str:
        return base64.b64encode((self.workdir / "pki/ca.crt").read_bytes()).decode()

    def _url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.webhook_port}{path}"

    def start(self) -> Kueue:
        """CRDs first (the manager's informers need them), then the manager, then its webhooks once it serves them."""
        _serving_certificate(self.workdir / "pki")
        self.webhook_port, health_port = free_port(), free_port()
        self._install_crds()
        config = {
            "apiVersion": f"config.{GROUP}/{API}",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": "/kueue/pki"},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"]},
        }
        (self.workdir / "config.yaml").write_text(json.dumps(config))
        self.plane.write_kubeconfig(self.workdir / "kubeconfig", self.plane.admin_token)
        argv = [
            self.docker, "run", "--rm", "--name", self.container, "--network", "host",
            "--label", f"kinetic-test-kueue={self.container}",
            "-v", f"{self.workdir}:/kueue:ro", "-v", f"{self.manifests}:/opt/kueue:ro",
            "-v", f"{self.workdir / 'pki'}:/etc/kueue/metrics/certs:ro",
            "-e", "KUBECONFIG=/kueue/kubeconfig", "--entrypoint", "/opt/kueue/kueue", self.image,
            "--config=/kueue/config.yaml", "--feature-gates=VisibilityOnDemand=false",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(f"http://127.0.0.1:{health_port}/readyz")
        self._install_webhooks()
        return self

    def _wait_ready(self, url: str) -> None:
        deadline = time.time() + START_TIMEOUT
        while True:
            with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"the Kueue manager exited with {self.proc.returncode}; see {self.log}:\n{self.tail()}"
                )
            if time.time() > deadline:
                raise RuntimeError(
                    f"the Kueue manager not ready after {START_TIMEOUT:.0f} s; see {self.log}:\n{self.tail()}"
                )
            time.sleep(0.3)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def _install_crds(self) -> None:
        from kubernetes import client

        extensions = client.ApiextensionsV1Api(self.plane.api())
        conversions = {
            patch["metadata"]["name"]: patch["spec"]["conversion"]
            for patch in yaml.safe_load_all((self.manifests / "crd-conversion.yaml").read_text())
            if patch
        }
        names = []
        for path in sorted((self.manifests / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            conversion = conversions.get(crd["metadata"]["name"])
            if conversion is not None:
                webhook = conversion["webhook"]
                path_ = webhook["clientConfig"]["service"].get("path", "/convert")
                webhook["clientConfig"] = {"url": self._url(path_), "caBundle": self.ca_bundle}
                crd["spec"]["conversion"] = conversion
            with contextlib.suppress(client.exceptions.ApiException):  # left by an earlier module of the session
                extensions.delete_custom_resource_definition(crd["metadata"]["name"])
                self._wait(lambda n=crd["metadata"]["name"]: not _exists(extensions.read_custom_resource_definition, n))
            extensions.create_custom_resource_definition(crd)
            names.append(crd["metadata"]["name"])
        for name in names:
            self._wait(lambda n=name: _established(extensions.read_custom_resource_definition(n)))

    def _install_webhooks(self) -> None:
        """Kueue's webhooks for its own kinds and for batch/v1 Jobs, called at 127.0.0.1 with our CA."""
        from kubernetes import client

        registration = client.AdmissionregistrationV1Api(self.plane.api())
        for configuration in yaml.safe_load_all((self.manifests / "webhooks.yaml").read_text()):
            if not configuration:
                continue
            kept = []
            for webhook in configuration["webhooks"]:
                path = webhook["clientConfig"]["service"]["path"]
                if "kueue-x-k8s-io" not in path and "batch-v1-job" not in path:
                    continue
                webhook["clientConfig"] = {"url": self._url(path), "caBundle": self.ca_bundle}
                if "batch-v1-job" in path:
                    webhook["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
                kept.append(webhook)
            configuration["webhooks"] = kept
            configuration["metadata"] = {"name": WEBHOOK_PREFIX + configuration["metadata"]["name"]}
            if configuration["kind"] == "MutatingWebhookConfiguration":
                registration.create_mutating_webhook_configuration(configuration)
            else:
                registration.create_validating_webhook_configuration(configuration)

    def _wait(self, predicate, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not predicate():
            if time.time() > deadline:
                raise RuntimeError(f"timed out installing Kueue; see {self.log}:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Its webhooks first (a stopped webhook server with failurePolicy Fail would refuse every later write of
        Kueue's kinds), then the container."""
        from kubernetes import client

        registration = client.AdmissionregistrationV1Api(self.plane.api())
        for configuration in registration.list_mutating_webhook_configuration().items:
            if configuration.metadata.name.startswith(WEBHOOK_PREFIX):
                registration.delete_mutating_webhook_configuration(configuration.metadata.name)
        for configuration in registration.list_validating_webhook_configuration().items:
            if configuration.metadata.name.startswith(WEBHOOK_PREFIX):
                registration.delete_validating_webhook_configuration(configuration.metadata.name)
        subprocess.run([self.docker, "rm", "-f", self.container], capture_output=True, timeout=60)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)


# A ResourceFlavor per accelerator, with the node labels GKE puts on its nodes (Kueue puts them in the admitted
# pods' nodeSelector, and picks the flavor whose labels the pod's own selector agrees with).
FLAVORS = {
    "nvidia-l4": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
    "tpu-v5-lite-podslice": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"},
}
ACCELERATOR_RESOURCES = {"nvidia-l4": "nvidia.com/gpu", "tpu-v5-lite-podslice": "google.com/tpu"}
COVERED = ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu", "google.com/tpu")


def cluster_queue(name: str, chips: dict[str, int]) -> dict:
    """A ClusterQueue with ``chips[flavor]`` accelerators of each flavor (none where not given), and room enough of
    everything else a kinetic Job asks for."""
    room = {"cpu": "64", "memory": "256Gi", "ephemeral-storage": "1Ti"}
    flavors = [
        {
            "name": flavor,
            "resources": [
                {
                    "name": resource,
                    "nominalQuota": room.get(resource)
                    or str(chips.get(flavor, 0) if resource == ACCELERATOR_RESOURCES[flavor] else 0),
                }
                for resource in COVERED
            ],
        }
        for flavor in FLAVORS
    ]
    return {
        "apiVersion": f"{GROUP}/{API}",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": list(COVERED), "flavors": flavors}]},
    }


def set_up_queues(api, cluster: str, local: str, namespace: str, chips: dict[str, int]) -> None:
    """The ResourceFlavors, a ClusterQueue ``cluster`` and the LocalQueue ``local`` in ``namespace`` that points at it;
    returns once Kueue says the ClusterQueue is active (which only the running manager can say)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    for flavor, labels in FLAVORS.items():
        body = {
            "apiVersion": f"{GROUP}/{API}",
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor},
            "spec": {"nodeLabels": labels},
        }
        custom.create_cluster_custom_object(GROUP, API, "resourceflavors", body)
    custom.create_cluster_custom_object(GROUP, API, "clusterqueues", cluster_queue(cluster, chips))
    body = {
        "apiVersion": f"{GROUP}/{API}",
        "kind": "LocalQueue",
        "metadata": {"name": local, "namespace": namespace},
        "spec": {"clusterQueue": cluster},
    }
    custom.create_namespaced_custom_object(GROUP, API, namespace, "localqueues", body)
    deadline = time.time() + 30
    while not _condition(custom.get_cluster_custom_object(GROUP, API, "clusterqueues", cluster), "Active"):
        if time.time() > deadline:
            raise RuntimeError(f"Kueue never made ClusterQueue {cluster} active")
        time.sleep(0.3)


def _condition(obj: dict, kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or []
    )


def _exists(read, name: str) -> bool:
    from kubernetes import client

    try:
        read(name)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _established(crd) -> bool:
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))
