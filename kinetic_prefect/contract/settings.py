"""Every tunable ``KINETIC_*`` variable in one typed table, read through one method (stdlib only; ships to the job).

A *setting* is a value a user or an operator may choose, with a default: the store, the default pool, how long
the API's absence is waited out. Each is one :class:`Setting` below: its variable (the contract's ``Env`` name),
its default, its parser, the sides that read it and one line for the docs. Code reads a setting with
``settings.X.value()``, at call time (tests and users change the environment between calls), and a bad value
fails there with an error that names the variable and what to give instead.

The other ``KINETIC_*`` variables are the job's wire protocol: the worker (or the runner, for the function) sets
them for one job (``KINETIC_RUN_ID``, ``KINETIC_PAYLOAD_SHA256``, ``KINETIC_HOST_INDEX``...), so nobody tunes them,
and they have no default to document; they stay plain ``Env`` names, read where they are used.
:data:`SET_BY_THE_WORKER` lists them with one line each, so the generated page (``docs/reference/settings.md``)
names every variable, and a test fails when ``Env`` gains a name that is in neither list.

``python -m kinetic_prefect.contract.settings --write docs/reference/settings.md`` writes that page from this
module; ``--check`` fails when the committed page differs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kinetic_prefect.contract import (
    API_OUTAGE_SECONDS_VAR,
    DEBUG_PORT,
    DEFAULT_API_OUTAGE_SECONDS,
    DEFAULT_DEBUG_WAIT_SECONDS,
    Env,
)

T = TypeVar("T")

# The sides that read a setting (docs/ARCHITECTURE.md): the user's process, the work-pool worker, the job.
CALLER, WORKER, JOB = "caller", "worker", "job"


class SettingError(ValueError):
    """A setting's variable holds a value its parser refuses; the message names the variable and the fix."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One tunable variable: ``value()`` is its parsed value now, or ``default`` when it is unset or blank."""

    name: str  # the variable, from Env
    default: T
    parse: Callable[[str], T]  # raises ValueError on a bad value
    expected: str  # what a good value is, for the error: "give a whole number of bytes"
    sides: tuple[str, ...]
    doc: str
    # The default as the page shows it, where the code computes it (a path under the cache, the CPU count).
    default_doc: str | None = None
    # A blank value is a value (KINETIC_LOCAL_DEVICES="": no device but the CPU), not "use the default".
    blank_is_a_value: bool = False

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable as set (None when unset), for code that forwards it or only asks whether it is set."""
        return (os.environ if environ is None else environ).get(self.name)

    def value(self, environ: Mapping[str, str] | None = None) -> T:
        raw = self.raw(environ)
        if raw is None or (not raw.strip() and not self.blank_is_a_value):
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise SettingError(
                f"{self.name}={raw!r}: {self.expected}, or unset it for the default "
                f"({self.shown_default.replace('`', '')})"
            ) from None

    @property
    def shown_default(self) -> str:
        """The default as the page and the errors show it."""
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return "`1`" if self.default else "`0`"
        if isinstance(self.default, float) and self.default.is_integer():
            return f"`{self.default:.0f}`"
        return f"`{self.default}`"


# --------------------------------------------------------------------------- parsers

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(raw)


def parse_count(raw: str) -> int:
    """A whole number >= 0; ``_`` may group digits (10_000_000)."""
    value = int(raw.replace("_", ""))
    if value < 0:
        raise ValueError(raw)
    return value


def parse_positive_int(raw: str) -> int:
    value = parse_count(raw)
    if value == 0:
        raise ValueError(raw)
    return value


def parse_port(raw: str) -> int:
    value = int(raw)
    if not 0 < value < 65536:
        raise ValueError(raw)
    return value


def parse_seconds(raw: str) -> float:
    """A number of seconds >= 0 (``inf`` allowed: forever)."""
    value = float(raw)
    if not value >= 0:  # also refuses nan
        raise ValueError(raw)
    return value


def parse_positive_seconds(raw: str) -> float:
    value = parse_seconds(raw)
    if value == 0:
        raise ValueError(raw)
    return value


def parse_text(raw: str) -> str:
    return raw


def parse_key(raw: str) -> str:
    """A signing key: any text but a blank one (a blank key would read as "unsigned")."""
    if not raw.strip():
        raise ValueError(raw)
    return raw


def parse_names(raw: str) -> tuple[str, ...]:
    """A comma-separated list (``cuda,tpu``); blank: none."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


# --------------------------------------------------------------------------- the table

STORE: Setting[str | None] = Setting(
    Env.STORE,
    None,
    parse_text,
    "give a local directory or gs://bucket/prefix",
    (CALLER, WORKER),
    "The artifact store when the work pool names none (a local directory or gs://bucket/prefix).",
    default_doc="`$KINETIC_CACHE_DIR/store`",
)
WORK_POOL: Setting[str | None] = Setting(
    Env.WORK_POOL,
    None,
    parse_text,
    "give a work pool's name",
    (CALLER,),
    "The work pool a `@kinetic_task` without `work_pool=` runs on.",
    default_doc="`kinetic-local` (config.DEFAULT_WORK_POOL, the embedded pool)",
)
CACHE_DIR: Setting[str | None] = Setting(
    Env.CACHE_DIR,
    None,
    parse_text,
    "give a directory",
    (CALLER, WORKER),
    "kinetic-prefect's cache: uv environments, the local store, the payload cache.",
    default_doc="`$XDG_CACHE_HOME/kinetic-prefect`, else `~/.cache/kinetic-prefect`",
)
IN_PROCESS_CONCURRENCY: Setting[int | None] = Setting(
    Env.IN_PROCESS_CONCURRENCY,
    None,
    parse_positive_int,
    "give a whole number of jobs >= 1",
    (CALLER,),
    "How many in-process jobs one calling process runs at once; a larger `.map()` queues.",
    default_doc="twice the CPU count, at least 4",
)
SWEEP_SLOTS: Setting[int | None] = Setting(
    Env.SWEEP_SLOTS,
    None,
    parse_count,
    "give a whole number of slot jobs >= 0 (0: no slots, a job run per call)",
    (CALLER,),
    "How many slot jobs one sweep (a fan-out of one task on a kinetic-local pool, or a kinetic-gke pool with warm "
    "pods) runs at most; the task's tag concurrency limit bounds it too. 0: no slots, every call a job run of its own.",
    default_doc="twice the CPU count, at least 4 (as KINETIC_IN_PROCESS_CONCURRENCY); on kinetic-gke the work "
    "pool's concurrency limit, else 8",
)
EPHEMERAL_STARTUP_SECONDS: Setting[int] = Setting(
    Env.EPHEMERAL_STARTUP_SECONDS,
    300,
    parse_positive_int,
    "give a whole number of seconds >= 1",
    (CALLER,),
    "How long the caller waits for Prefect's local (ephemeral) server to start.",
)
PAYLOAD_CACHE: Setting[bool] = Setting(
    Env.PAYLOAD_CACHE,
    True,
    parse_bool,
    "give 1 or 0",
    (CALLER,),
    "Keep a function's pickle between calls (0 pickles it again on every call).",
)
PAYLOAD_WARN_BYTES: Setting[int] = Setting(
    Env.PAYLOAD_WARN_BYTES,
    10 * 2**20,
    parse_count,
    "give a whole number of bytes (0: never warn)",
    (CALLER,),
    "A call's payload over this size warns once per function and argument (0: never).",
    default_doc="`10485760` (10 MiB)",
)
UNSIGNED_OK: Setting[bool] = Setting(
    Env.UNSIGNED_OK,
    False,
    parse_bool,
    "give 1 or 0",
    (CALLER,),
    "1: no warning that the store is unsigned (one machine, nobody else writes the store).",
)
SIGNING_KEY: Setting[str | None] = Setting(
    Env.SIGNING_KEY,
    None,
    parse_key,
    "give the shared secret (a blank key is refused: unset the variable instead)",
    (CALLER, WORKER, JOB),
    "The master key that signs store objects (callers and workers; a job gets only its run's derived keys); "
    "unset: the Prefect Secret block `kinetic-signing-key`, else unsigned.",
    blank_is_a_value=True,
)
SIGNING_KEY_PREVIOUS: Setting[str | None] = Setting(
    Env.SIGNING_KEY_PREVIOUS,
    None,
    parse_text,
    "give the earlier keys, comma-separated",
    (CALLER, WORKER),
    "Earlier master keys, comma-separated: objects they signed still verify while new ones are signed with "
    "the current key (key rotation, docs/security.md).",
)
UNSIGNED_SHARED_STORE: Setting[bool] = Setting(
    Env.UNSIGNED_SHARED_STORE,
    False,
    parse_bool,
    "give 1 or 0",
    (CALLER, WORKER),
    "1: run unsigned on a shared (gs://) store, where anyone who can write the bucket can run code in your "
    "caller and jobs. Without it a gs:// store with no signing key is refused.",
)
API_OUTAGE_SECONDS: Setting[float] = Setting(
    API_OUTAGE_SECONDS_VAR,
    DEFAULT_API_OUTAGE_SECONDS,
    parse_seconds,
    "give a number of seconds >= 0 (how long a Prefect API outage is waited out, e.g. 900)",
    (CALLER, WORKER),
    "How long the caller and the worker wait out an unreachable Prefect API before giving up on a job.",
)
DEBUG_WAIT_SECONDS: Setting[float] = Setting(
    Env.DEBUG_WAIT_SECONDS,
    DEFAULT_DEBUG_WAIT_SECONDS,
    parse_positive_seconds,
    "give a number of seconds > 0 (e.g. 600)",
    (CALLER, JOB),
    "`debug=True`: how long the job waits for a debugger before it fails; the caller's value is sent to the job.",
)
DEBUG_LOCAL_PORT: Setting[int] = Setting(
    Env.DEBUG_LOCAL_PORT,
    DEBUG_PORT,
    parse_port,
    "give a port number (1-65535)",
    (CALLER,),
    "The caller's port a blocking `kinetic.run(debug=True)` forwards to its job's debugger.",
)
USAGE_SAMPLE_SECONDS: Setting[float] = Setting(
    Env.USAGE_SAMPLE_SECONDS,
    2.0,
    parse_seconds,
    "give a number of seconds >= 0 (0: no sampling)",
    (JOB,),
    "The job's usage sampler's interval (CPU, memory, GPU); 0 turns it off.",
)
CHECKPOINT_SYNC_SECONDS: Setting[float] = Setting(
    Env.CHECKPOINT_SYNC_SECONDS,
    30.0,
    parse_positive_seconds,
    "give a number of seconds > 0",
    (JOB,),
    "How often the job uploads what changed in `KINETIC_CHECKPOINT_DIR` (and once more at the end).",
)
LOCAL_DEVICES: Setting[tuple[str, ...] | None] = Setting(
    Env.LOCAL_DEVICES,
    None,
    parse_names,
    "give JAX platform names, comma-separated (e.g. cuda), or nothing for the CPU only",
    (WORKER,),
    "kinetic-local: the devices a job may use (e.g. `cuda`), instead of those detected; blank: the CPU only.",
    default_doc="detected (`/dev/nvidia*`, `/dev/accel*`)",
    blank_is_a_value=True,
)
PROJECT_DIR: Setting[str | None] = Setting(
    Env.PROJECT_DIR,
    None,
    parse_text,
    "give this machine's checkout of the project",
    (WORKER,),
    "The project checkout a deployment's `set_project_directory` pull step changes into, on the worker's machine.",
)

TABLE: tuple[Setting[Any], ...] = (
    STORE,
    WORK_POOL,
    CACHE_DIR,
    IN_PROCESS_CONCURRENCY,
    SWEEP_SLOTS,
    EPHEMERAL_STARTUP_SECONDS,
    PAYLOAD_CACHE,
    PAYLOAD_WARN_BYTES,
    UNSIGNED_OK,
    SIGNING_KEY,
    SIGNING_KEY_PREVIOUS,
    UNSIGNED_SHARED_STORE,
    API_OUTAGE_SECONDS,
    DEBUG_WAIT_SECONDS,
    DEBUG_LOCAL_PORT,
    USAGE_SAMPLE_SECONDS,
    CHECKPOINT_SYNC_SECONDS,
    LOCAL_DEVICES,
    PROJECT_DIR,
)

# The wire protocol: set for one job by the worker (or for the function by the runner); not tunable.
SET_BY_THE_WORKER: dict[str, str] = {
    Env.RUN_ID: "The run's id in the store.",
    Env.RUN_PREFIX: "The run's prefix in the store (`runs/<id>`), for jobs of kinetic-prefect 0.1.",
    Env.FLOW_RUN_ID: "The job's Prefect flow run.",
    Env.PAYLOAD_SHA256: "The payload's content hash, checked before it is unpickled.",
    Env.CODE_KEY: "The project archive's key in the store.",
    Env.CODE_SHA256: "The project archive's content hash.",
    Env.CHECKPOINT_KEY: "Where the task run's checkpoints live in the store.",
    Env.ACCELERATOR: "The accelerator this attempt runs on (a fallback list's choice).",
    Env.ACCELERATOR_CHIPS: "The chips one host sees (0 on the CPU).",
    Env.PREEMPTIONS: "How often this call was preempted before this attempt.",
    Env.INSTALL_REQUIREMENTS: "kinetic-gke in prebuilt mode (`install_requirements_at_start`): the requirements the "
    "pod pip-installs as it starts (JSON list).",
    Env.OUTPUT_DIR: "Set by the runner: the folder whose files are uploaded as the job's outputs.",
    Env.CHECKPOINT_DIR: "Set by the runner: the folder kept in the store between attempts.",
    Env.NODE_CACHE: "A cache folder on the node that outlives the job.",
    Env.OWNER_PID: "In-process submission: the calling process; the job stops when it dies.",
    Env.OWNER_HEARTBEAT: "In-process submission on another machine (kinetic-vertex, kinetic-gke): the seconds "
    "after which a caller that stopped rewriting the run's heartbeat record counts as gone; the job then stops.",
    Env.JOB_DIR: "kinetic-local: the launcher's folder for this job.",
    Env.PREFECT_API_URL: "The Prefect API the job reports progress to.",
    Env.PREFECT_API_KEY: "The key for that API.",
    Env.ENV_BLOCK: "A polling worker's Secret block holding the call's forwarded `env=` values.",
    Env.NUM_HOSTS: "A multi-host group's size.",
    Env.HOST_INDEX: "This host's index in its group (0: the coordinator).",
    Env.COORDINATOR_ADDRESS: "host:port of host 0 (jax.distributed's coordinator).",
    Env.FUSE_ROOT: "kinetic-gke: the folder under which `Data(..., fuse=True)` is mounted.",
    Env.SIGNED: "The caller signed this job's objects, so the job insists on a key.",
    Env.JOB_SIGNATURE: "The caller's signature over the run's job variables; the worker checks it before it launches.",
    Env.WARM_LAUNCHER_PID: "kinetic-local: the process that started a warm runner.",
    Env.WARM_CONTROL: "kinetic-gke: a warm pod's control prefix in the store.",
    Env.WARM_KEEP_SECONDS: "A warm pod's idle time before it leaves (the pool's `keep_warm_seconds`).",
    Env.WARM_FLOOR: "kinetic-gke: a floor pod's pool, accelerator and Job, for the idle time it bills as it leaves.",
    Env.SWEEP_ID: "A sweep's slot job: the sweep whose queued inputs it takes (`sweeps/<id>/` in the store).",
    Env.SLOT_IDLE_SECONDS: "A slot job's idle time with nothing queued before it leaves (`keep_warm_seconds`).",
    Env.DEBUG: "`debug=True`: 1, the job waits for a debugger.",
    Env.DEBUG_PORT: "The port debugpy listens on in the job.",
    Env.DEBUG_CALLER_ROOT: "The caller's project root (the editor's side of pathMappings).",
    Env.DEBUG_SOURCES: "The by-value modules' files under the project root.",
    Env.POD_NAME: "kinetic-gke, debug mode: the pod's own name.",
    Env.POD_NAMESPACE: "kinetic-gke, debug mode: the pod's namespace.",
}


# --------------------------------------------------------------------------- the generated page

PAGE_PATH = "docs/reference/settings.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_page() -> str:
    lines = [
        "# Settings",
        "",
        "<!-- Generated by `uv run python -m kinetic_prefect.contract.settings --write "
        f"{PAGE_PATH}` from kinetic_prefect/contract/settings.py; do not edit. -->",
        "",
        "Every `KINETIC_*` environment variable. A setting is read when it is used, so a change applies to the",
        "next call; a bad value fails with an error naming the variable. *Where* says which process reads it:",
        "the caller (your flow), the worker, or the job.",
        "",
        "| Variable | Default | Where | What |",
        "|---|---|---|---|",
    ]
    for setting in TABLE:
        lines.append(
            f"| `{setting.name}` | {_cell(setting.shown_default)} | {', '.join(setting.sides)} | {_cell(setting.doc)} |"
        )
    lines += [
        "",
        "## Set by the worker",
        "",
        "These carry one job's facts from the worker (or the runner) to the job; nobody sets them by hand.",
        "",
        "| Variable | What |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(doc)} |" for name, doc in SET_BY_THE_WORKER.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    usage = f"usage: python -m kinetic_prefect.contract.settings [--write PATH | --check PATH] (PATH: {PAGE_PATH})"
    if len(argv) not in (0, 2) or (argv and argv[0] not in ("--write", "--check")):
        print(usage, file=sys.stderr)
        return 2
    page = markdown_page()
    if not argv:
        print(page, end="")
        return 0
    flag, path = argv
    if flag == "--write":
        with open(path, "w", encoding="utf-8") as out:
            out.write(page)
        return 0
    try:
        with open(path, encoding="utf-8") as committed:
            current = committed.read() == page
    except FileNotFoundError:
        current = False
    if not current:
        print(
            f"{path} is out of date: run `uv run python -m kinetic_prefect.contract.settings --write {path}`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
