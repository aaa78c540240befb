"""Test-only Kubernetes: kmock's API emulator over HTTP, plus a small controller that does what
the Job controller and the kubelet would do — each Job gets a Pod, and the Pod's container runs
in the local Docker engine with exactly the manifest's image, command, args and env (host
network, so it reaches fake-gcs-server on 127.0.0.1).

kmock has no controllers, ignores label selectors and serves pod logs only as explicit
reactions; the controller fills those gaps. Scheduling failures are simulated on request
(``unschedulable`` accelerators), the way GKE reports them (condition + FailedScheduling event).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import threading
import time
import uuid
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
        self.kubeconfig_path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        }))

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
        self._state["emulator"][f"get /api/v1/namespaces/{namespace}/pods/{pod}/log"] << text.encode()  # raw bytes: kmock would JSON-encode a str for this client

    def api(self) -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class DockerPodController:
    def __init__(self, emulator: KubeEmulator, docker: str = "docker", namespace: str = "default"):
        self.emulator, self.docker, self.namespace = emulator, docker, namespace
        api = emulator.api()
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)
        self.unschedulable: set[str] = set()  # gke-accelerator label values with no node pool
        self.pods: dict[str, dict] = {}       # job name -> {"pod": name, "container": id or None, "done": bool}
        self.started_containers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-controller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except Exception as exc:  # keep reconciling; tests assert on outcomes
                print(f"controller: {exc!r}")
            self._stop.wait(0.3)

    def _reconcile(self) -> None:
        jobs = {j.metadata.name: j for j in self.batch.list_namespaced_job(self.namespace).items}
        for name, job in jobs.items():
            if name not in self.pods:
                self._create_pod(job)
        for name, entry in list(self.pods.items()):
            if name not in jobs and not entry["done"]:
                self._remove(entry)  # the Job was deleted: kill the container, delete the pod
                entry["done"] = True
            elif entry["container"] and not entry["done"]:
                self._check_container(name, entry)

    def _create_pod(self, job) -> None:
        pod_name = f"{job.metadata.name}-{uuid.uuid4().hex[:5]}"
        template = self.batch.api_client.sanitize_for_serialization(job.spec.template)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": self.namespace,
                            "labels": {**(template.get("metadata", {}).get("labels") or {}),
                                       "job-name": job.metadata.name}},
               "spec": template["spec"]}
        self.core.create_namespaced_pod(self.namespace, pod)
        entry = {"pod": pod_name, "container": None, "done": False}
        self.pods[job.metadata.name] = entry
        selector = template["spec"].get("nodeSelector") or {}
        if selector.get("cloud.google.com/gke-accelerator") in self.unschedulable:
            message = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."
            self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}})
            self.core.create_namespaced_event(self.namespace, {
                "apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{pod_name}.fs", "namespace": self.namespace},
                "involvedObject": {"kind": "Pod", "name": pod_name, "namespace": self.namespace},
                "reason": "FailedScheduling", "message": message, "type": "Warning"})
            return
        container = template["spec"]["containers"][0]
        argv = [self.docker, "run", "-d", "--network", "host", "--name", f"kp-{pod_name}"]
        for env in container.get("env") or []:
            argv += ["-e", f"{env['name']}={env.get('value', '')}"]
        for source in container.get("envFrom") or []:  # what the kubelet does with a Secret reference
            secret = self.core.read_namespaced_secret(source["secretRef"]["name"], self.namespace)
            values = secret.string_data or {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            argv += [arg for key, value in values.items() for arg in ("-e", f"{key}={value}")]
        if container.get("command"):
            argv += ["--entrypoint", container["command"][0]]
        argv += [container["image"], *container.get("command", [])[1:], *container.get("args", [])]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
                "phase": "Pending", "containerStatuses": [{"name": container["name"], "image": container["image"],
                "imageID": "", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull", "message": proc.stderr.strip()[-300:]}}}]}})
            return
        entry["container"] = proc.stdout.strip()
        self.started_containers.append(entry["container"])
        self.core.patch_namespaced_pod_status(pod_name, self.namespace, {"status": {
            "phase": "Running", "containerStatuses": [{"name": container["name"], "image": container["image"],
            "imageID": "", "ready": True, "restartCount": 0, "state": {"running": {}}}]}})
        self.core.patch_namespaced_pod(pod_name, self.namespace, {"spec": {"nodeName": "gke-l4-pool-node-1"}})

    def _check_container(self, job_name: str, entry: dict) -> None:
        inspect = subprocess.run([self.docker, "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}",
                                  entry["container"]], capture_output=True, text=True)
        running, _, code = inspect.stdout.strip().partition(" ")
        if running != "false":
            return
        logs = subprocess.run([self.docker, "logs", entry["container"]], capture_output=True, text=True)
        self.emulator.set_log(self.namespace, entry["pod"], logs.stdout + logs.stderr)
        exit_code = int(code or 1)
        self.core.patch_namespaced_pod_status(entry["pod"], self.namespace, {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{"name": "kinetic-job", "image": "x", "imageID": "", "ready": False,
                                   "restartCount": 0, "state": {"terminated": {
                                       "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}}}]}})
        self.batch.patch_namespaced_job_status(job_name, self.namespace, {"status": {
            "succeeded" if exit_code == 0 else "failed": 1}})
        subprocess.run([self.docker, "rm", "-f", entry["container"]], capture_output=True)
        entry["done"] = True

    def _remove(self, entry: dict) -> None:
        if entry["container"]:
            subprocess.run([self.docker, "rm", "-f", entry["container"]], capture_output=True)
        try:
            self.core.delete_namespaced_pod(entry["pod"], self.namespace)
        except client.exceptions.ApiException:
            pass

    def running_containers(self) -> list[str]:
        out = subprocess.run([self.docker, "ps", "-q", "--no-trunc"], capture_output=True, text=True).stdout.split()
        return [c for c in self.started_containers if c in out]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for entry in self.pods.values():
            if entry["container"] and not entry["done"]:
                subprocess.run([self.docker, "rm", "-f", entry["container"]], capture_output=True)
