"""Debug mode (``debug=True``) end to end on kinetic-local: a real job process starts a real debugpy, and a real
Debug Adapter Protocol client (written here: Content-Length framed JSON over a socket) attaches through
``kinetic-prefect jobs debug``'s forward, stops at a breakpoint in the user's file and lets the call return its
value to the flow. Also: nobody attaches (the clear error), a cancel while the job waits. The kinetic-gke side:
its manifest and the port-forward request the command makes (no server), and on the test control plane a debug
Job's debugpy reached through ``jobs debug`` and the API server's ``pods/portforward`` (the test kubelet,
tests/support/docker_kubelet.py, serves ``/portForward``), plus bytes both ways to a TCP echo server in a pod."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kinetic_prefect import kinetic, kinetic_task
from kinetic_prefect.contract import DEBUG_PORT, DEBUGPY_REQUIREMENT, Env
from kinetic_prefect.kinetic import debug as kinetic_debug
from kinetic_prefect.workers.gke import debug as gke_debug

USER_MODULE = """
def add_slowly(a, b):
    total = a + b  # the breakpoint's line
    return total
"""
BREAK_LINE = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _user_function(
    tmp_path: Path, name: str, source: str = USER_MODULE, function: str = "add_slowly"
) -> tuple[Any, Path, Path]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "debugged"\nversion = "0"\n')
    module_file = project / f"{name}.py"
    module_file.write_text(textwrap.dedent(source))
    sys.path.insert(0, str(project))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(project))
    return getattr(module, function), project, module_file


class DapClient:
    """The client half of the Debug Adapter Protocol: requests out, responses and events in, on a reader thread."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.settimeout(None)  # the reader blocks until the adapter speaks
        self.messages: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        self.seq = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stream = self.sock.makefile("rb")
        while True:
            headers = {}
            while (line := stream.readline().strip()) != b"":
                if not line and stream.closed:
                    return
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            if "content-length" not in headers:
                return
            message = json.loads(stream.read(int(headers["content-length"])))
            with self.arrived:
                self.messages.append(message)
                self.arrived.notify_all()

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return self.seq

    def wait_for(self, predicate, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                found = next((m for m in self.messages if predicate(m)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, (
                    f"no such message in {timeout} s; got {[m.get('command') or m.get('event') for m in self.messages]}"
                )
                self.arrived.wait(left)

    def response(self, seq: int, timeout: float = 30) -> dict[str, Any]:
        reply = self.wait_for(lambda m: m.get("type") == "response" and m.get("request_seq") == seq, timeout)
        assert reply["success"], reply
        return reply

    def event(self, name: str, timeout: float = 30, nth: int = 1) -> dict[str, Any]:
        """The ``nth`` event called ``name`` (the first by default)."""

        def is_it(message: dict[str, Any]) -> bool:
            return message.get("type") == "event" and message.get("event") == name

        def nth_arrived(message: dict[str, Any]) -> bool:
            return is_it(message) and [m for m in self.messages if is_it(m)].index(message) == nth - 1

        return self.wait_for(nth_arrived, timeout)

    def top_frames(self, stopped: dict[str, Any]) -> list[dict[str, Any]]:
        return self.response(self.send("stackTrace", threadId=stopped["body"]["threadId"]))["body"]["stackFrames"]


def _continue_past_the_pause(dap: DapClient) -> dict[str, Any]:
    """Kinetic's pause: the first stop of an attached job is the runner's line just before the user's function
    (Step Into enters it); continue from there. Returns the stopped event."""
    stopped = dap.event("stopped", timeout=60)
    frames = dap.top_frames(stopped)
    assert frames[0]["name"] == "_call" and frames[0]["source"]["path"].endswith(os.path.join("pod", "runner.py"))
    dap.response(dap.send("continue", threadId=stopped["body"]["threadId"]))
    return stopped


def _job_of(task_name: str, timeout: float = 60) -> Any:
    from kinetic_prefect.kinetic.job_lookup import list_jobs

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [job for job in list_jobs() if job.func_name == task_name]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no job of {task_name} in {timeout} s")


def _start_forward(job_id: str, port: int) -> tuple[subprocess.Popen, dict[str, Any]]:
    """``kinetic-prefect jobs debug JOB --port P`` as a user runs it; returns it and the launch.json it printed."""
    command = [sys.executable, "-m", "kinetic_prefect.cli", "jobs", "debug", job_id, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    lines: list[str] = []
    while not (lines and lines[-1].rstrip() == "}"):  # the launch.json entry ends the command's introduction
        line = process.stdout.readline()
        assert line, f"jobs debug ended early:\n{''.join(lines)}"
        lines.append(line)
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep draining its output
    return process, json.loads("".join(lines[start:]))


@pytest.mark.slow
def test_a_debugger_attaches_through_jobs_debug_and_stops_at_a_breakpoint(tmp_path):
    """A debug call's job really waits in debugpy; a DAP client attaches through `kinetic-prefect jobs debug`'s
    forward with the printed launch.json, stops at a breakpoint in the user's file, continues, and the flow gets
    the value. Needs more than a few seconds: a job process, debugpy's adapter start (≈ 2 s) and the CLI process."""
    from prefect import flow

    name = f"debugged_{uuid.uuid4().hex[:8]}"
    fn, project, module_file = _user_function(tmp_path, name)
    task = kinetic_task(fn, debug=True, project_dir=project, name=name)
    results: dict[str, Any] = {}

    @flow(name=f"debug-flow-{name}")
    def calling_flow():
        return task(2, 3)

    caller = threading.Thread(target=lambda: results.setdefault("value", calling_flow()), daemon=True)
    caller.start()
    job = _job_of(name)
    port = _free_port()
    forward, launch = _start_forward(job.job_id, port)
    try:
        configuration = launch["configurations"][0]
        assert configuration["type"] == "debugpy" and configuration["request"] == "attach"
        assert configuration["connect"] == {"host": "127.0.0.1", "port": port}
        [mapping] = configuration["pathMappings"]
        assert mapping["localRoot"] == str(project.resolve())
        assert mapping["remoteRoot"] != mapping["localRoot"]  # the job's own working copy of the project

        dap = DapClient(port)
        dap.response(
            dap.send("initialize", clientID="test", adapterID="debugpy", linesStartAt1=True, pathFormat="path")
        )
        attach = dap.send("attach", **{k: configuration[k] for k in ("connect", "pathMappings", "justMyCode")})
        dap.event("initialized")
        breakpoints = dap.response(
            dap.send("setBreakpoints", source={"path": str(module_file)}, breakpoints=[{"line": BREAK_LINE}])
        )
        assert breakpoints["body"]["breakpoints"][0]["verified"], breakpoints
        dap.response(dap.send("configurationDone"))
        dap.response(attach)
        _continue_past_the_pause(dap)
        stopped = dap.event("stopped", timeout=60, nth=2)
        assert stopped["body"]["reason"] == "breakpoint"
        thread_id = stopped["body"]["threadId"]
        frames = dap.response(dap.send("stackTrace", threadId=thread_id))["body"]["stackFrames"]
        assert frames[0]["source"]["path"] == str(module_file) and frames[0]["line"] == BREAK_LINE, frames[0]
        assert frames[0]["name"] == "add_slowly"
        dap.response(dap.send("continue", threadId=thread_id))
        caller.join(60)
        assert results.get("value") == 5
        forward.wait(15)  # the command ends with the job
        assert forward.returncode == 0
    finally:
        if forward.poll() is None:
            forward.kill()


USER_MODULE_WITH_BREAKPOINT = """
def scaled_sum(a, b):
    total = a + b
    breakpoint()
    return total * 10
"""
AFTER_BREAKPOINT_LINE = 5  # breakpoint() stops on the line after it


@pytest.mark.slow
def test_an_attached_debugger_pauses_before_the_function_and_at_its_breakpoint(tmp_path):
    """Kinetic's debugger pause (issue 48, defect 9): a debugger that attaches with no breakpoint set stops just
    before the user's function (the runner's `debugpy.breakpoint()`; Step Into enters it), and `breakpoint()` in
    the body stops in the attached debugger, where the function's locals are read; continue, and the flow gets the
    value. More than a few seconds: a job process, debugpy's adapter start (≈ 2 s) and the CLI process."""
    from prefect import flow

    name = f"paused_{uuid.uuid4().hex[:8]}"
    fn, project, module_file = _user_function(tmp_path, name, USER_MODULE_WITH_BREAKPOINT, "scaled_sum")
    task = kinetic_task(fn, debug=True, project_dir=project, name=name)
    results: dict[str, Any] = {}

    @flow(name=f"debug-flow-{name}")
    def calling_flow():
        return task(2, 3)

    caller = threading.Thread(target=lambda: results.setdefault("value", calling_flow()), daemon=True)
    caller.start()
    job = _job_of(name)
    port = _free_port()
    forward, launch = _start_forward(job.job_id, port)
    try:
        configuration = launch["configurations"][0]
        dap = DapClient(port)
        dap.response(
            dap.send("initialize", clientID="test", adapterID="debugpy", linesStartAt1=True, pathFormat="path")
        )
        attach = dap.send("attach", **{k: configuration[k] for k in ("connect", "pathMappings", "justMyCode")})
        dap.event("initialized")
        dap.response(dap.send("configurationDone"))  # no breakpoints set
        dap.response(attach)

        paused = dap.event("stopped", timeout=60)  # before the function: nothing of it on the stack
        frames = dap.top_frames(paused)
        assert frames[0]["name"] == "_call", frames[:3]
        assert frames[0]["source"]["path"].endswith(os.path.join("pod", "runner.py")), frames[0]
        assert not any(frame["name"] == "scaled_sum" for frame in frames), frames
        assert "value" not in results and caller.is_alive()
        dap.response(dap.send("continue", threadId=paused["body"]["threadId"]))

        stopped = dap.event("stopped", timeout=60, nth=2)  # breakpoint() in the body
        frames = dap.top_frames(stopped)
        assert frames[0]["name"] == "scaled_sum", frames[:3]
        assert frames[0]["source"]["path"] == str(module_file) and frames[0]["line"] == AFTER_BREAKPOINT_LINE
        total = dap.response(dap.send("evaluate", expression="total", frameId=frames[0]["id"], context="watch"))
        assert total["body"]["result"] == "5"
        dap.response(dap.send("continue", threadId=stopped["body"]["threadId"]))
        caller.join(60)
        assert results.get("value") == 50
        forward.wait(15)  # the command ends with the job
        assert forward.returncode == 0
    finally:
        if forward.poll() is None:
            forward.kill()


@pytest.mark.slow
def test_a_debug_job_nobody_attaches_to_fails_naming_that():
    """Kinetic's first debug session as a script (tests/kinetic_examples/), run as its user runs it, with nobody
    attaching: the job waits KINETIC_DEBUG_WAIT_SECONDS (2 s here) and fails before the function runs, naming that
    and the command that attaches. ≈ 15 s: the script's own process (Prefect's import), a job process, debugpy's
    adapter start and the wait."""
    script = Path(__file__).resolve().parents[1] / "kinetic_examples" / "debug_first_session.py"
    env = {**os.environ, Env.DEBUG_WAIT_SECONDS: "2"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "nobody attached a debugger within 2 s, so the function did not run" in output, output
    # A failure before the function ran is a setup error, naming the phase and the job's own exception.
    assert "KineticJobSetupError" in output and "waiting for a debugger to attach" in output
    assert "DebuggerNotAttached" in output and "kinetic-prefect jobs debug" in output


@pytest.mark.slow
def test_a_cancel_while_the_job_waits_for_its_debugger_stops_it(tmp_path):
    """A detached debug job is cancelled while it waits: its run ends Cancelled and its process is gone. A few
    seconds: a job process and debugpy's adapter start."""

    @kinetic.run(accelerator="cpu", debug=True)
    def waits_for_a_debugger():
        return "ran"

    job = waits_for_a_debugger.run_async()
    record = kinetic_debug.read_record(job, 60, say=lambda text: None)
    os.kill(record["pid"], 0)  # the job process waits
    job.cancel()
    assert job.state().is_cancelled()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"job process {record['pid']} still runs after the cancel")


# --------------------------------------------------------------------------- no server: options, env, kinetic-gke


@pytest.mark.no_server
def test_debug_options_and_the_environment_they_get():
    from kinetic_prefect.caller import debugging

    assert kinetic.run(accelerator="cpu", debug=True)(lambda: 0).task.kinetic.debug
    plain = kinetic_task(name="plain", requirements=["numpy"])(lambda: 0).kinetic
    debugged = dataclasses.replace(plain, debug=True)
    gke, local = {"image", "env"}, {"env"}
    assert debugging.job_image_spec(plain, gke) is plain.image_spec  # a non-debug call keeps its env hash
    assert debugging.job_image_spec(debugged, local).requirements == ("debugpy>=1.8", "numpy")
    assert debugging.job_image_spec(debugged, local).tag != plain.image_spec.tag
    bare = kinetic_task(name="bare", debug=True)(lambda: 0).kinetic
    assert bare.image_spec.uses_caller_interpreter
    assert debugging.job_image_spec(bare, local) is bare.image_spec  # the worker's interpreter (has debugpy here)
    assert DEBUGPY_REQUIREMENT in debugging.job_image_spec(bare, gke).requirements  # an image is built: with it
    variables = debugging.job_variables(bare, Path("/home/me/proj"), gke | {"keep_warm_seconds"})
    sources = variables["env"].pop(Env.DEBUG_SOURCES)
    assert variables["env"] == {
        Env.DEBUG: "1",
        Env.DEBUG_CALLER_ROOT: "/home/me/proj",
        Env.DEBUG_PORT: str(DEBUG_PORT),
    }
    assert json.loads(sources) == {}  # no module of that project is loaded here
    assert variables["keep_warm_seconds"] == 0  # a warm runner would take the next call in the same process
    assert debugging.job_variables(plain, Path("/x"), gke) == {}


@pytest.mark.no_server
def test_a_bad_debug_wait_fails_before_upload(monkeypatch):
    from kinetic_prefect.caller import debugging

    options = kinetic_task(name="bad_wait", debug=True)(lambda: 0).kinetic
    monkeypatch.setenv(Env.DEBUG_WAIT_SECONDS, "ten")
    with pytest.raises(ValueError, match=r"KINETIC_DEBUG_WAIT_SECONDS='ten'.*seconds > 0"):
        debugging.check(options, "kinetic-local", {"env"})
    monkeypatch.delenv(Env.DEBUG_WAIT_SECONDS)
    monkeypatch.setattr(debugging, "_has_debugpy", lambda: False)
    with pytest.raises(ValueError, match=r"debugpy is not installed.*pip install 'debugpy>=1.8'.*requirements="):
        debugging.check(options, "kinetic-local", {"env"})


@pytest.mark.no_server
def test_a_gke_debug_job_exposes_the_port_and_no_deadline_stops_its_wait():
    import kubernetes_validate
    from test_gke_manifests import K8S_VERSION, render

    env = {"KINETIC_RUN_PREFIX": "runs/abc", Env.DEBUG: "1", Env.DEBUG_PORT: str(DEBUG_PORT)}
    manifest = render("l4", env=env, job_watch_timeout_seconds=600).job_manifest
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "debugpy", "containerPort": DEBUG_PORT} in container["ports"]
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name[Env.POD_NAME]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert by_name[Env.DEBUG_PORT]["value"] == str(DEBUG_PORT)
    assert "activeDeadlineSeconds" not in manifest["spec"]  # waiting at a breakpoint is not a hung job
    plain = render("l4", job_watch_timeout_seconds=600).job_manifest
    assert (
        plain["spec"]["activeDeadlineSeconds"] == 600
        and "ports" not in plain["spec"]["template"]["spec"]["containers"][0]
    )


@pytest.mark.no_server
def test_jobs_debug_on_gke_port_forwards_through_the_api_server():
    """The request the command makes (the pod, namespace and port of the job's record, through CoreV1Api's
    port-forward), and the bytes an editor sends reach the pod's end and come back."""
    requests: list[tuple] = []
    pod_ends: list[socket.socket] = []

    class Forward:
        def socket(self, port):
            ours, theirs = socket.socketpair()
            pod_ends.append(theirs)
            threading.Thread(target=lambda: theirs.sendall(b"echo:" + theirs.recv(100)), daemon=True).start()
            return ours

    def portforward(connect, name, namespace, ports):
        requests.append((connect.__name__, name, namespace, ports))
        return Forward()

    record = {"pod": "kinetic-train-1234abcd-x7k2p", "namespace": "ml", "port": DEBUG_PORT, "host": "127.0.0.1"}
    connect = gke_debug.kube_connector(record, api_client=None, portforward=portforward)
    port, stop = _free_port(), threading.Event()
    listener = kinetic_debug.listen(port)  # listening before the command prints where to attach
    server = threading.Thread(target=kinetic_debug.serve, args=(listener, connect, stop.is_set), daemon=True)
    server.start()
    editor = socket.create_connection(("127.0.0.1", port), timeout=5)
    editor.sendall(b"hello")
    assert editor.recv(100) == b"echo:hello"
    stop.set()
    server.join(5)
    assert requests == [("connect_get_namespaced_pod_portforward", record["pod"], "ml", str(DEBUG_PORT))]
    launch = kinetic_debug.launch_configuration({**record, "caller_root": "/me/proj", "remote_root": "/tmp/w"}, 5678)
    assert launch["pathMappings"] == [{"localRoot": "/me/proj", "remoteRoot": "/tmp/w"}]


def test_jobs_debug_refuses_a_job_without_debug_mode():
    from kinetic_prefect.cli import main as cli

    @kinetic.run(accelerator="cpu")
    def plain_job():
        return 1

    job = plain_job.run_async()
    job.result()
    assert cli(["jobs", "debug", job.job_id, "--wait", "1"]) == 2  # a usage error, naming the fix


# --------------------------------------------------------------------------- kinetic-gke: the API server's port-forward
ECHO_SERVER = """
import socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    conn, _ = server.accept()
    while data := conn.recv(65536):
        conn.sendall(b"echo:" + data)
    conn.close()
"""


@pytest.mark.slow
@pytest.mark.no_server
def test_a_port_forward_through_the_api_server_reaches_the_pods_port(kube, python_base_image):
    """``kinetic-prefect jobs debug``'s kinetic-gke connector, through the real API server's ``pods/portforward``
    (WebSocket ``v4.channel.k8s.io``, proxied to the test kubelet's ``/portForward``), to a TCP echo server in a pod:
    bytes go both ways, twice (a second editor connection is a second port-forward). More than a few seconds: the
    control plane's start (≈ 5 s once built) and a container's."""
    from kubernetes import client as k8s

    core = k8s.CoreV1Api(kube.api())
    port, name = _free_port(), f"echo-{uuid.uuid4().hex[:6]}"
    spec = {"restartPolicy": "Never", "nodeName": "gke-l4-pool-1"}
    container = {"name": "echo", "image": python_base_image, "command": ["python3", "-c", ECHO_SERVER, str(port)]}
    core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": {**spec, "containers": [container]}})
    try:
        deadline = time.monotonic() + 60
        while core.read_namespaced_pod(name, "default").status.phase != "Running":
            assert time.monotonic() < deadline, "the echo pod did not start"
            time.sleep(0.3)
        record = {"pod": name, "namespace": "default", "port": port}
        connect = gke_debug.kube_connector(record, api_client=kube.api())
        for message in (b"hello", b"x" * 200_000):
            while True:  # until the container listens: before that, the forward's error channel ends the stream
                sock = connect()
                sock.settimeout(10)
                sock.sendall(message)
                got = b""
                while len(got.replace(b"echo:", b"")) < len(message) and (chunk := sock.recv(1 << 20)):
                    got += chunk
                sock.close()
                if got or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert got.startswith(b"echo:") and got.replace(b"echo:", b"") == message, got[:100]
    finally:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


@pytest.mark.slow
def test_a_blocking_kinetic_run_debug_call_opens_the_forward_itself(monkeypatch, capfd):
    """As Kinetic's blocking debug call does: the call itself forwards a local port to its job's debugger and prints
    the launch.json entry; a DAP client attaches there, and the call returns its value. More than a few seconds: a
    job process and debugpy's adapter start."""
    port = _free_port()
    monkeypatch.setenv(Env.DEBUG_LOCAL_PORT, str(port))

    @kinetic.run(accelerator="cpu", debug=True)
    def debugged_sum():
        return sum(range(5))

    results: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: results.setdefault("value", debugged_sum()), daemon=True)
    caller.start()
    printed, deadline = "", time.monotonic() + 120
    while '"request": "attach"' not in printed:  # the entry is printed once the forward listens
        assert time.monotonic() < deadline and caller.is_alive(), f"the call opened no forward:\n{printed}"
        printed += capfd.readouterr().out
        time.sleep(0.3)
    assert f'"port": {port}' in printed
    dap = DapClient(port)
    dap.response(dap.send("initialize", clientID="test", adapterID="debugpy", linesStartAt1=True, pathFormat="path"))
    attach = dap.send("attach", connect={"host": "127.0.0.1", "port": port}, justMyCode=True)
    dap.event("initialized")
    dap.response(dap.send("configurationDone"))
    dap.response(attach)
    _continue_past_the_pause(dap)
    caller.join(90)
    assert results.get("value") == 10


@pytest.mark.slow
def test_a_gke_debug_job_is_reached_through_jobs_debug_and_the_api_servers_port_forward(
    tmp_path, monkeypatch, kube, gcs_bucket, local_registry, python_base_image
):
    """The kinetic-gke flow end to end: a debug call's Job on the control plane, its pod's debugpy waiting, and a DAP
    client through `kinetic-prefect jobs debug` (the pool's kubeconfig, the API server's port-forward, the test
    kubelet's ``/portForward``): debugpy answers ``initialize``, the client attaches, and the call returns its
    value. More than a few seconds: the control plane, the debug job's image (with debugpy; built once per
    registry), the job's container, debugpy's adapter start and the CLI process."""
    from docker_fixture import proxy_files
    from prefect import flow
    from test_gke_cluster import _cluster_block, _gke_task, _make_pool

    from kinetic_prefect.caller import debugging
    from kinetic_prefect.shared.builders import DockerBuilder
    from kinetic_prefect.shared.image import ImageSpec

    # The debug job's image (the base and debugpy), built ahead with this machine's proxy CA as the cluster tests'
    # images are (the worker then finds its tag in the registry).
    spec = ImageSpec.create([DEBUGPY_REQUIREMENT], family="cpu", base_image=python_base_image)
    DockerBuilder(f"{local_registry}/kinetic-tests", network="host", extra_files=proxy_files()).ensure(
        spec, log=lambda line: None
    )

    # The test kubelet runs pods on this machine's network, so the pod's debugpy takes a free port, not 5678 (which
    # another session's pod could hold); the record names it, and jobs debug forwards to what the record says.
    monkeypatch.setattr(debugging, "DEBUG_PORT", _free_port())
    # jobs debug reaches the cluster as the worker does: through the pool's cluster_config block
    monkeypatch.delenv("KUBECONFIG", raising=False)
    pool = _make_pool(_cluster_block(kube), f"{gcs_bucket}/gke-debug", local_registry)
    name = f"gke_debugged_{uuid.uuid4().hex[:8]}"
    fn, project, _ = _user_function(tmp_path, name)
    task = _gke_task(name, pool, python_base_image, accelerator="cpu", debug=True, project_dir=project)(fn)
    results: dict[str, Any] = {}

    @flow(name=f"gke-debug-flow-{name}")
    def calling_flow():
        return task(2, 3)

    caller = threading.Thread(target=lambda: results.setdefault("value", calling_flow()), daemon=True)
    caller.start()
    job = _job_of(name, timeout=600)
    port = _free_port()
    forward, launch = _start_forward(job.job_id, port)
    try:
        configuration = launch["configurations"][0]
        assert configuration["connect"] == {"host": "127.0.0.1", "port": port}
        dap = DapClient(port)
        initialize = dap.response(
            dap.send("initialize", clientID="test", adapterID="debugpy", linesStartAt1=True, pathFormat="path")
        )
        assert initialize["body"]["supportsConfigurationDoneRequest"]  # debugpy's adapter in the pod answered
        attach = dap.send("attach", **{k: configuration[k] for k in ("connect", "pathMappings", "justMyCode")})
        dap.event("initialized")
        dap.response(dap.send("configurationDone"))
        dap.response(attach)
        _continue_past_the_pause(dap)  # the same runner pauses on kinetic-gke
        caller.join(120)
        assert results.get("value") == 5
        forward.wait(30)  # the command ends with the job
        assert forward.returncode == 0
    finally:
        if forward.poll() is None:
            forward.kill()
