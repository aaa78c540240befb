"""The hand-overs between a launcher and a long-lived runner: a warm runner's control folder (kinetic-local), a
warm pod's control prefix in the store (kinetic-gke) and a sweep's queue for its slot jobs (stdlib only; ships
to the pod)."""

from __future__ import annotations

from dataclasses import dataclass

from kinetic_prefect.contract.env import Env


class WarmRunnerFiles:
    """The hand-over between a launcher and a warm runner (see warm_runner.py): files in the runner's control
    folder, except EXIT_STATUS, which the runner writes into the call's own job folder."""

    IDLE = "idle"  # the runner waits for a call; the launcher claims it by renaming this to CLAIMED
    CLAIMED = "claimed"
    LEAVING = "leaving"  # the runner's keep-warm time is over (renamed from IDLE, so no claim can race it)
    CALL = "call.json"  # {"job_dir", "log", "env", "keep_warm_seconds"}
    EXIT_STATUS = "exit_status"  # the call's runner exit status (EXIT_OUTCOME_RECORDED, EXIT_NO_OUTCOME...)
    # The runner left by itself, idle: {"idle_since", "left_at" (epoch seconds), "calls", "why": LEFT_IDLE_LIMIT or
    # LEFT_LAUNCHER_GONE}, written before it exits; its launcher bills a floor runner's idle time to the pool from it.
    LEFT = "left.json"
    LEFT_IDLE_LIMIT = "idle limit"
    LEFT_LAUNCHER_GONE = "launcher gone"

    @staticmethod
    def exit_status_name(host_index: int) -> str:
        """The exit record a runner writes into its job folder as it ends (a cold job's too): its contents are
        the exit status, its modification time is when the host's work ended, which metering bills up to."""
        return WarmRunnerFiles.EXIT_STATUS if host_index == 0 else f"{WarmRunnerFiles.EXIT_STATUS}-{host_index}"

    # Variables that differ from call to call of one environment; every other one must match for a runner to
    # take a call (a variable read at import time, such as XLA_FLAGS, could not change in a running process).
    PER_CALL_ENV = (
        Env.RUN_ID,
        Env.RUN_PREFIX,
        Env.PAYLOAD_SHA256,
        Env.CODE_KEY,
        Env.CODE_SHA256,
        Env.CHECKPOINT_KEY,
        Env.FLOW_RUN_ID,
        Env.ENV_BLOCK,
        Env.JOB_DIR,  # the call's own folder (its working copy of the project, its log)
        Env.JOB_SIGNATURE,  # the caller's signature over this call's job variables (checked by the worker)
    )
    PER_CALL_ENV_PREFIXES = ("PREFECT__",)  # Prefect's own per-run variables (PREFECT__FLOW_RUN_ID...)

    @classmethod
    def is_per_call(cls, name: str) -> bool:
        return name in cls.PER_CALL_ENV or name.startswith(cls.PER_CALL_ENV_PREFIXES)


class WarmPodKeys:
    """The hand-over between the kinetic-gke launcher and its warm pods, through the store (a pod and the worker
    share no folder; the store's create-if-absent stands in for the local runner's rename). Under one pod's
    control prefix ``warm/<environment key>/<job name>/``:

    * the pod writes ``ready-<n>`` once it has served n calls and waits for call n (its content: ``idle_since``,
      the time it began to wait);
    * whoever creates ``claim-<n>`` first owns call n: a launcher handing over a call, or the pod itself leaving
      (its keep-warm time is over), so a claim and a departure cannot both win;
    * the winning launcher writes ``call-<n>.json`` (the call's per-call variables); the pod takes it, runs it
      between the CALL_BEGIN and CALL_END lines of its log, and writes the call's ``RunLayout.warm_exit``.
    """

    ROOT = "warm"

    @staticmethod
    def control(environment_key: str, job_name: str) -> str:
        return f"warm/{environment_key}/{job_name}"

    @staticmethod
    def ready(n: int) -> str:
        return f"ready-{n}"

    @staticmethod
    def claim(n: int) -> str:
        return f"claim-{n}"

    @staticmethod
    def call(n: int) -> str:
        return f"call-{n}.json"

    RUNS = "warm/runs/"  # the prefix of every ``run`` record: a restarted worker lists it

    @staticmethod
    def run(flow_run_id: str) -> str:
        """Which pod serves a flow run (``namespace:job@flow_run_id``): a restarted worker finds its calls again."""
        return f"{WarmPodKeys.RUNS}{flow_run_id}"

    LEAVING = b"leaving"  # the content of a claim the pod made to leave

    # A floor pod that left by its idle limit: its idle time, for whoever reaches Prefect to bill to its pool
    # (``Env.WARM_FLOOR`` and {"idle_since", "left_at", "calls"}), outside its control prefix (deleted as it leaves).
    # The one that creates ``billed(job)`` first publishes it, then deletes both.
    LEFT = "warm/left/"

    @staticmethod
    def left(job_name: str) -> str:
        return f"{WarmPodKeys.LEFT}{job_name}.json"

    @staticmethod
    def billed(job_name: str) -> str:
        return f"{WarmPodKeys.LEFT}{job_name}.billed"


@dataclass(frozen=True)
class SweepKeys:
    """The hand-over between a sweep's caller and its slot jobs, through the store (``sweeps/<sweep id>/``).

    * the caller writes ``queue/<seq>-<run id>.json`` per input (its per-call variables, the input's task run),
      signed as a payload is when the store is signed;
    * a slot takes an input by creating ``claims/<run id>`` (create-if-absent: a rename-free create on a local
      store, ``ifGenerationMatch=0`` on GCS), so no input runs twice; a caller that stops waiting before any slot
      took its input withdraws it the same way (content WITHDRAWN);
    * the slot runs the input with the input's own ``RunLayout`` (payload, result, outcome); while it runs, the
      input's output goes to ``logs/<run id>/<n>`` in chunks of whole lines (n = 0, 1, ...: the caller forwards
      each new chunk to the input's task run as it appears), and ``done/<run id>`` ({"exit_code", "slot",
      "stopped", "status", "error_type", "seconds"}) is written last, after the last chunk;
    * ``stop/<run id>``: the caller stopped waiting for that input (timeout, interrupt, fail_fast): its slot
      stops it; ``closed``: no input is left to come, idle slots leave.
    """

    sweep_id: str

    ROOT = "sweeps"
    WITHDRAWN = b"withdrawn"
    QUEUED_SUFFIX = ".json"

    @property
    def prefix(self) -> str:
        return f"{self.ROOT}/{self.sweep_id}"

    @property
    def queue(self) -> str:
        return f"{self.prefix}/queue/"

    def queued(self, seq: int, run_id: str) -> str:
        return f"{self.queue}{seq:06d}-{run_id}{self.QUEUED_SUFFIX}"

    @classmethod
    def run_id_of(cls, queued_key: str) -> str:
        return queued_key.rsplit("/", 1)[-1].split("-", 1)[1].removesuffix(cls.QUEUED_SUFFIX)

    @property
    def claims(self) -> str:
        return f"{self.prefix}/claims/"

    def claim(self, run_id: str) -> str:
        return f"{self.claims}{run_id}"

    @property
    def done_prefix(self) -> str:
        return f"{self.prefix}/done/"

    def done(self, run_id: str) -> str:
        return f"{self.done_prefix}{run_id}"

    def stop(self, run_id: str) -> str:
        return f"{self.prefix}/stop/{run_id}"

    @property
    def logs(self) -> str:
        return f"{self.prefix}/logs/"

    def log_prefix(self, run_id: str) -> str:
        return f"{self.logs}{run_id}/"

    def log_chunk(self, run_id: str, n: int) -> str:
        return f"{self.log_prefix(run_id)}{n:06d}"

    @staticmethod
    def log_chunk_of(chunk_key: str) -> tuple[str, int]:
        """(run id, n) of a ``log_chunk`` key."""
        run_id, n = chunk_key.rstrip("/").rsplit("/", 2)[-2:]
        return run_id, int(n)

    @property
    def closed(self) -> str:
        return f"{self.prefix}/closed"
