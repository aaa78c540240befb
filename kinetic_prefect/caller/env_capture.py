"""Which of the caller's environment variables a call forwards to its job (``env=`` / Kinetic's ``capture_env_vars``).

A forwarded value replaces the job's own, so a pattern that sweeps in the caller's process configuration (a local
``PATH``, ``VIRTUAL_ENV``, ``LD_PRELOAD``, ``KERAS_BACKEND=torch``, the caller's own ``KINETIC_*`` and ``PREFECT_*``
settings) breaks the job before the user's code runs. Patterns therefore never match these names; a name given
exactly still forwards it. The list is Keras Kinetic's (``kinetic/core/core.py``), plus the prefixes of the
variables that configure an interpreter, a loader or this project's own job.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Mapping
from typing import Literal

from kinetic_prefect.contract import ENV_NAME_PREFIX
from kinetic_prefect.contract.job_variables import forward_refused

PATTERN_SKIPPED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "PYTHONPATH",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "SHELL",
        "TMPDIR",
        "TEMP",
        "TMP",
        "HOSTNAME",
        "USER",
        "LOGNAME",
        "SSH_AUTH_SOCK",
        "KUBERNETES_SERVICE_HOST",
        "KERAS_BACKEND",
        "PWD",
        "OLDPWD",
    }
)
# Every name with one of these prefixes is the caller's process or tooling, never the job's.
PATTERN_SKIPPED_PREFIXES = ("LD_", "PYTHON", "CONDA_", "UV_", ENV_NAME_PREFIX, "PREFECT_", "KUBERNETES_", "DYLD_")

MissingNames = Literal["error", "warn"]
ENV_MISSING_CHOICES: tuple[MissingNames, ...] = ("error", "warn")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger when there is one (the lines show on its page), else the package's."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("kinetic_prefect")


def is_pattern(entry: str) -> bool:
    return any(ch in entry for ch in "*?[")


def skipped_by_patterns(name: str) -> bool:
    """Whether a pattern (not an exact name) leaves ``name`` behind."""
    return name in PATTERN_SKIPPED_NAMES or name.startswith(PATTERN_SKIPPED_PREFIXES)


def check_entries(entries: tuple[str, ...], missing: str) -> None:
    """Fail at decoration for an entry that cannot be a variable name or pattern, or an unknown ``env_missing``."""
    if missing not in ENV_MISSING_CHOICES:
        raise ValueError(f"env_missing={missing!r}: give 'error' (an unset exact name fails the call) or 'warn'")
    for entry in entries:
        if not isinstance(entry, str) or not entry or "=" in entry:
            raise ValueError(
                f"env={list(entries)!r}: {entry!r} is not a variable name or pattern; give names such as "
                "'WANDB_API_KEY' or patterns such as 'WANDB_*' (values are read from the calling process)"
            )


def forwarded_environment(
    entries: tuple[str, ...], missing: str = "error", environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The values a call forwards: exact names as given, pattern matches less the process's own configuration.

    An exact name that is not set fails the call before anything is uploaded (``missing="error"``, the
    ``@kinetic_task`` default: a task that names a variable needs it), or is left out with a warning
    (``"warn"``: Kinetic's rule, what ``kinetic.run(capture_env_vars=...)`` uses).
    """
    environ = os.environ if environ is None else environ
    exact = {entry for entry in entries if not is_pattern(entry)}
    values: dict[str, str] = {}
    skipped: set[str] = set()
    unset: list[str] = []
    for entry in entries:
        if not is_pattern(entry):
            if entry in environ:
                values[entry] = environ[entry]
            else:
                unset.append(entry)
            continue
        for name, value in environ.items():
            if not fnmatch.fnmatchcase(name, entry):
                continue
            if skipped_by_patterns(name) and name not in exact:
                skipped.add(name)
            else:
                values[name] = value
    if refused := forward_refused(values):
        raise ValueError(
            f"env={list(entries)!r}: {', '.join(refused)} cannot be forwarded: the job's signed variables or its "
            "worker set it (the job's run, code and keys, or which code the interpreter loads), and a forwarded value "
            "would go over that. Drop it from env=; the pool's env or job_variables={'env': {...}} set such names"
        )
    if unset and missing == "error":
        raise ValueError(
            f"env={list(entries)!r}: environment variable {unset[0]!r} is not set in the calling process; set it, "
            "or use a pattern (e.g. 'WANDB_*') for an optional variable, or env_missing='warn' to skip unset names"
        )
    if unset:
        _logger().warning("env: %s not set in the calling process; the job runs without it", ", ".join(unset))
    if skipped:
        _logger().info(
            "env: a pattern matched %s, the calling process's own configuration; not forwarded (name one exactly "
            "to forward it)",
            ", ".join(sorted(skipped)),
        )
    return values
