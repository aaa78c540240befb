"""kinetic-gke, debug mode: what a debug job's manifest adds (the caller asked with ``KINETIC_DEBUG=1``).

* the debugpy port, named ``debugpy``, on the job's container, and the pod's own name and namespace (downward
  API) for the runner's record, which ``kinetic-prefect jobs debug`` port-forwards to through the API server;
* no ``activeDeadlineSeconds``: the pool's ``job_watch_timeout_seconds`` would stop the job while it waits for a
  debugger or sits at a breakpoint. The pod watch timeout only counts while the pod is Pending, which a job
  waiting for a debugger is not (it runs); a cancel still deletes the Job.
"""

from __future__ import annotations

from typing import Any

from kinetic_prefect.contract import DEBUG_PORT, Env

PORT_NAME = "debugpy"


def is_debug(manifest: dict[str, Any]) -> bool:
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return any(e.get("name") == Env.DEBUG and e.get("value") == "1" for e in container.get("env") or [])


def render(manifest: dict[str, Any]) -> None:
    if not is_debug(manifest):
        return
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    ports = [p for p in container.get("ports") or [] if p.get("name") != PORT_NAME]
    container["ports"] = [*ports, {"name": PORT_NAME, "containerPort": DEBUG_PORT}]
    own = {Env.POD_NAME: "metadata.name", Env.POD_NAMESPACE: "metadata.namespace"}
    env = [e for e in container.get("env") or [] if e.get("name") not in own]
    container["env"] = env + [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in own.items()]
    manifest["spec"].pop("activeDeadlineSeconds", None)
