"""Where everything lives in the store: a run's objects (``RunLayout``), checkpoints, the code archive, Data,
locks, results, and the files manifests (stdlib only; ships to the pod)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLayout:
    """Where one job's objects live in the store."""

    run_id: str

    ROOT = "runs"

    @property
    def prefix(self) -> str:
        return f"{self.ROOT}/{self.run_id}"

    @property
    def payload(self) -> str:
        return f"{self.prefix}/payload.pkl"

    @property
    def result(self) -> str:
        return f"{self.prefix}/result.pkl"

    @property
    def outcome(self) -> str:
        """Written last: its presence means the result is complete."""
        return f"{self.prefix}/outcome.json"

    @property
    def outputs(self) -> str:
        return f"outputs/{self.run_id}"

    def output(self, relative: str) -> str:
        return f"{self.outputs}/{relative}"

    @property
    def warm_exit(self) -> str:
        """A warm pod's record of one call it ran: {"exit_code", "started", "ended"} (epoch seconds)."""
        return f"{self.prefix}/warm_exit.json"

    @property
    def owner_heartbeat(self) -> str:
        """An in-process caller's proof of life for a job on another machine, rewritten every few seconds while it
        follows the job (``Env.OWNER_HEARTBEAT``); deleted once it stops following."""
        return f"{self.prefix}/owner_heartbeat.json"

    @property
    def capacity(self) -> str:
        """The worker's record of the attempts (fallbacks, preemptions) and the accelerator that ran."""
        return f"{self.prefix}/capacity.json"

    @property
    def debugger(self) -> str:
        """A debug job's record of where its debugpy listens: {"host", "port", "pod", "namespace", "pid",
        "remote_root", "caller_root"}; written by the runner once it listens, before it waits for a client."""
        return f"{self.prefix}/debugger.json"

    def host_outputs(self, index: int) -> str:
        """A non-coordinator host's outputs; the coordinator's are ``outputs`` itself."""
        return f"{self.outputs}/hosts/{index}" if index else self.outputs

    def host_outcome(self, index: int) -> str:
        """A non-coordinator host's own outcome record (for the failure report); host 0 writes ``outcome``."""
        return f"{self.prefix}/hosts/{index}/outcome.json" if index else self.outcome

    def host_outputs_manifest(self, index: int) -> str:
        """The signed list of one host's outputs (``files_manifest_key`` of ``host_outputs(index)``)."""
        return files_manifest_key(self.host_outputs(index))


def job_variables_name(run_id: str) -> str:
    """What a job run's variables are signed as: no object is stored under it, and it is in the store's own
    scope, which no job holds a key for."""
    return f"job-variables/{run_id}"


# A polling worker's forwarded env= values travel in the Prefect Secret block ENV_BLOCK_PREFIX + <run id>; the worker
# reads no other block for a run.
ENV_BLOCK_PREFIX = "kinetic-env-"


def env_block(run_id: str) -> str:
    """The Secret block a run's forwarded env= values travel in (to a polling worker)."""
    return f"{ENV_BLOCK_PREFIX}{run_id}"


def env_block_signed_name(run_id: str) -> str:
    """What a run's forwarded-env block's content is signed as: no object is stored under it; the store's own scope,
    which no job holds a key for, so only a key holder's caller can have written it."""
    return f"env-blocks/{run_id}"


def checkpoints_key(task_run_or_run_id: str) -> str:
    """Keyed by the *task run*: a retry (a new job) resumes from what the killed one saved."""
    return f"checkpoints/{task_run_or_run_id}"


# The signed list of the files under a checkpoint folder or a host's outputs: {relative path: [[size, sha256], ...]}
# (every version the store may hold; one, once a save is complete). Written last, so it also marks them complete;
# a reader with the key uses only the files it lists, each checked against its sha256.
FILES_MANIFEST_NAME = ".kinetic-manifest.json"


def files_manifest_key(prefix: str) -> str:
    """The manifest of the files under ``prefix`` (a ``checkpoints_key`` or a ``RunLayout.host_outputs``)."""
    return f"{prefix.rstrip('/')}/{FILES_MANIFEST_NAME}"


def code_key(sha256: str) -> str:
    """The project archive, stored once per content hash and shared by every run that ships it."""
    return f"code/{sha256}.tar.gz"


# Where kinetic-gke mounts the Cloud Storage FUSE volumes of Data(..., fuse=True), one directory per mount id;
# Kinetic reserves the same prefix, so a volumes= mount path below it is refused.
FUSE_MOUNT_ROOT = "/_kinetic/fuse-data"


def data_key(sha256: str) -> str:
    """An uploaded ``Data`` argument (a file or folder), stored once per content hash."""
    return f"data/{sha256}"


def data_files_key(key: str) -> str:
    """Under a ``data_key``: the files themselves, as the caller's tree had them."""
    return f"{key}/files"


def data_manifest_key(key: str) -> str:
    """Under a ``data_key``: the manifest, written last (first writer wins), so its presence means complete."""
    return f"{key}/manifest.json"


def lock_key(name: str) -> str:
    """A cache-isolation lock (locks.py); ``name`` is already safe as a key."""
    return f"locks/{name}.json"


def results_prefix(store_prefix: str) -> str:
    """Where Prefect's result storage keeps task results, under the store's own prefix."""
    return f"{store_prefix}/results" if store_prefix else "results"
