"""Test-only: a kubelet stand-in that runs the pods the real scheduler bound to the fake nodes in Docker.

It does the kubelet's share of a pod's life and nothing more: resolve env from the pod spec and referenced Secrets,
apply the security context (the user and group, fsGroup, dropped capabilities, no privilege escalation, and
runAsNonRoot's check of the image's user), start the container (host network, so jobs reach fake-gcs-server and
Prefect on 127.0.0.1), report status (Running, then Succeeded/Failed with the exit code; ErrImagePull when the image
cannot be pulled; a ``Pulled`` event as a kubelet emits it, though every fake node shares one Docker engine and its
images), stop the container with the pod's grace period when the pod is deleted and then confirm the deletion, and
serve ``/containerLogs/<ns>/<pod>/<container>`` over HTTPS — the endpoint the API server proxies
``pods/log`` to — and ``/portForward/<ns>/<pod>``, the one it proxies ``pods/portforward`` to (WebSocket, see
``_port_forward``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import re
import select
import socket
import ssl
import struct
import subprocess
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

from kube_cluster import ControlPlane, free_port
from kubernetes import client


@dataclass
class PodEntry:
    namespace: str
    name: str
    container: str | None = None  # Docker container id
    finished: bool = False
    stopping: bool = False
    started_at: str | None = None  # the container's startedAt, kept in its terminated state as a kubelet does


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class DockerKubelet:
    def __init__(self, plane: ControlPlane, docker: str, nodes: set[str]):
        self.docker, self.nodes = docker, set(nodes)
        self.core = client.CoreV1Api(plane.api())
        self.pods: dict[str, PodEntry] = {}  # pod uid -> entry
        self.port = free_port()
        # Each kubelet labels its own containers: two test sessions side by side (two runs, or pytest-xdist workers)
        # each run a cluster on the one Docker engine, and neither may count or remove the other's.
        self.label = f"kinetic-test-kubelet={uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._server = self._log_server(plane.workdir / "pki")
        threading.Thread(target=self._server.serve_forever, name="kubelet-logs", daemon=True).start()
        self._thread = threading.Thread(target=self._loop, name="docker-kubelet", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ pods
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # keep going: tests assert on outcomes, and the log says why
                print(f"docker-kubelet: {exc!r}")
            self._stop.wait(0.3)

    def _sync(self) -> None:
        seen = set()
        for pod in self.core.list_pod_for_all_namespaces().items:
            if pod.spec.node_name not in self.nodes:
                continue
            uid = pod.metadata.uid
            seen.add(uid)
            entry = self.pods.get(uid)
            if entry is None:
                entry = self.pods[uid] = PodEntry(pod.metadata.namespace, pod.metadata.name)
                if pod.metadata.deletion_timestamp is None:
                    self._start(pod, entry)
            if pod.metadata.deletion_timestamp is not None and not entry.stopping:
                entry.stopping = True
                grace = pod.metadata.deletion_grace_period_seconds or 0
                threading.Thread(target=self._terminate, args=(entry, grace), daemon=True).start()
            elif entry.container and not entry.finished:
                self._check(pod, entry)
        for uid in set(self.pods) - seen:  # the pod is gone from the API: its container goes too
            entry = self.pods.pop(uid)
            if entry.container:
                subprocess.run([self.docker, "rm", "-f", entry.container], capture_output=True)

    @staticmethod
    def _field(pod, path: str) -> str:
        """The downward API's ``fieldRef`` paths the jobs use."""
        annotation = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
        if annotation:
            return (pod.metadata.annotations or {}).get(annotation.group(1), "")
        return {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "spec.nodeName": pod.spec.node_name or "",
            "status.podIP": "127.0.0.1",
        }.get(path, "")

    def _env(self, pod, container) -> list[str]:
        namespace = pod.metadata.namespace
        values: dict[str, str] = {}
        for source in container.env_from or []:
            if source.secret_ref is not None:
                values.update(self._secret(namespace, source.secret_ref.name))
        for env in container.env or []:
            if env.value_from is not None and env.value_from.secret_key_ref is not None:
                ref = env.value_from.secret_key_ref
                secret = self._secret(namespace, ref.name, optional=bool(ref.optional))
                if ref.key in secret:
                    values[env.name] = secret[ref.key]
            elif env.value_from is not None and env.value_from.field_ref is not None:
                values[env.name] = self._field(pod, env.value_from.field_ref.field_path)
            elif env.value_from is None:
                values[env.name] = env.value or ""
        return [arg for key, value in values.items() for arg in ("-e", f"{key}={value}")]

    def _secret(self, namespace: str, name: str, optional: bool = False) -> dict[str, str]:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except client.exceptions.ApiException:
            if optional:
                return {}
            raise
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    @staticmethod
    def _group_hosts(pod, env: list[str]) -> list[str]:
        """What cluster DNS gives an Indexed Job's pods behind a headless Service (``<job>-<i>.<subdomain>``):
        here every pod shares the host network, so each name is 127.0.0.1."""
        # A pod's /etc/hosts names the pod itself (the real kubelet writes it); on the host network the container's
        # hostname is this machine's, and libraries that resolve their own name (gloo) need it to resolve.
        own = ["--add-host", f"{socket.gethostname()}:127.0.0.1"]
        if not (pod.spec.subdomain and pod.spec.hostname):
            return own
        size = next((int(arg.split("=", 1)[1]) for arg in env if arg.startswith("KINETIC_NUM_HOSTS=")), 1)
        base = pod.spec.hostname.rsplit("-", 1)[0]
        return own + [arg for i in range(size) for arg in ("--add-host", f"{base}-{i}.{pod.spec.subdomain}:127.0.0.1")]

    def _status(
        self, entry: PodEntry, phase: str, state: dict, image: str, container_name: str, ready: bool = False
    ) -> None:
        self.core.patch_namespaced_pod_status(
            entry.name,
            entry.namespace,
            {
                "status": {
                    "phase": phase,
                    "hostIP": "127.0.0.1",
                    "podIP": "127.0.0.1",
                    "startTime": _now(),
                    "conditions": [
                        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": _now()}
                    ],
                    "containerStatuses": [
                        {
                            "name": container_name,
                            "image": image,
                            "imageID": "",
                            "ready": ready,
                            "restartCount": 0,
                            "started": ready,
                            "state": state,
                        }
                    ],
                }
            },
        )

    def _security(self, pod, container) -> list[str] | str:
        """``docker run`` options for the pod's and container's security context, as a kubelet applies them; a
        string (the kubelet's CreateContainerConfigError) when runAsNonRoot cannot hold."""
        pod_context, context = pod.spec.security_context, container.security_context

        def setting(name: str):
            value = getattr(context, name, None) if context is not None else None
            return value if value is not None else getattr(pod_context, name, None)

        user, group, non_root = setting("run_as_user"), setting("run_as_group"), setting("run_as_non_root")
        args: list[str] = []
        if user is not None:
            args += ["--user", f"{user}:{group if group is not None else 0}"]
        if non_root and user is None:  # the image's own user must be a non-zero uid
            proc = subprocess.run(
                [self.docker, "image", "inspect", "-f", "{{.Config.User}}", container.image],
                capture_output=True,
                text=True,
            )
            image_user = proc.stdout.strip().split(":")[0] if proc.returncode == 0 else ""
            if not image_user.isdigit() or int(image_user) == 0:
                return f"container has runAsNonRoot and image will run as root (user {image_user or 'unset'})"
        if non_root and user == 0:
            return "container's runAsUser breaks non-root policy"
        fs_group = getattr(pod_context, "fs_group", None) if pod_context is not None else None
        if fs_group is not None:
            args += ["--group-add", str(fs_group)]
        capabilities = getattr(context, "capabilities", None) if context is not None else None
        if capabilities is not None and "ALL" in (capabilities.drop or []):
            args += ["--cap-drop", "ALL"]
        if context is not None and context.allow_privilege_escalation is False:
            args += ["--security-opt", "no-new-privileges"]
        return args

    def _start(self, pod, entry: PodEntry) -> None:
        container = pod.spec.containers[0]
        try:
            env = self._env(pod, container)
        except client.exceptions.ApiException as exc:
            self._status(
                entry,
                "Pending",
                {"waiting": {"reason": "CreateContainerConfigError", "message": f"secret not found: {exc.reason}"}},
                container.image,
                container.name,
            )
            return
        security = self._security(pod, container)
        if isinstance(security, str):
            self._status(
                entry,
                "Pending",
                {"waiting": {"reason": "CreateContainerConfigError", "message": security}},
                container.image,
                container.name,
            )
            return
        argv = [
            self.docker,
            "run",
            "-d",
            "--network",
            "host",
            "--label",
            self.label,
            "--name",
            f"kp-{pod.metadata.uid[:13]}",
            *security,
            *env,
            *self._group_hosts(pod, env),
        ]
        self._pull(pod, container.image)
        if container.command:
            argv += ["--entrypoint", container.command[0]]
        argv += [container.image, *(container.command or [])[1:], *(container.args or [])]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            self._status(
                entry,
                "Pending",
                {"waiting": {"reason": "ErrImagePull", "message": proc.stderr.strip()[-300:]}},
                container.image,
                container.name,
            )
            return
        entry.container, entry.started_at = proc.stdout.strip(), _now()
        self._status(
            entry, "Running", {"running": {"startedAt": entry.started_at}}, container.image, container.name, ready=True
        )

    def _pull(self, pod, image: str) -> None:
        """Pull the image unless it is on the machine, and say so as a kubelet does: a ``Pulled`` event on the pod
        ("Successfully pulled image ... in 1.2s", or "... already present on machine"). A failed pull is left to
        ``docker run``, whose error becomes the pod's ErrImagePull."""
        present = subprocess.run([self.docker, "image", "inspect", image], capture_output=True).returncode == 0
        if present:
            message = f'Container image "{image}" already present on machine'
        else:
            started = time.monotonic()
            if subprocess.run([self.docker, "pull", "-q", image], capture_output=True).returncode != 0:
                return
            message = f'Successfully pulled image "{image}" in {time.monotonic() - started:.3f}s'
        stamp = _now()
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.create_namespaced_event(
                pod.metadata.namespace,
                {
                    "metadata": {"name": f"{pod.metadata.name}.{uuid.uuid4().hex[:16]}"},
                    "involvedObject": {
                        "kind": "Pod",
                        "namespace": pod.metadata.namespace,
                        "name": pod.metadata.name,
                        "uid": pod.metadata.uid,
                        "apiVersion": "v1",
                    },
                    "reason": "Pulled",
                    "message": message,
                    "type": "Normal",
                    "source": {"component": "kubelet", "host": pod.spec.node_name},
                    "count": 1,
                    "firstTimestamp": stamp,
                    "lastTimestamp": stamp,
                },
            )

    def _check(self, pod, entry: PodEntry) -> None:
        inspect = subprocess.run(
            [self.docker, "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", entry.container],
            capture_output=True,
            text=True,
        )
        running, _, code = inspect.stdout.strip().partition(" ")
        if running != "false":
            return
        exit_code = int(code or 1)
        container = pod.spec.containers[0]
        entry.finished = True
        self._status(
            entry,
            "Succeeded" if exit_code == 0 else "Failed",
            {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "finishedAt": _now(),
                    **({"startedAt": entry.started_at} if entry.started_at else {}),
                }
            },
            container.image,
            container.name,
        )

    def _terminate(self, entry: PodEntry, grace: int) -> None:
        """SIGTERM, SIGKILL after the grace period, then the kubelet's final delete (grace 0)."""
        if entry.container:
            subprocess.run([self.docker, "stop", "-t", str(int(grace)), entry.container], capture_output=True)
        entry.finished = True
        with contextlib.suppress(client.exceptions.ApiException):
            self.core.delete_namespaced_pod(entry.name, entry.namespace, grace_period_seconds=0)

    # ------------------------------------------------------------------ logs
    def _log_server(self, pki: Path) -> http.server.ThreadingHTTPServer:
        kubelet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                query = urllib.parse.parse_qs(url.query)
                entry = next(
                    (
                        e
                        for e in list(kubelet.pods.values())
                        if parts[:1] == ["containerLogs"] and [e.namespace, e.name] == parts[1:3]
                    ),
                    None,
                )
                if entry is None and parts[:1] == ["portForward"]:
                    entry = next((e for e in list(kubelet.pods.values()) if [e.namespace, e.name] == parts[1:3]), None)
                    if entry is not None and entry.container is not None:
                        return kubelet._port_forward(self, [int(p) for p in query.get("port", [])])
                if entry is None or entry.container is None:
                    body = b"container is not running yet"
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                argv = [kubelet.docker, "logs", *(["-f"] if query.get("follow") == ["true"] else [])]
                if query.get("tailLines"):
                    argv += ["--tail", query["tailLines"][0]]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                proc = subprocess.Popen([*argv, entry.container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                try:
                    while chunk := proc.stdout.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    pass  # the reader went away (a kubelet's log stream ends the same way for it)
                finally:
                    proc.kill()

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        return server

    # ------------------------------------------------------------------ port-forward
    # What reaches us: a client speaking WebSocket (the official Python client: ``v5.channel.k8s.io`` or
    # ``v4.channel.k8s.io``) is proxied by the API server byte for byte to ``/portForward/<ns>/<pod>?port=P``: its
    # ``PortForwardWebsockets`` translation (WebSocket to SPDY/3.1) only applies to the ``SPDY/3.1+portforward.k8s.io``
    # tunnelling protocol kubectl speaks (pkg/registry/core/pod/rest/subresources.go, PortForwardREST.Connect), so
    # we answer with the kubelet's own WebSocket port-forward (pkg/kubelet/cri/streaming/portforward/websocket.go):
    # protocol ``v4.channel.k8s.io``, two channels per requested port (2i data, 2i+1 error), each binary message
    # prefixed by its channel byte; each channel's first message is the port, little-endian uint16. Data on 2i is
    # copied to and from 127.0.0.1:P (host network); a failed connect is text on 2i+1. The WebSocket closes when
    # every port's connection has ended, as the kubelet's does. Not implemented: SPDY (kubectl), base64 channels,
    # fragmented messages.
    def _port_forward(self, handler: http.server.BaseHTTPRequestHandler, ports: list[int]) -> None:
        offered = [p.strip() for p in handler.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        key = handler.headers.get("Sec-WebSocket-Key", "")
        if handler.headers.get("Upgrade", "").lower() != "websocket" or not key or not ports:
            body = b"port-forward here is WebSocket (v4.channel.k8s.io) with at least one port only"
            handler.send_response(400)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        handler.send_response(101)
        handler.send_header("Upgrade", "websocket")
        handler.send_header("Connection", "Upgrade")
        handler.send_header("Sec-WebSocket-Accept", accept.decode())
        if "v4.channel.k8s.io" in offered:
            handler.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
        handler.end_headers()
        handler.wfile.flush()
        handler.close_connection = True
        # The client sends nothing before our 101, so the request reader buffered nothing past the headers: from
        # here on the TLS socket itself, read and written by this one thread (an SSL socket is not thread-safe).
        ws = handler.connection

        def send(opcode: int, payload: bytes) -> None:  # a server's frames are final and unmasked
            size = len(payload)
            head = struct.pack("!BB", 0x80 | opcode, size) if size < 126 else b""
            if 126 <= size < 65536:
                head = struct.pack("!BBH", 0x80 | opcode, 126, size)
            elif size >= 65536:
                head = struct.pack("!BBQ", 0x80 | opcode, 127, size)
            ws.sendall(head + payload)

        def exact(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = ws.recv(n - len(data))
                if not chunk:
                    raise ConnectionError("the client went away")
                data += chunk
            return data

        def receive() -> tuple[int, bytes]:  # a client's frames are masked
            first, second = exact(2)
            size = second & 0x7F
            if size == 126:
                (size,) = struct.unpack("!H", exact(2))
            elif size == 127:
                (size,) = struct.unpack("!Q", exact(8))
            mask = exact(4) if second & 0x80 else b"\0\0\0\0"
            payload = exact(size)
            return first & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))

        upstream: dict[int, socket.socket] = {}  # channel -> the connection to the container's port
        for i, port in enumerate(ports):
            for channel in (2 * i, 2 * i + 1):
                send(0x2, bytes([channel]) + struct.pack("<H", port))
            try:
                upstream[2 * i] = socket.create_connection(("127.0.0.1", port), timeout=5)
                upstream[2 * i].settimeout(None)
            except OSError as exc:
                send(0x2, bytes([2 * i + 1]) + f"error forwarding port {port} to pod: {exc}".encode())
        try:
            while upstream:
                ready = [ws] if ws.pending() else select.select([ws, *upstream.values()], [], [])[0]
                for sock in ready:
                    if sock is ws:
                        opcode, payload = receive()
                        if opcode == 0x8:  # close: answer it, end every port
                            send(0x8, payload[:2])
                            return
                        if opcode == 0x9:
                            send(0xA, payload)
                        elif opcode == 0x2 and payload[:1] and payload[0] in upstream:
                            upstream[payload[0]].sendall(payload[1:])
                        continue
                    channel = next(c for c, s in upstream.items() if s is sock)
                    data = sock.recv(65536)
                    if data:
                        send(0x2, bytes([channel]) + data)
                    else:  # the container closed this port's connection
                        upstream.pop(channel).close()
            send(0x8, struct.pack("!H", 1000))
        except (ConnectionError, OSError, ssl.SSLError):
            pass  # the API server or its client went away
        finally:
            for sock in upstream.values():
                sock.close()

    # ------------------------------------------------------------------ for tests
    # ------------------------------------------------------------------ what the infrastructure does to a pod
    def _entries_on(self, node: str) -> list[tuple[object, PodEntry]]:
        pods = [p for p in self.core.list_pod_for_all_namespaces().items if p.spec.node_name == node]
        return [(pod, self.pods[pod.metadata.uid]) for pod in pods if pod.metadata.uid in self.pods]

    def shut_down_node(self, node: str, grace: int = 10) -> None:
        """A graceful node shutdown (a spot VM reclaimed), as the kubelet does it: each pod gets the
        ``DisruptionTarget`` condition (TerminationByKubelet), SIGTERM with the grace period, then phase Failed with
        the shutdown reason whatever the exit code; then the node leaves the cluster."""
        for pod, entry in self._entries_on(node):
            entry.finished = True  # this kubelet reports the end itself (not Succeeded for exit 0)
            now = _now()
            self.core.patch_namespaced_pod_status(
                entry.name,
                entry.namespace,
                {
                    "status": {
                        "conditions": [
                            {
                                "type": "DisruptionTarget",
                                "status": "True",
                                "reason": "TerminationByKubelet",
                                "message": "Pod was terminated in response to imminent node shutdown.",
                                "lastTransitionTime": now,
                            }
                        ]
                    }
                },
            )
            code = 137
            if entry.container:
                subprocess.run([self.docker, "stop", "-t", str(grace), entry.container], capture_output=True)
                code = int(
                    subprocess.run(
                        [self.docker, "inspect", "-f", "{{.State.ExitCode}}", entry.container],
                        capture_output=True,
                        text=True,
                    ).stdout.strip()
                    or 137
                )
            container = pod.spec.containers[0]
            self.core.patch_namespaced_pod_status(
                entry.name,
                entry.namespace,
                {
                    "status": {
                        "phase": "Failed",
                        "reason": "Terminated",
                        "message": "Pod was terminated in response to imminent node shutdown.",
                        "containerStatuses": [
                            {
                                "name": container.name,
                                "image": container.image,
                                "imageID": "",
                                "ready": False,
                                "restartCount": 0,
                                "state": {
                                    "terminated": {
                                        "exitCode": code,
                                        "reason": "Error" if code else "Completed",
                                        "finishedAt": _now(),
                                    }
                                },
                            }
                        ],
                    }
                },
            )
        self.nodes.discard(node)
        self.core.delete_node(node)

    def oom_kill(self, namespace: str, name: str) -> None:
        """The kernel's OOM killer ends the container (SIGKILL) and the kubelet reports OOMKilled, exit 137."""
        pod = self.core.read_namespaced_pod(name, namespace)
        entry = self.pods[pod.metadata.uid]
        entry.finished = True
        if entry.container:
            subprocess.run([self.docker, "kill", "-s", "KILL", entry.container], capture_output=True)
        container = pod.spec.containers[0]
        self.core.patch_namespaced_pod_status(
            name,
            namespace,
            {
                "status": {
                    "phase": "Failed",
                    "containerStatuses": [
                        {
                            "name": container.name,
                            "image": container.image,
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": _now()}},
                        }
                    ],
                }
            },
        )

    def running_containers(self) -> list[str]:
        out = subprocess.run(
            [self.docker, "ps", "-q", "--no-trunc", "--filter", f"label={self.label}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._server.shutdown()
        ids = subprocess.run(
            [self.docker, "ps", "-aq", "--filter", f"label={self.label}"], capture_output=True, text=True
        ).stdout.split()
        if ids:
            subprocess.run([self.docker, "rm", "-f", *ids], capture_output=True)
