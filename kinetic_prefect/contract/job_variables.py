"""The pool templates' variables every pool shares, typed: ``CallVariables``, the base of each launcher's own model
(``workers/<launcher>/variables.py``), names what ``@kinetic_task`` sends with every call (caller/job_settings.py
builds exactly these keys); and the rules of what a call may set on a pool (``CALLER_VARIABLES``, ``WORKER_ONLY_ENV``).

The ``variables`` of ``work_pools/<type>.json`` are generated from the launchers' models (pydantic's JSON schema, as
prefect-kubernetes does with its ``BaseVariables``), and the ``job_configuration`` from the worker's job
configuration: ``python -m kinetic_prefect.workers.templates`` writes them, a test checks the committed files.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect.workers.base import BaseVariables
from pydantic import Field

from kinetic_prefect.contract import Env

GCP_CREDENTIALS_TITLE = "GCP credentials block"


def pool_default(pool: Any, variable: str) -> Any:
    """The default of ``variable`` in a work pool's base job template (None when the template has none)."""
    return pool.base_job_template.get("variables", {}).get("properties", {}).get(variable, {}).get("default")


class CallVariables(BaseVariables):
    """What every kinetic pool takes, and what ``@kinetic_task`` sets for each call (``env`` included).

    Defaults are written out (``{}``, ``[]``; pydantic copies them per instance) so the form shows them.
    """

    name: str | None = Field(default=None, title="Name", description="Name given to the job.")
    env: dict[str, str | None] = Field(
        default={}, title="Environment variables", description="Environment variables set in the job."
    )
    labels: dict[str, str] = Field(default={}, title="Labels", description="Labels recorded for the job.")
    command: str | None = Field(
        default=None,
        title="Command",
        description="Command that starts the job. Leave empty: the worker runs the kinetic job runner.",
    )
    accelerator: str = Field(default="cpu", title="Accelerator")
    image_tag: str | None = Field(
        default=None,
        title="Environment tag",
        description="ImageSpec tag of the job environment; set by @kinetic_task for each call.",
    )
    requirements: list[str] = Field(
        default=[],
        title="Requirements",
        description="Normalized requirements of the job environment (PEP 508). Empty: the worker's own interpreter.",
    )
    python_version: str | None = Field(
        default=None,
        title="Python version",
        description="Python minor version for built environments (e.g. 3.11). Empty: the caller's.",
    )
    base_image: str | None = Field(
        default=None,
        title="Base image",
        description="Base image of built job images (part of the environment's hash; kinetic-local ignores it).",
    )
    store: str | None = Field(default=None, title="Artifact store")
    hosts: int | None = Field(default=None, title="Hosts", ge=1)
    max_cost_usd: float | None = Field(
        default=None,
        title="Budget per job (USD)",
        gt=0,
        description="Default budget of each job on this pool: the worker stops a job when its metered cost (hosts x "
        "minutes x price) reaches it, and its run ends Failed (not retried; checkpoints and outputs "
        "kept). @kinetic_task(max_cost_usd=...) sets it per task. Empty: no budget.",
    )
    prices: dict[str, Any] | None = Field(
        default=None,
        title="Prices (USD per hour)",
        description="Price overrides by accelerator name, for another region, a committed-use discount or a private "
        'price sheet: {"l4": {"on_demand": 0.85, "spot": 0.34, "unit": "host"}} (unit host: a whole node; '
        "chip: one TPU chip). Empty: the built-in us-central1 "
        "list prices (kinetic_prefect/shared/prices.py).",
    )
    preemption_retries: int = Field(
        default=3,
        title="Preemption retries",
        ge=0,
        description="How often a job the infrastructure takes away (a spot preemption, a lost node; on kinetic-local "
        "a SIGTERM from outside the worker) is started again under the same run, resuming from "
        f"{Env.CHECKPOINT_DIR}. Separate from the task's `retries`, which it never spends. 0: a "
        "preemption crashes the run.",
    )
    spot_fallback: bool = Field(
        default=False,
        title="Spot fallback",
        description="For a spot job: run its last preemption retry on on-demand capacity, so that a run preempted "
        "preemption_retries times still finishes.",
    )
    capacity_wait_seconds: int = Field(
        default=300,
        title="Capacity wait seconds",
        ge=0,
        description="With a fallback list (accelerator=['a100x4', 'l4x4']): how long a pod whose node pool exists "
        "but is full (or whose scale-up failed) waits before the next accelerator is tried. A list entry "
        "no node pool carries is left at once.",
    )


class PoolVariables(CallVariables):
    """The variables every pool shares, the base of each launcher's model (``workers/<launcher>/variables.py``): what
    a call sends (``CallVariables``), and the pool's own settings every launcher reads, which no call sends."""

    gcp_credentials: str | None = Field(
        default=None,
        title=GCP_CREDENTIALS_TITLE,
        description="Name of a saved prefect-gcp GcpCredentials block, used for a gs:// store and its results block, "
        "and where the pool builds images or calls Google's APIs, for Cloud Build / Artifact Registry / Vertex AI "
        "(e.g. my-gcp). Empty: Application Default Credentials.",
    )
    stream_output: bool = Field(
        default=True,
        title="Stream output",
        description="Forward the job's stdout/stderr to the flow run's logs as it runs.",
    )


class ImageBuildVariables(BaseVariables):
    """What every pool whose launcher runs container images (its abilities' ``runs_images``) builds a missing image
    with: the builder, where the image is pushed, where Cloud Build's context is staged."""

    image_builder: Literal["cloud-build", "docker", "none"] = Field(
        default="none",
        title="Image builder",
        description="How missing images are built: Cloud Build, a local Docker engine, or none (image required).",
    )
    image_repository: str | None = Field(
        default=None,
        title="Image repository",
        description="Registry path images are pushed to, e.g. us-docker.pkg.dev/PROJECT/REPO.",
    )
    build_staging_bucket: str | None = Field(
        default=None,
        title="Build staging bucket",
        description="GCS bucket where build contexts are uploaded for Cloud Build.",
    )


class WarmVariables(BaseVariables):
    """What every pool whose launcher reuses jobs takes (its abilities' ``warm_reuse``): a warm runner is a job that
    takes the next call of its environment, a process on kinetic-local, a pod on kinetic-gke."""

    keep_warm_seconds: float = Field(
        default=0,
        title="Keep warm (seconds)",
        ge=0,
        description="How long a runner (a process; on kinetic-gke a pod) that finished a call waits for the next "
        "call of the same environment (interpreter or image, accelerator, resources, environment variables) before "
        "it ends; 0 starts a fresh one per call. A sweep then pays one start (on kinetic-gke a pod start, image pull "
        "and JAX initialisation) per concurrent slot instead of one per input. Single-host jobs only (on kinetic-gke "
        "without a fallback list).",
    )
    min_warm: int = Field(
        default=0,
        title="Minimum warm runners",
        ge=0,
        description="How many runners of an environment wait for calls however long they wait (or for "
        "warm_floor_idle_seconds): a process on kinetic-local until the worker (or the calling process for in-process "
        "submission) ends, a pod on kinetic-gke until `kinetic-prefect warm down` ends it; the next sweep starts on "
        "them at once, and the accelerators a pod holds are billed all the while. Needs keep_warm_seconds > 0.",
    )
    warm_floor_idle_seconds: float | None = Field(
        default=None,
        title="Floor runners' idle limit (seconds)",
        ge=0,
        description="How long a min_warm runner waits idle before it ends (the next call starts the floor again); "
        "empty: until its worker ends (kinetic-local) or `kinetic-prefect warm down` ends it (kinetic-gke). "
        "`kinetic-prefect warm list|down` show and end warm runners and floor pods.",
    )


# ---------------------------------------------------------------------------------------------- what a call may set
# A flow run's job variables are whatever its creator sent, and anyone who may create a flow run on a pool may send
# any (issue 45, finding 7). A call may set these: what @kinetic_task sends (caller/job_settings.py) and what the docs
# tell a task to set through job_variables= (warm runners, prices, the capacity settings). Each pool type's variables
# model names its own list (``caller_variables``); the pool pins every other variable (where and as whom a job runs,
# its command, what it inherits from the machine, the credentials it reads with), and a worker refuses a run that
# sets one to anything but the pool's value, before it starts anything or hands over a key.
CALLER_VARIABLES = frozenset(
    {
        "env",  # but never a name in WORKER_ONLY_ENV
        "accelerator",
        "image_tag",
        "requirements",
        "python_version",
        "base_image",
        "store",
        "hosts",
        "max_cost_usd",
        "prices",
        "preemption_retries",
        "spot_fallback",
        "capacity_wait_seconds",
        "keep_warm_seconds",
        "min_warm",
    }
)
# Environment names only a worker sets for its job (its key hand-over, the in-process owner's way to Prefect, a warm
# runner's or pod's control) or that no job gets (Prefect's credentials and its server's settings): a call's ``env``
# may not name them. A kinetic-local launcher also drops the Prefect ones whatever sets them (the worker's own
# Prefect settings, inherit_env patterns, the pool's env).
WORKER_ONLY_ENV = frozenset(
    {
        Env.SIGNING_KEY,
        Env.SIGNING_KEY_PREVIOUS,
        Env.OWNER_PID,
        Env.OWNER_HEARTBEAT,
        Env.PREFECT_API_URL,
        Env.PREFECT_API_KEY,
        Env.JOB_DIR,
        Env.WARM_LAUNCHER_PID,
        Env.WARM_CONTROL,
        Env.WARM_KEEP_SECONDS,
        Env.WARM_FLOOR,
    }
)
PREFECT_SECRET_ENV = frozenset({"PREFECT_API_KEY", "PREFECT_API_AUTH_STRING"})
PREFECT_SERVER_ENV_PREFIXES = ("PREFECT_API_DATABASE_", "PREFECT_SERVER_")
POOL_FIX = (
    "edit the pool (`prefect work-pool update POOL --base-job-template FILE`, or its form in the UI), not the call"
)


def never_a_jobs(name: str) -> bool:
    """A Prefect credential or server setting: no job gets it (issue 45, finding 3)."""
    return name in PREFECT_SECRET_ENV or name.startswith(PREFECT_SERVER_ENV_PREFIXES)


# What a forwarded env= value may never set (issue 54, finding 2): it goes over the job's signed environment, so it
# would otherwise choose the job's run, code, keys or debugger (the kinetic names a caller or worker sets for a job),
# or which code the interpreter and the loader run before anything is checked. The caller refuses them when a call
# is prepared; a worker refuses a run whose forwarded values name them.
FORWARD_REFUSED_ENV = frozenset(
    {
        *WORKER_ONLY_ENV,
        Env.STORE,
        Env.RUN_ID,
        Env.RUN_PREFIX,
        Env.FLOW_RUN_ID,
        Env.PAYLOAD_SHA256,
        Env.CODE_KEY,
        Env.CODE_SHA256,
        Env.CHECKPOINT_KEY,
        Env.ENV_BLOCK,
        Env.SIGNED,
        Env.JOB_SIGNATURE,
        Env.UNSIGNED_SHARED_STORE,
        Env.SWEEP_ID,
        Env.NUM_HOSTS,
        Env.HOST_INDEX,
        Env.COORDINATOR_ADDRESS,
        Env.FUSE_ROOT,
        Env.OUTPUT_DIR,
        Env.CHECKPOINT_DIR,
        Env.NODE_CACHE,
        Env.ACCELERATOR,
        Env.ACCELERATOR_CHIPS,
        Env.PREEMPTIONS,
        Env.INSTALL_REQUIREMENTS,
        Env.DEBUG,
        Env.DEBUG_PORT,
        Env.DEBUG_SOURCES,
        Env.DEBUG_CALLER_ROOT,
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONUSERBASE",
        "PYTHONINSPECT",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "DYLD_INSERT_LIBRARIES",
        "DYLD_LIBRARY_PATH",
        "BASH_ENV",
    }
)


def forward_refused(names: Any) -> list[str]:
    """The names among ``names`` (a call's forwarded env=) that no forwarded value may set."""
    return sorted(str(n) for n in names if n in FORWARD_REFUSED_ENV or never_a_jobs(str(n)))


def sent_variables(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """What job variables set, read as Prefect's worker reads them: a deployment's, then the run's over them (``env``
    merged), and dotted names (``"env.X"``, ``"command.y"``) nested under their variable."""
    from prefect.utilities.collections import deep_merge, set_in_dict

    merged: dict[str, Any] = {}
    for layer in layers:
        for name, value in (layer or {}).items():
            if name == "env" and isinstance(value, dict) and isinstance(merged.get("env"), dict):
                merged["env"] = {**merged["env"], **value}
            else:
                merged[name] = value
    nested: dict[str, Any] = {}
    for name, value in merged.items():
        if "." in name:
            set_in_dict(nested, name, value)
    for name, value in merged.items():
        if "." not in name:
            both_dicts = isinstance(nested.get(name), dict) and isinstance(value, dict)
            nested[name] = deep_merge(nested[name], value) if both_dicts else value
    return nested


def pinned_overrides(
    allowed: frozenset[str], sent: dict[str, Any], base_job_template: dict[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """The variables ``sent`` sets that ``allowed`` does not list, to a value other than the pool's: name -> (sent,
    the pool's). A variable the pool's template lacks counts as pinned to None."""
    properties = base_job_template.get("variables", {}).get("properties", {})
    found = {}
    for name, value in sent.items():
        pinned = properties.get(name, {}).get("default")
        if name not in allowed and value != pinned:
            found[name] = (value, pinned)
    return found


def reserved_env_names(env: Any) -> list[str]:
    """The names of ``env`` (a call's) that only a worker sets or no job gets."""
    if not isinstance(env, dict):
        return []
    return sorted(name for name in env if name in WORKER_ONLY_ENV or never_a_jobs(str(name)))


def override_refusal(pool_name: str, allowed: frozenset[str], found: dict[str, tuple[Any, Any]]) -> str:
    """The words of a refusal of pinned variables: what was set, what the pool has, and the fix."""

    def shown(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."

    settings = "; ".join(
        f"{name}={shown(sent)} (the pool has {shown(pinned)})" for name, (sent, pinned) in sorted(found.items())
    )
    names = ", ".join(sorted(found))
    return (
        f"Refused: the job variables set {settings}, which pool {pool_name!r} pins. A call may set only "
        f"{', '.join(sorted(allowed))}; {names} {'is' if len(found) == 1 else 'are'} the pool's to set: "
        f"{POOL_FIX.replace('POOL', pool_name)}. Nothing was started."
    )


def env_refusal(pool_name: str, names: list[str]) -> str:
    """The words of a refusal of worker-only environment names in a call's ``env``."""
    return (
        f"Refused: the job variables' env sets {', '.join(names)}, which only the worker of pool {pool_name!r} "
        "sets for a job (its signing keys, its way to Prefect) or which no job gets (Prefect's credentials and "
        "server settings). Drop them from the call's env. Nothing was started."
    )


# Set by the caller only where the pool's template takes them (older templates lack them).
# prices and the capacity settings: set on the pool, or per task through job_variables
OPTIONAL_CALL_VARIABLES = frozenset(
    {"hosts", "image", "max_cost_usd", "prices", "preemption_retries", "spot_fallback", "capacity_wait_seconds"}
)
