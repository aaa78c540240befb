"""``kinetic-prefect doctor`` for a kinetic-local pool (``KineticLocalWorker.doctor``): the accelerators named with
``--accelerator`` are in the catalog; a job runs on this machine whatever the name (the accelerator is a wish)."""

from __future__ import annotations

from typing import Any

from kinetic_prefect.shared.doctor import Report, check_accelerator_names


def doctor(report: Report, client: Any, pool: Any, names: list[str], **_: Any) -> None:
    check_accelerator_names(report, names, "a kinetic-local job runs on this machine whatever the name")
