"""``kinetic-prefect doctor`` for a kinetic-local pool (``KineticLocalWorker.doctor``): the accelerators named with
``--accelerator`` are in the catalog; a job runs on this machine whatever the name (the accelerator is a wish); and
what a job can still reach of its worker, since it runs as the worker's user."""

from __future__ import annotations

import os
import sys
from typing import Any

from kinetic_prefect.shared.doctor import WARN, Report, check_accelerator_names

ISOLATION = "Isolation"  # a label no longer than the others: doctor's columns line up on the longest


def doctor(report: Report, client: Any, pool: Any, names: list[str], **_: Any) -> None:
    check_accelerator_names(report, names, "a kinetic-local job runs on this machine whatever the name")
    check_isolation(report)


def check_isolation(report: Report) -> None:
    """Jobs run as the worker's user, in no namespace of their own: say what that leaves them."""
    closed = (
        "the worker's environment and memory are closed to them (it makes itself non-dumpable)"
        if sys.platform.startswith("linux")
        else "on this system the worker's environment and memory are not closed to them (Linux only)"
    )
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    report.add(
        ISOLATION,
        WARN,
        f"kinetic-local jobs run as the worker's user: {closed}, and they get no master key and no Prefect "
        "credential, but they can read and write every file that user can: its PREFECT_HOME (profiles.toml holds "
        "PREFECT_API_KEY), a key file, the shared job environments and other runs' job folders"
        + (
            "; run as root (as here), a job can also read the worker's memory and environment (CAP_SYS_PTRACE)"
            if root
            else ""
        ),
        "run the worker as a user of its own that owns nothing else and is not root, and run on it only code you "
        "trust as you trust the worker; for untrusted code use kinetic-gke, whose pods hold none of the worker's "
        "secrets (docs/security.md)",
    )
