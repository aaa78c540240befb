"""Errors shared by the caller, the worker and the job runner (stdlib only: the runner imports it)."""

from __future__ import annotations


class KineticError(Exception):
    """Base class of kinetic-prefect's own errors."""


class PayloadError(KineticError, ValueError):
    """The call cannot be packaged (unpicklable argument, bad project directory...). Raised before upload."""


class KineticJobCrashed(KineticError, RuntimeError):
    """The job ended without reporting an outcome (killed, out of memory, node lost). Prefect retries it."""


class KineticJobSetupError(KineticError, RuntimeError):
    """The job runner failed before or after the user's function (fetching, verifying, unpickling...)."""

    def __init__(self, phase: str, message: str):
        super().__init__(f"job failed while {phase}: {message}")
        self.phase = phase


class RemoteError(KineticError):
    """Stands in for a remote exception whose type could not be pickled back to the caller."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class RemoteTraceback(Exception):
    """Attached as ``__cause__`` of a re-raised remote exception so the job's traceback prints too."""

    def __init__(self, traceback_text: str):
        super().__init__(traceback_text)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        return "\n\n" + self.traceback_text.rstrip() + "\n"


class ResultNotPicklable(KineticError, TypeError):
    """The function's return value cannot travel back to the caller (a generator, a lock, an open
    file...): the function's error, not the infrastructure's, so it is not retried."""


class KineticJobInterrupted(KineticError, RuntimeError):
    """The job's function raised KeyboardInterrupt: a failure of the job, not an interrupt of the caller."""


class KineticJobCancelled(KineticError, RuntimeError):
    """The job's run was cancelled (in the UI, by the CLI, or with its parent flow run)."""


class StoreTampered(KineticError, RuntimeError):
    """A store object failed its signature check; it was not used (see kinetic_prefect.signing)."""


class SigningKeyMissing(KineticError, RuntimeError):
    """Signed store objects (a job's outputs) are to be read by a process that holds no signing key to check them:
    nothing was read."""


class StoreFull(KineticError, OSError):
    """The store had no room for what the job wrote (ENOSPC or a quota): not retried, as a retry would meet the
    same full store. The message names the store and the object."""


class SigningKeyMismatch(KineticError, RuntimeError):
    """A store object was signed with another signing key than this side's: the caller and the worker were given
    different keys (not a forgery: the object is intact)."""


class BudgetExceeded(KineticError, RuntimeError):
    """The job's metered cost reached its ``max_cost_usd`` and the worker stopped it (its checkpoints and outputs
    are kept). Not retried: a retry would spend the same budget again."""


class FallbackPoolRefused(KineticError, ValueError):
    """An entry of a fallback list names a pool that does not exist or cannot run it (``"vx/tpu-v6e-8"`` on
    kinetic-vertex): refused before anything is uploaded, not on the day the pools before it have no capacity."""
