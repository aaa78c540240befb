"""Attaching to a debug job (``debug=True``): ``kinetic-prefect jobs debug JOB --port P`` and ``forward(job, port)``.

The job's runner (``pod/debugger.py``) listens on localhost where it runs and writes where in its record
(``RunLayout.debugger``). This side waits for that record, then serves 127.0.0.1:P on this machine until stopped,

each connection is opened by the job's worker class (``debug_connector``, in its launcher's folder):

* kinetic-local: relayed to the job process's port (the job runs on the worker's machine, which is this one, or
  one reached the same way);
* kinetic-gke: a port-forward to the pod through the Kubernetes API server (``kubernetes.stream.portforward``,
  what ``kubectl port-forward`` does), with the pool's kubeconfig (``workers/gke/debug.py``).

It prints a VS Code ``launch.json`` entry whose ``pathMappings`` map the caller's project root to the job's
working copy of it, where the job's frames come from.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from kinetic_prefect import signing
from kinetic_prefect.contract import DEBUG_PORT, Env, RunLayout, settings
from kinetic_prefect.contract.launchers import DebugForwarding

RECORD_POLL_SECONDS = 0.5
# Each look lists the live jobs (two reads per job): a debug call looks for its own less often than for its record.
JOB_LOOKUP_POLL_SECONDS = 2.0


class NotADebugJob(ValueError):
    """The job was not submitted with debug=True: nothing in it listens for a debugger."""


def launch_configuration(record: dict[str, Any], local_port: int, name: str = "kinetic-prefect: attach") -> dict:
    """The ``launch.json`` entry for the editor (the debugpy extension's attach request)."""
    mappings = []
    if record.get("caller_root") and record.get("remote_root"):
        mappings.append({"localRoot": record["caller_root"], "remoteRoot": record["remote_root"]})
    return {
        "name": name,
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": "127.0.0.1", "port": local_port},
        "pathMappings": mappings,
        "justMyCode": False,
    }


async def _flow_run_and_store(job_id: str) -> tuple[Any, Any, signing.Keyring | None]:
    from prefect import get_client

    from kinetic_prefect.kinetic.jobs import _open_store

    async with get_client() as client:
        flow_run = await client.read_flow_run(UUID(job_id))
        store, key = await _open_store(client, flow_run)
    return flow_run, store, key


def read_record(job: Any, wait_seconds: float, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The job's debugger record, waited for while the job starts (its environment, its pod); fails at once for a
    job without debug mode and when the job ends first."""
    from kinetic_prefect import signing
    from kinetic_prefect.kinetic.jobs import run_sync
    from kinetic_prefect.storage import ObjectNotFound

    flow_run, store, key = run_sync(_flow_run_and_store(job.job_id))
    env = (flow_run.job_variables or {}).get("env") or {}
    if env.get(Env.DEBUG) != "1":
        raise NotADebugJob(
            f"job {job.job_id} ({job.display_name}) was not submitted with debug=True, so nothing in it waits for a "
            "debugger; submit it with @kinetic_task(debug=True) or @kinetic.run(debug=True)"
        )
    layout = RunLayout(env[Env.RUN_ID])
    deadline, told = time.monotonic() + wait_seconds, False
    while True:
        try:
            return json.loads(signing.get(store, layout.debugger, key))
        except ObjectNotFound:
            pass
        state = job.state()
        if state is not None and state.is_final():
            raise RuntimeError(f"job {job.job_id} ended ({state.name}) before its debugger listened")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.job_id} did not start its debugger within {wait_seconds:.0f} s; run again")
        if not told:
            say(f"Waiting for job {job.job_id} to start its debugger ({state.name if state else 'no state'})...")
            told = True
        time.sleep(RECORD_POLL_SECONDS)


def _pump(source: Any, sink: Any) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def relay(client: socket.socket, upstream: Any) -> None:
    """Both directions between an accepted connection and the job's end, until either closes."""
    threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
    _pump(client, upstream)
    client.close()
    upstream.close()


def job_variables(job: Any) -> dict[str, Any]:
    """The job's variables: its run's, else its pool's defaults, a block reference (``{"$ref": ...}``) resolved to
    the block's fields, as the worker resolves them."""
    from prefect import get_client
    from prefect.utilities.templating import resolve_block_document_references

    from kinetic_prefect.kinetic.jobs import run_sync

    async def settings() -> dict[str, Any]:
        async with get_client() as prefect:
            flow_run = await prefect.read_flow_run(UUID(job.job_id))
            pool = await prefect.read_work_pool(job.work_pool)
            defaults = {k: v.get("default") for k, v in pool.base_job_template["variables"]["properties"].items()}
            values = {**defaults, **(flow_run.job_variables or {})}
            resolved: dict[str, Any] = await resolve_block_document_references(values, client=prefect)
            return resolved

    return run_sync(settings())


def listen(local_port: int) -> socket.socket:
    """A listener on 127.0.0.1:``local_port``, bound before the attach configuration is printed: an editor that
    reads it may connect at once."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", local_port))
    except OSError as exc:
        listener.close()
        raise RuntimeError(f"127.0.0.1:{local_port} is taken ({exc.strerror}): pass another --port") from None
    listener.listen()
    listener.settimeout(1.0)
    return listener


def _proc_net_address(host: str, port: int, family: int) -> str:
    """``host:port`` as /proc/net/tcp (``family`` AF_INET) or tcp6 (AF_INET6) writes it: each 32-bit word of the
    address in the machine's byte order, in hex, and the port in hex."""
    import struct

    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def peer_uid(connection: socket.socket) -> int | None:
    """The uid of the process that owns the other end of an accepted loopback TCP connection (Linux: the socket's
    row in /proc/net/tcp or tcp6), or None where this system cannot say (no /proc/net/tcp). LookupError: Linux has
    no such socket (its end closed already)."""
    tables = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}
    if not os.path.exists(tables[socket.AF_INET]):
        return None
    peer_host, peer_port = connection.getpeername()[:2]
    our_host, our_port = connection.getsockname()[:2]
    wanted = {
        # an IPv4 client, or a dual-stack IPv6 one whose address is IPv4-mapped
        socket.AF_INET: (_proc_net_address(peer_host, peer_port, socket.AF_INET), None),
        socket.AF_INET6: (
            _proc_net_address(f"::ffff:{peer_host}", peer_port, socket.AF_INET6),
            _proc_net_address(f"::ffff:{our_host}", our_port, socket.AF_INET6),
        ),
    }
    ours_v4 = _proc_net_address(our_host, our_port, socket.AF_INET)
    for family, path in tables.items():
        local, remote = wanted[family]
        try:
            with open(path) as table:
                rows = [line.split() for line in table.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > 7 and row[1] == local and row[2] in (remote, ours_v4):
                return int(row[7])
    raise LookupError(f"no socket of this machine is the other end of {peer_host}:{peer_port}")


def refusal_of(connection: socket.socket) -> str | None:
    """Why the relay refuses an accepted connection, or None: only the user running the relay may reach the job's
    debugger through it (an attached debugger runs any code in the job). An editor cannot present a token (the
    debug adapter protocol has none), so the relay asks the kernel who owns the connection's other end."""
    try:
        uid = peer_uid(connection)
    except LookupError:
        return "refused a connection whose other end is not a socket of this machine (gone already?)"
    me = os.geteuid()
    if uid is None or uid == me:
        return None
    return (
        f"refused a connection from {_user_name(uid)} (uid {uid}): only {_user_name(me)} (uid {me}), who runs this "
        "relay, may attach to the job's debugger through it"
    )


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"user #{uid}"


def serve(listener: socket.socket, connect: Callable[[], Any], until: Callable[[], bool]) -> None:
    """Accept connections on the listener and relay each through ``connect()``, until ``until()``; a connection from
    another user of this machine is closed unrelayed (``refusal_of``)."""
    try:
        while not until():
            try:
                accepted, _ = listener.accept()
            except TimeoutError:
                continue
            refusal = refusal_of(accepted)
            if refusal is not None:
                print(f"kinetic-prefect jobs debug: {refusal}", file=sys.stderr, flush=True)
                accepted.close()
                continue
            try:
                upstream = connect()
            except Exception as exc:
                print(f"could not reach the job's debugger: {exc}", file=sys.stderr, flush=True)
                accepted.close()
                continue
            threading.Thread(target=relay, args=(accepted, upstream), daemon=True).start()
    finally:
        listener.close()


def _worker_class_of(job: Any) -> Any:
    """The worker class of the job's pool, whose ``debug_connector`` reaches the job (a job whose pool is unknown
    runs where the default pool's jobs run); a launcher whose jobs no debugger reaches is refused."""
    from kinetic_prefect import config
    from kinetic_prefect.caller.pools import worker_class_for

    worker_class = worker_class_for(job.backend or config.DEFAULT_POOL_TYPE)
    if worker_class.abilities.debug_forwarding is DebugForwarding.NONE:
        raise NotADebugJob(f"job {job.job_id} runs on a pool of type {job.backend!r}, whose jobs no debugger reaches")
    return worker_class


def forward(job: Any, local_port: int = DEBUG_PORT, wait_seconds: float = 600.0, say=print) -> None:
    """``kinetic-prefect jobs debug``: wait for the job's debugger, print the attach configuration, and forward
    127.0.0.1:``local_port`` to it until the job ends or the user interrupts."""
    record = read_record(job, wait_seconds, say)
    listener = listen(local_port)
    connect, where = _worker_class_of(job).debug_connector(record, lambda: job_variables(job))
    say(f"Forwarding 127.0.0.1:{local_port} to job {job.job_id}'s debugpy at {where}. Ctrl-C stops.")
    say("VS Code: add this to .vscode/launch.json, then Run > Start Debugging (F5):")
    say(json.dumps({"version": "0.2.0", "configurations": [launch_configuration(record, local_port)]}, indent=2))

    last_check = [0.0]
    ended = [False]

    def job_ended() -> bool:
        if time.monotonic() - last_check[0] > 2.0:
            last_check[0] = time.monotonic()
            state = job.state()
            ended[0] = state is None or state.is_final()
        return ended[0]

    serve(listener, connect, job_ended)
    say(f"Job {job.job_id} ended; the forward is closed.")


def _job_of_call(func_name: str, since: Any, stop: threading.Event) -> Any:
    """The job a call of ``func_name`` made from ``since`` (an aware datetime) on, once its run exists."""
    import datetime

    from kinetic_prefect.kinetic.job_lookup import list_jobs

    def made_since(job: Any) -> bool:
        return bool(job.created_at) and datetime.datetime.fromisoformat(job.created_at) >= since

    while not stop.is_set():
        found = [job for job in list_jobs() if job.func_name == func_name and made_since(job)]
        if found:
            return min(found, key=lambda job: job.created_at)
        stop.wait(JOB_LOOKUP_POLL_SECONDS)
    return None


def forward_for_call(func_name: str, local_port: int | None = None) -> threading.Event:
    """What a blocking ``kinetic.run(debug=True)`` call does, as Kinetic's does: in the background, find the call's
    job, then forward 127.0.0.1:``local_port`` (``$KINETIC_DEBUG_LOCAL_PORT``, else 5678) to its debugger and print
    the launch.json entry, until the job ends. Set the returned event to give up early (the call ended)."""
    import datetime

    stop = threading.Event()
    port = local_port or settings.DEBUG_LOCAL_PORT.value()
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=5)

    def run() -> None:
        try:
            job = _job_of_call(func_name, since, stop)
            if job is not None:
                forward(job, port, say=lambda line: print(line, flush=True))
        except Exception as exc:  # the call goes on; the user can still attach by hand
            print(
                f"debug: could not forward 127.0.0.1:{port} to the job's debugger ({exc}); attach with "
                "`kinetic-prefect jobs debug JOB_ID --port PORT`",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=run, name="kinetic-debug-forward", daemon=True).start()
    return stop
